#!/usr/bin/env bash
# The GPU lane on one nvidia-h200-x2 lease, as run for the results in this folder:
#   GPU 0: the engine suite in three parallel pytest processes (test engines hold ~2 GiB each),
#          plus the fp32 attribution (benchmarks/fp32_gpu.py) and the graph-engine probe;
#   GPU 1: the five notebooks (their engines take vLLM's default 90% of a GPU), then the TP=2
#          stages on both GPUs.
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/lane_b}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1 PYTEST_ARGS="--durations=15 -o faulthandler_timeout=240"
( CUDA_VISIBLE_DEVICES=0 timeout -k 10 400 python3 benchmarks/fp32_gpu.py --out "$R/fp32_gpu.json" --jobs 4 --timeout 150 > "$R/fp32_gpu.log" 2>&1 ) &
( CUDA_VISIBLE_DEVICES=0 timeout -k 10 400 python3 scripts/gpu_probe_graphs.py --timeout 100 > "$R/probe_graphs.log" 2>&1 ) &
( OUT="$R" GPUS="0 0 0" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-480}" bash scripts/test_gpu.sh > /dev/null 2>&1; cp "$R/summary.txt" "$R/summary_engine.txt" ) &
( export CUDA_VISIBLE_DEVICES=1; OUT="$R/nb" STAGES=notebooks STAGE_TIMEOUT=200 bash scripts/test_gpu.sh > /dev/null 2>&1 )
( OUT="$R/tp" STAGES="tp_vllm tp_isolated" TP=2 STAGE_TIMEOUT=150 bash scripts/test_gpu.sh > /dev/null 2>&1 )
wait
tail -n 5 "$R"/summary*.txt "$R"/nb/summary.txt "$R"/tp/summary.txt 2>/dev/null
