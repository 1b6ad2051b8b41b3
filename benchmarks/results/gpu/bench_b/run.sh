#!/usr/bin/env bash
# Capture benchmarks on one nvidia-h200-x2 lease, as run for the results in this folder.
# GPU 0: the ratio cases side by side (one process per case, in sequence);
# GPU 1 at the same time: the eager and no-compile references, then 1,024 x 128 streamed to disk.
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/bench_b}"
mkdir -p "$R"
( CUDA_VISIBLE_DEVICES=0 timeout -k 10 520 python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 \
    --timeout 100 --root /tmp/b0 --out "$R/llama1b_gpu0.json" \
    --cases bare_graphs,nv_graphs,nv_isolated,nv_graphs_handover_pin,nv_isolated_handover_pin,nv_isolated_handover_plain \
    > "$R/llama1b_gpu0.log" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 10 250 python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 --timeout 100 --root /tmp/b1 \
    --out "$R/llama1b_gpu1.json" --cases bare_nocompile,bare_eager,nv_eager > "$R/llama1b_gpu1.log" 2>&1
  timeout -k 10 270 python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128 --budget 8GB --timeout 260 \
    --root /tmp/b1 --out "$R/big_gpu1.json" > "$R/big_gpu1.log" 2>&1 ) &
wait
python3 - "$R" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    print(f.name, json.dumps(d.get("seconds")), json.dumps(d.get("ratios", {}).get("x bare_graphs", {})), list(d.get("errors", {})))
PY
