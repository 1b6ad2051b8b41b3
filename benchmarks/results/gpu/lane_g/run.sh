#!/usr/bin/env bash
# GPU lane G (session 7, 2026-12-01): again only one nvidia-h200 lent; everything on GPU 0. Same as lane F,
# except that `b` is the second half alone and `bench` runs in its own command.
#   bash run.sh a      first half of the engine suite (scripts/test_gpu.sh, stage engine: one pytest with
#                      8 xdist workers, files whole per worker, the slowest first) and, beside it, the six
#                      notebooks (stage notebooks, 3 xdist workers).
#   bash run.sh b      second half of the engine suite.
#   bash run.sh bench  alone on the GPU, the 64 x 128 Llama-1B-shape capture with its hand-off and client
#                      timings (bare graphs, nnvllm in-process, isolated).
#   bash run.sh lane   the first attempt: the whole engine suite beside the notebooks in one command.
# As run: see the README's "Seventh session".
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
# Everything is also packed into $R.tar.gz (at the end, and at PACK_AT seconds for a killed command).
set -u
R="${OUT:-benchmarks/results/gpu/lane_g}"
mkdir -p "$R"
pack() { tar -C "$(dirname "$R")" -czf "$R.tar.gz" "$(basename "$R")" 2>/dev/null; }
( exec > /dev/null 2>&1; sleep "${PACK_AT:-570}"; pack ) &
sleeper=$!
export NNVLLM_NO_SETUP=1
# every test engine holds a fixed 1 GiB KV cache; vLLM's start check then needs only a tenth of the GPU free
export NNVLLM_GPU_MEMORY_UTILIZATION=0.1 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
# The engine suite in two halves, one per command (one command alone could not hold it: `lane` below,
# run first, reached ~95% in 550 s with the notebooks beside it).
A="tests/test_isolated_lifecycle.py tests/test_isolated.py tests/test_docs.py tests/test_families.py
   tests/test_widgets.py tests/test_stream.py tests/test_interrupt.py tests/test_analyses_llama.py tests/test_browser.py
   tests/test_capture.py tests/test_compat.py tests/test_packaging.py tests/test_pure.py"
B="tests/test_engines_list.py tests/test_bad_input.py tests/test_edits.py tests/test_engine.py tests/test_analyses.py
   tests/test_bad_input_more.py tests/test_capture_scheduling.py tests/test_gpu_exact.py tests/test_gpu_graphs.py
   tests/test_results_io.py tests/test_store.py tests/test_vllm.py"
engine() {  # name, timeout, files
  ( OUT="$R/$1" STAGES=engine STAGE_TIMEOUT="$2" TESTS="$(echo $3)" \
      PYTEST_ARGS="--durations=40 -o faulthandler_timeout=500" \
      bash scripts/test_gpu.sh > /dev/null 2>&1 )
}
notebooks() {
  ( OUT="$R/notebooks" STAGES=notebooks STAGE_TIMEOUT="${NB_TIMEOUT:-550}" \
      PYTEST_ARGS="--durations=10" bash scripts/test_gpu.sh > /dev/null 2>&1 )
}
bench() {
  ( unset NNVLLM_GPU_MEMORY_UTILIZATION NNVLLM_KV_CACHE_MEMORY_BYTES
    VLLM_PLUGINS="" timeout -k 5 "${BENCH_TIMEOUT:-330}" python3 benchmarks/capture_gpu.py --shape llama1b \
      --prompts 64 --tokens 128 --timeout 100 --root /tmp/b0 --out "$R/llama1b.json" \
      --cases bare_graphs,nv_graphs,nv_isolated > "$R/llama1b.log" 2>&1 )
}
start=$(date +%s)
case "${1:-a}" in
  a)  # first half of the engine suite and the notebooks, side by side
    engine engine_a "${ENGINE_TIMEOUT:-560}" "$A" &
    notebooks &
    wait ;;
  b)  # second half of the engine suite
    engine engine_b "${ENGINE_TIMEOUT:-320}" "$B" ;;
  lane)  # (the first attempt) the whole engine suite, the slowest files first, beside the notebooks
    engine engine "${ENGINE_TIMEOUT:-550}" "$A $B" &
    notebooks &
    wait ;;
  bench) bench ;;
esac
echo "wall $(( $(date +%s) - start )) s for '${1:-a}'" > "$R/wall_${1:-a}.txt"
pkill -P $sleeper 2>/dev/null; kill $sleeper 2>/dev/null
pack
cat "$R"/wall_*.txt
tail -n 2 "$R"/*/summary.txt 2>/dev/null
for f in "$R"/*/*.txt; do case "$f" in *summary*) ;; *) echo "$f: $(grep -E 'passed|failed|exit' "$f" | tail -2 | tr '\n' ' ')";; esac; done
grep -h -E "^(FAILED|ERROR) " "$R"/*/*.txt 2>/dev/null | head -40
[ -f "$R/llama1b.json" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('seconds')), json.dumps(d.get('ratios')), {k: v[-600:] for k, v in d.get('errors', {}).items()})" "$R/llama1b.json"
exit 0
