#!/usr/bin/env bash
# The GPU lane on one nvidia-h200-x2 lease (session 4, 2026-12-01), as run for the results here.
# Run from the repository root after
#   source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH
#   bash run.sh engine   GPU 0: the engine suite in five parallel pytest processes; GPU 1 meanwhile:
#                        the notebooks (nbmake; their engines take most of a GPU).
#   bash run.sh single   On one nvidia-h200 (no x2 was lent): the engine suite in five pytest processes
#                        and the notebooks in two, all on GPU 0 at once.
#   bash run.sh bench    GPU 0 alone: 1,024 x 128 (Llama-1B shape) streamed to disk with nv.collect vs
#                        bare, then 64 x 128: bare graphs, nv in-process and isolated, steering.
#   bash run.sh tp       The TP=2 stages on both GPUs, nothing beside them; then on GPU 0 alone
#                        1,024 x 128 (Llama-1B shape) streamed to disk with nv.collect vs bare.
# Everything is also packed into $R.tar.gz (a run returns at most 8 files; also packed at 580 s).
set -u
R="${OUT:-benchmarks/results/gpu/lane_d}"
mkdir -p "$R"
pack() { tar -C "$(dirname "$R")" -czf "$R.tar.gz" "$(basename "$R")" 2>/dev/null; }
( exec > /dev/null 2>&1; sleep "${PACK_AT:-580}"; pack ) &
sleeper=$!
export NNVLLM_NO_SETUP=1 PYTEST_ARGS="--durations=25 -o faulthandler_timeout=400"
start=$(date +%s)
case "${1:-engine}" in
  engine)
    ( OUT="$R/engine" GPUS="0 0 0 0 0" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-540}" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    # notebooks in two processes on GPU 1, each engine held to a fifth of it (notebook 05 holds three at once) (as tests/conftest.py does)
    export NNVLLM_GPU_MEMORY_UTILIZATION=0.2 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
    ( export CUDA_VISIBLE_DEVICES=1 NOTEBOOKS="notebooks/01_*.ipynb notebooks/02_*.ipynb notebooks/03_*.ipynb"
      OUT="$R/nb_a" STAGES=notebooks STAGE_TIMEOUT="${NB_TIMEOUT:-560}" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    ( export CUDA_VISIBLE_DEVICES=1 NOTEBOOKS="notebooks/04_*.ipynb notebooks/05_*.ipynb notebooks/06_*.ipynb"
      OUT="$R/nb_b" STAGES=notebooks STAGE_TIMEOUT="${NB_TIMEOUT:-560}" bash scripts/test_gpu.sh > /dev/null 2>&1 )
    wait ;;
  single)
    export NNVLLM_GPU_MEMORY_UTILIZATION=0.1 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
    ( OUT="$R/engine" GPUS="0 0 0 0 0" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-560}" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    ( export CUDA_VISIBLE_DEVICES=0 NOTEBOOKS="notebooks/01_*.ipynb notebooks/02_*.ipynb notebooks/03_*.ipynb"
      OUT="$R/nb_a" STAGES=notebooks STAGE_TIMEOUT="${NB_TIMEOUT:-560}" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    ( export CUDA_VISIBLE_DEVICES=0 NOTEBOOKS="notebooks/04_*.ipynb notebooks/05_*.ipynb notebooks/06_*.ipynb"
      OUT="$R/nb_b" STAGES=notebooks STAGE_TIMEOUT="${NB_TIMEOUT:-560}" bash scripts/test_gpu.sh > /dev/null 2>&1 )
    wait ;;
  bench)
    export CUDA_VISIBLE_DEVICES=0 VLLM_PLUGINS=""
    timeout -k 10 170 python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128 --budget 8GB \
      --timeout 160 --root /tmp/b0 --out "$R/big.json" > "$R/big.log" 2>&1
    timeout -k 10 390 python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 --timeout 110 \
      --root /tmp/b0 --out "$R/llama1b.json" --cases bare_graphs,nv_graphs,nv_isolated,nv_steer,nv_steer_eager \
      > "$R/llama1b.log" 2>&1 ;;
  tp)
    OUT="$R/tp" STAGES="tp_vllm tp_isolated" TP=2 STAGE_TIMEOUT="${TP_TIMEOUT:-260}" bash scripts/test_gpu.sh > /dev/null 2>&1
    CUDA_VISIBLE_DEVICES=0 VLLM_PLUGINS="" timeout -k 10 "${BIG_TIMEOUT:-200}" python3 benchmarks/capture_gpu.py \
      --shape llama1b --big 1024 --tokens 128 --budget 8GB --timeout 190 --root /tmp/b0 --out "$R/big.json" > "$R/big.log" 2>&1 ;;
esac
echo "wall $(( $(date +%s) - start )) s for '$1'" >> "$R/wall.txt"
pkill -P $sleeper 2>/dev/null; kill $sleeper 2>/dev/null
pack
cat "$R/wall.txt"
tail -n 8 "$R"/engine/summary.txt "$R"/nb_a/summary.txt "$R"/nb_b/summary.txt "$R"/tp/summary.txt 2>/dev/null
for f in "$R"/engine/engine_*.txt "$R"/nb_a/*.txt "$R"/nb_b/*.txt "$R"/tp/*.txt; do [ -f "$f" ] && echo "$f: $(grep -E 'passed|failed' "$f" | tail -1)"; done
grep -h -E "^(FAILED|ERROR) " "$R"/engine/engine_*.txt "$R"/nb_a/*.txt "$R"/nb_b/*.txt "$R"/tp/*.txt 2>/dev/null | head -30
for f in "$R"/*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], json.dumps(d.get('seconds')), json.dumps(d.get('ratios')), {k: v[-600:] for k, v in d.get('errors', {}).items()})" "$f"; done
exit 0
