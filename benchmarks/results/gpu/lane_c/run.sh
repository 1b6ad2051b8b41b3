#!/usr/bin/env bash
# The GPU lane on one nvidia-h200-x2 lease, as run for the results in this folder (session 3 of
# 2026-11-30). Run from the repository root after
#   source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH
#   bash run.sh engine   GPU 0: the engine suite in five parallel pytest processes (test engines hold
#                        ~2 GiB each); GPU 1 meanwhile: the five notebooks (their engines take most of
#                        a GPU, so nothing else runs there).
#   bash run.sh tp       The TP=2 stages on both GPUs, and at the same time `profile`:
#   bash run.sh profile  where a big nv.collect spends its time (GPU 1), and the disk's write speed.
set -u
R="${OUT:-benchmarks/results/gpu/lane_c}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1 PYTEST_ARGS="--durations=25 -o faulthandler_timeout=400"
case "${1:-engine}" in
  engine)
    ( OUT="$R" GPUS="0 0 0 0 0" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-540}" bash scripts/test_gpu.sh > /dev/null 2>&1
      cp "$R/summary.txt" "$R/summary_engine.txt" ) &
    ( export CUDA_VISIBLE_DEVICES=1; OUT="$R/nb" STAGES=notebooks STAGE_TIMEOUT="${NB_TIMEOUT:-560}" bash scripts/test_gpu.sh > /dev/null 2>&1 )
    wait ;;
  tp)  # the profile below runs at the same time on GPU 1 (the TP stages' toy engines are a light load)
    bash "$0" profile > /dev/null 2>&1 &
    OUT="$R/tp" STAGES="tp_vllm tp_isolated" TP=2 STAGE_TIMEOUT="${TP_TIMEOUT:-260}" bash scripts/test_gpu.sh > /dev/null 2>&1
    wait; cat "$R/disk.txt"; tail -2 "$R/profile.log" ;;
  profile)
    { for d in /tmp /dev/shm; do
        echo "# dd 4 GiB to $d (conv=fsync)"; dd if=/dev/zero of=$d/nnvllm-dd bs=16M count=256 conv=fsync 2>&1 | tail -1
        rm -f $d/nnvllm-dd; done
      df -h /tmp /dev/shm; nproc; free -g; } > "$R/disk.txt" 2>&1
    CUDA_VISIBLE_DEVICES=1 VLLM_PLUGINS="" timeout -k 10 "${PROFILE_TIMEOUT:-300}" python3 benchmarks/profile_collect.py \
      --shape llama1b --prompts 1024 --tokens 128 --budget 8GB --root /tmp/prof --out "$R/profile" > "$R/profile.log" 2>&1
    cat "$R/disk.txt"; tail -2 "$R/profile.log" ;;
esac
tail -n 8 "$R"/summary*.txt "$R"/nb/summary.txt "$R"/tp/summary.txt 2>/dev/null
