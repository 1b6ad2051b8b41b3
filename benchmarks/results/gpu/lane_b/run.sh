#!/usr/bin/env bash
# The GPU lane on one nvidia-h200-x2 lease, in two commands, as run for the results in this folder.
#   bash run.sh engine   GPU 0: the engine suite in five parallel pytest processes (test engines hold
#                        ~2 GiB each), the graph-engine probe and the fp32 attribution for the tiny
#                        Llama; GPU 1 meanwhile: the five notebooks (their engines take vLLM's default
#                        90% of a GPU, so nothing else runs there).
#   bash run.sh tp       The TP=2 stages on both GPUs.
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/lane_b}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1 PYTEST_ARGS="--durations=20 -o faulthandler_timeout=300"
case "${1:-engine}" in
  engine)
    ( CUDA_VISIBLE_DEVICES=0 timeout -k 10 420 python3 benchmarks/fp32_gpu.py --out "$R/fp32_gpu.json" \
        --variants vllm_default,vllm_triton_ieee,vllm_attn_flex --jobs 3 --timeout 300 > "$R/fp32_gpu.log" 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=0 timeout -k 10 420 python3 scripts/gpu_probe_graphs.py --timeout 120 \
        --cases trace_edit,trace_decode_edit,patch > "$R/probe_graphs.log" 2>&1 ) &
    ( OUT="$R" GPUS="0 0 0 0 0" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-500}" bash scripts/test_gpu.sh > /dev/null 2>&1
      cp "$R/summary.txt" "$R/summary_engine.txt" ) &
    ( export CUDA_VISIBLE_DEVICES=1; OUT="$R/nb" STAGES=notebooks STAGE_TIMEOUT=500 bash scripts/test_gpu.sh > /dev/null 2>&1 )
    wait ;;
  tp)
    OUT="$R/tp" STAGES="tp_vllm tp_isolated" TP=2 STAGE_TIMEOUT="${TP_TIMEOUT:-260}" bash scripts/test_gpu.sh > /dev/null 2>&1 ;;
esac
tail -n 8 "$R"/summary*.txt "$R"/nb/summary.txt "$R"/tp/summary.txt 2>/dev/null
