#!/usr/bin/env bash
# GPU lane I (session 9, 2026-12-01): one `nvidia-h200` lent (no x2), 30 min of device time, ten minutes
# per command. Issue 9's benchmark with every case (benchmarks/capture_gpu.py, ALL_CASES), split over
# three commands sent back to back on the same warm machine, each case alone on the GPU in its own process:
#   bash run.sh llama_a   Llama-1B shape 64 x 128: bare_graphs, bare_eager, nv_graphs, nv_eager, nv_isolated,
#                         nv_isolated_eager                                   -> llama1b_a.json
#   bash run.sh llama_b   the same workload: vllm_lens, hf_nnsight, nnsight_taps -> llama1b_b.json;
#                         then 1,024 x 128 streamed to disk (nv.collect, 8 GB budget) -> big.json
#   bash run.sh gpt2s     GPT-2-small shape 64 x 32, every case               -> gpt2s.json
#   bash run.sh tests     tests/test_stream.py, tests/test_isolated.py, tests/test_capture_scheduling.py
#                         (the fixes of sessions 7 and 8, never run on a GPU) -> tests/
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`
# (staged with `bash ../shared/gpu/bundle.sh .gpu vllm-lens==1.2.1 ipywidgets nbmake ipykernel`).
# benchmarks/results/gpu/lane_i/merge.py joins llama1b_a.json and llama1b_b.json into llama1b.json.
set -u
R="${OUT:-benchmarks/results/gpu/lane_i}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1
B="timeout -k 5 ${BENCH_TIMEOUT:-575} python3 benchmarks/capture_gpu.py"
start=$(date +%s)
case "${1:?llama_a, llama_b, gpt2s or tests}" in
  llama_a)
    $B --shape llama1b --prompts 64 --tokens 128 --timeout 150 --root /tmp/b0 --out "$R/llama1b_a.json" \
       --cases bare_graphs,bare_eager,nv_graphs,nv_eager,nv_isolated,nv_isolated_eager > "$R/llama1b_a.log" 2>&1 ;;
  llama_b)
    $B --shape llama1b --prompts 64 --tokens 128 --timeout 200 --root /tmp/b0 --out "$R/llama1b_b.json" \
       --cases vllm_lens,hf_nnsight,nnsight_taps > "$R/llama1b_b.log" 2>&1
    left=$(( ${BENCH_TIMEOUT:-575} - ($(date +%s) - start) - 5 ))
    timeout -k 5 "$left" python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128 --timeout 200 \
       --root /tmp/b0 --budget 8GB --out "$R/big.json" > "$R/big.log" 2>&1 ;;
  gpt2s)
    $B --shape gpt2s --prompts 64 --tokens 32 --timeout 120 --root /tmp/b0 --out "$R/gpt2s.json" \
       --cases bare_graphs,bare_eager,nv_graphs,nv_eager,nv_isolated,nv_isolated_eager,hf_nnsight,nnsight_taps \
       > "$R/gpt2s.log" 2>&1 ;;
  tests)
    export NNVLLM_GPU_MEMORY_UTILIZATION=0.1 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
    ( OUT="$R/tests" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-560}" \
        TESTS="tests/test_stream.py tests/test_isolated.py tests/test_capture_scheduling.py" \
        PYTEST_ARGS="--durations=20 -o faulthandler_timeout=500" bash scripts/test_gpu.sh > /dev/null 2>&1 ) ;;
esac
echo "wall $(( $(date +%s) - start )) s for '$1'" | tee "$R/wall_$1.txt"
for f in "$R"/*.json; do
  [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], json.dumps(d.get('seconds')), json.dumps(d.get('ratios')), {k: v[-400:] for k, v in d.get('errors', {}).items()})" "$f"
done
tail -n 3 "$R"/tests/*.txt 2>/dev/null
exit 0
