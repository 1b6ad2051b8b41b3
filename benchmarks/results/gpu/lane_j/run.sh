#!/usr/bin/env bash
# GPU lane J (written in session 9, run in session 10: results in ../README.md, "Tenth session"). What lane I left open:
#   bash run.sh confirm  the isolated engine's one-batch fix (server._start_together), measured: the GPT-2-small
#                        shape 64 x 32 (isolated was 1.44x in-process in lane I) and the Llama-1B shape 64 x 128,
#                        in-process and isolated, graphs on and eager; each case alone on the GPU (~6 min)
#   bash run.sh big      the disk's write speed (dd, 4 GiB, direct I/O, then through the page cache with fsync),
#                        then 1,024 x 128 streamed to disk again (lane I: collect 8.36 s for 9.6 GB against bare
#                        3.78 s, 2.21x; is the disk the floor?) (~2 min)
#   bash run.sh a        half A of the engine suite (8 xdist workers) beside the six notebooks (3 workers)
#   bash run.sh b        half B of the engine suite (test_gpu_graphs.py reports its logits gap now)
#   bash run.sh tp       on nvidia-h200-x2 only: STAGES="tp_vllm tp_isolated" TP=2
#   bash run.sh again    (added in session 10 after the first lease) see the case below
# One H200 and 30 min of device time: staging (~70 s), confirm, big, a, b fit (lane G: a 587 s, b 188 s).
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`
# (staged with `bash ../shared/gpu/bundle.sh .gpu ipywidgets nbmake ipykernel`).
set -u
R="${OUT:-benchmarks/results/gpu/lane_j}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1 VLLM_PLUGINS=""
A="tests/test_isolated_lifecycle.py tests/test_isolated.py tests/test_docs.py tests/test_families.py
   tests/test_widgets.py tests/test_stream.py tests/test_interrupt.py tests/test_analyses_llama.py tests/test_browser.py
   tests/test_capture.py tests/test_compat.py tests/test_packaging.py tests/test_pure.py"
B="tests/test_engines_list.py tests/test_bad_input.py tests/test_edits.py tests/test_engine.py tests/test_analyses.py
   tests/test_bad_input_more.py tests/test_capture_scheduling.py tests/test_gpu_exact.py tests/test_gpu_graphs.py
   tests/test_results_io.py tests/test_store.py tests/test_vllm.py"
suite_env() {  # test engines: a fixed 1 GiB KV cache each, so many share a GPU
  export NNVLLM_GPU_MEMORY_UTILIZATION=0.1 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
}
start=$(date +%s)
case "${1:?confirm, big, a, b or tp}" in
  confirm)
    timeout -k 5 "${BENCH_TIMEOUT:-330}" python3 benchmarks/capture_gpu.py --shape gpt2s --prompts 64 --tokens 32 \
      --timeout 110 --root /tmp/b0 --out "$R/gpt2s.json" --cases ${GPT2_CASES:-nv_graphs,nv_isolated,nv_eager,nv_isolated_eager} \
      > "$R/gpt2s.log" 2>&1
    left=$(( ${CONFIRM_TIMEOUT:-570} - ($(date +%s) - start) - 5 ))
    timeout -k 5 "$left" python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 \
      --timeout 120 --root /tmp/b0 --out "$R/llama1b.json" --cases ${LLAMA_CASES:-nv_graphs,nv_isolated} > "$R/llama1b.log" 2>&1 ;;
  big)
    mkdir -p /tmp/b0
    { echo "# dd 4 GiB, oflag=direct"; dd if=/dev/zero of=/tmp/b0/dd.bin bs=16M count=256 oflag=direct 2>&1 | tail -1
      rm -f /tmp/b0/dd.bin
      echo "# dd 4 GiB, page cache + fsync"; dd if=/dev/zero of=/tmp/b0/dd.bin bs=16M count=256 conv=fsync 2>&1 | tail -1
      rm -f /tmp/b0/dd.bin; df -h /tmp | tail -1; } > "$R/disk.txt" 2>&1
    timeout -k 5 "${BENCH_TIMEOUT:-300}" python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128       --timeout 240 --root /tmp/b0 --budget 8GB --out "$R/big.json" > "$R/big.log" 2>&1
    cat "$R/disk.txt" ;;
  a)
    suite_env
    ( OUT="$R/engine_a" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-560}" TESTS="$(echo $A)" \
        PYTEST_ARGS="--durations=40 -o faulthandler_timeout=500" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    ( OUT="$R/notebooks" STAGES=notebooks STAGE_TIMEOUT="${NB_TIMEOUT:-560}" \
        PYTEST_ARGS="--durations=10" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    wait ;;
  b)
    suite_env
    ( OUT="$R/engine_b" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-400}" TESTS="$(echo $B)" \
        PYTEST_ARGS="--durations=40 -o faulthandler_timeout=380" bash scripts/test_gpu.sh > /dev/null 2>&1 ) ;;
  again)  # second lease of session 10: the graph-vs-eager test with its gaps printed; GPT-2 isolated with 7 repeats
    suite_env
    ( OUT="$R/again" STAGES=engine STAGE_TIMEOUT=200 TESTS=tests/test_gpu_graphs.py PYTEST_ARGS="-s" \
        bash scripts/test_gpu.sh > /dev/null 2>&1 )
    timeout -k 5 "${BENCH_TIMEOUT:-300}" python3 benchmarks/capture_gpu.py --shape gpt2s --prompts 64 --tokens 32 \
      --repeats 7 --timeout 110 --root /tmp/b0 --out "$R/again/gpt2s.json" \
      --cases nv_graphs,nv_isolated,bare_nocompile > "$R/again/gpt2s.log" 2>&1
    python3 -c "import json; d=json.load(open('$R/again/gpt2s.json')); print(json.dumps(d['ratios'], indent=1))" ;;
  tp)
    suite_env
    ( OUT="$R/tp" STAGES="tp_vllm tp_isolated" TP=2 STAGE_TIMEOUT="${TP_TIMEOUT:-280}" \
        PYTEST_ARGS="--durations=20" bash scripts/test_gpu.sh > /dev/null 2>&1 ) ;;
esac
echo "wall $(( $(date +%s) - start )) s for '$1'" | tee "$R/wall_$1.txt"
for f in "$R"/*.json; do
  [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], json.dumps({k: v for k, v in d.get('seconds', {}).items() if isinstance(v, float)}), json.dumps(d.get('ratios')), {k: v[-400:] for k, v in d.get('errors', {}).items()})" "$f"
done
tail -n 3 "$R"/*/engine.txt "$R"/*/notebooks.txt "$R"/tp/*.txt 2>/dev/null
grep -h -E "^(FAILED|ERROR) " "$R"/*/*.txt 2>/dev/null | head -40
exit 0
