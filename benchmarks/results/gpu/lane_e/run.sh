#!/usr/bin/env bash
# GPU lane E on one nvidia-h200-x2 lease (session 4, 2026-12-01), one command, as run for the results
# here: what changed after lane D, and what lane D could not finish, plus tensor parallelism.
#   both GPUs: the TP=2 stages (tp_vllm: test_vllm, test_edits, test_stream; tp_isolated), in turn,
#     then on GPU 0 the 64 x 128 capture (nv_graphs, nv_isolated) with its hand-off timings;
#   GPU 1 at the same time, three pytest processes:
#     e_0  test_gpu_graphs (graph steering, nv.patch through edits), test_families -k "gpt_neox or olmo2",
#          test_capture_scheduling (hand-off spares)
#     e_1  test_stream, test_edits, test_analyses, test_pure, test_engines_list
#     e_2  test_isolated (the stream over HTTP, spares, everything isolated)
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
# Everything is also packed into $R.tar.gz (at the end, and at PACK_AT seconds for a killed command).
set -u
R="${OUT:-benchmarks/results/gpu/lane_e}"
mkdir -p "$R"
pack() { tar -C "$(dirname "$R")" -czf "$R.tar.gz" "$(basename "$R")" 2>/dev/null; }
( exec > /dev/null 2>&1; sleep "${PACK_AT:-500}"; pack ) &
sleeper=$!
export NNVLLM_NO_SETUP=1 PYTEST_ARGS="--durations=15 -o faulthandler_timeout=300"
export NNVLLM_GPU_MEMORY_UTILIZATION=0.12 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
T="${STAGE_TIMEOUT:-480}"
start=$(date +%s)
( OUT="$R/tp" STAGES="tp_vllm tp_isolated" TP=2 STAGE_TIMEOUT="$T" bash scripts/test_gpu.sh > /dev/null 2>&1
  # then on GPU 0: where the 64 x 128 capture's hand-off time goes (file preparation stages, spares)
  CUDA_VISIBLE_DEVICES=0 VLLM_PLUGINS="" NNVLLM_GPU_MEMORY_UTILIZATION= NNVLLM_KV_CACHE_MEMORY_BYTES= \
    timeout -k 5 "${BENCH_TIMEOUT:-170}" python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 \
    --tokens 128 --timeout 80 --root /tmp/b0 --out "$R/llama1b.json" --cases nv_graphs,nv_isolated > "$R/llama1b.log" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  ( OUT="$R/e_0" STAGES=engine STAGE_TIMEOUT="$T" TESTS="tests/test_gpu_graphs.py tests/test_capture_scheduling.py" \
      bash scripts/test_gpu.sh > /dev/null 2>&1
    PYTEST_ADDOPTS="-k 'gpt_neox or olmo2'" OUT="$R/e_0f" STAGES=engine STAGE_TIMEOUT="$T" \
      TESTS="tests/test_families.py" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
  ( OUT="$R/e_1" STAGES=engine STAGE_TIMEOUT="$T" TESTS="tests/test_stream.py tests/test_edits.py tests/test_analyses.py tests/test_pure.py tests/test_engines_list.py" \
      bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
  ( OUT="$R/e_2" STAGES=engine STAGE_TIMEOUT="$T" TESTS="tests/test_isolated.py" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
  wait ) &
wait
echo "wall $(( $(date +%s) - start )) s" > "$R/wall.txt"
pkill -P $sleeper 2>/dev/null; kill $sleeper 2>/dev/null
pack
cat "$R/wall.txt"
tail -n 6 "$R"/*/summary.txt 2>/dev/null
for f in "$R"/*/*.txt; do case "$f" in *summary*) ;; *) echo "$f: $(grep -E 'passed|failed|exit' "$f" | tail -1)";; esac; done
grep -h -E "^(FAILED|ERROR) " "$R"/*/*.txt 2>/dev/null | head -30
[ -f "$R/llama1b.json" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('seconds')), {k: v[-600:] for k, v in d.get('errors', {}).items()})" "$R/llama1b.json"
exit 0
