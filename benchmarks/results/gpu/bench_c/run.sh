#!/usr/bin/env bash
# One nvidia-h200-x2 lease (session 3 of 2026-11-30), one command, as run for the results here.
# GPU 0: the capture benchmark (one process per case, in sequence): the Llama-1B shape 64 x 128
#        ratio cases, then 1,024 x 128 streamed to disk with nv.collect, then its profile.
# GPU 1 at the same time: the engine test suite with every engine replaying CUDA graphs
#        (NNVLLM_CUDA_GRAPHS=1), five pytest processes.
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/bench_c}"
mkdir -p "$R"
( export CUDA_VISIBLE_DEVICES=0
  timeout -k 10 150 python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128 --budget 8GB --timeout 140 \
    --root /tmp/b0 --out "$R/big.json" > "$R/big.log" 2>&1
  timeout -k 10 300 python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 --timeout 95 \
    --root /tmp/b0 --out "$R/llama1b.json" --cases bare_graphs,nv_graphs,nv_isolated > "$R/llama1b.log" 2>&1
  timeout -k 10 120 python3 benchmarks/profile_collect.py --shape llama1b --prompts 1024 --tokens 128 --budget 8GB \
    --root /tmp/b0 --out "$R/profile" > "$R/profile.log" 2>&1 ) &
( export NNVLLM_CUDA_GRAPHS=1 NNVLLM_NO_SETUP=1 PYTEST_ARGS="--durations=15 -o faulthandler_timeout=400"
  OUT="$R/graphs" GPUS="1 1 1 1 1" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-540}" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
wait
python3 - "$R" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    print(f.name, json.dumps(d.get("seconds")), json.dumps(d.get("ratios", {})),
          {k: v[-300:] for k, v in d.get("errors", {}).items()})
PY
tail -n 8 "$R"/graphs/summary.txt 2>/dev/null
