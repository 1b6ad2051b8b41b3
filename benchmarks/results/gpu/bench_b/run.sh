#!/usr/bin/env bash
# Capture benchmarks on one nvidia-h200-x2 lease, as run for the results in this folder.
# GPU 0: the ratio cases side by side (one process per case, in sequence).
# GPU 1 at the same time: the no-compile reference and the fp32 / exact=True cost, then 1,024 x 128
# streamed to disk. The TP=2 test stages ran on both GPUs during this command (light load: toy model).
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/bench_b}"
mkdir -p "$R"
( CUDA_VISIBLE_DEVICES=0 timeout -k 10 500 python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 \
    --timeout 110 --root /tmp/b0 --out "$R/llama1b_gpu0.json" \
    --cases bare_graphs,nv_graphs,nv_graphs_handover_pin,nv_isolated,nv_isolated_handover_pin \
    > "$R/llama1b_gpu0.log" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 10 330 python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 --timeout 110 --root /tmp/b1 \
    --out "$R/llama1b_gpu1.json" --cases bare_nocompile,nv_fp32,nv_fp32_exact > "$R/llama1b_gpu1.log" 2>&1
  timeout -k 10 170 python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128 --budget 8GB --timeout 160 \
    --root /tmp/b1 --out "$R/big_gpu1.json" > "$R/big_gpu1.log" 2>&1 ) &
wait
python3 - "$R" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    print(f.name, json.dumps(d.get("seconds")), json.dumps(d.get("ratios", {}).get("x bare_graphs", {})),
          {k: v[-300:] for k, v in d.get("errors", {}).items()})
PY
