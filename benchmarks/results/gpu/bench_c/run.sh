#!/usr/bin/env bash
# One nvidia-h200-x2 lease (session 3 of 2026-11-30), two commands, as run for the results here.
#   bash run.sh main   GPU 0: the capture benchmark, one process per case in sequence: 1,024 x 128
#                      streamed to disk with nv.collect, the Llama-1B shape 64 x 128 ratio cases,
#                      then the collect profile. GPU 1 at the same time: the engine test suite
#                      (five pytest processes, the default eager engines).
#   bash run.sh tp     The TP=2 stages on both GPUs, nothing beside them.
# Everything is also packed into $R.tar.gz (a run returns at most 8 files).
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/bench_c}"
mkdir -p "$R"
pack() { tar -C "$(dirname "$R")" -czf "$R.tar.gz" "$(basename "$R")" 2>/dev/null; }
( exec > /dev/null 2>&1; sleep "${PACK_AT:-580}"; pack ) &  # a command killed at its limit still returns what it had
sleeper=$!
export NNVLLM_NO_SETUP=1 PYTEST_ARGS="--durations=25 -o faulthandler_timeout=400"
case "${1:-main}" in
  main)
    ( export CUDA_VISIBLE_DEVICES=0 VLLM_PLUGINS=""
      timeout -k 10 150 python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128 --budget 8GB \
        --timeout 140 --root /tmp/b0 --out "$R/big.json" > "$R/big.log" 2>&1
      timeout -k 10 290 python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 --timeout 95 \
        --root /tmp/b0 --out "$R/llama1b.json" --cases bare_graphs,nv_graphs,nv_isolated > "$R/llama1b.log" 2>&1
      timeout -k 10 120 python3 benchmarks/profile_collect.py --shape llama1b --prompts 1024 --tokens 128 \
        --budget 8GB --root /tmp/b0 --out "$R/profile" > "$R/profile.log" 2>&1 ) &
    bench=$!
    ( OUT="$R/lane" GPUS="1 1 1 1 1" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-540}" bash scripts/test_gpu.sh \
        > /dev/null 2>&1 ) &
    lane=$!
    wait $bench $lane ;;
  tp)
    OUT="$R/tp" STAGES="tp_vllm tp_isolated" TP=2 STAGE_TIMEOUT="${TP_TIMEOUT:-260}" bash scripts/test_gpu.sh > /dev/null 2>&1 ;;
esac
pkill -P $sleeper 2>/dev/null; kill $sleeper 2>/dev/null
pack
python3 - "$R" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    print(f.name, json.dumps(d.get("seconds")), json.dumps(d.get("ratios", {})),
          {k: v[-300:] for k, v in d.get("errors", {}).items()})
PY
tail -n 8 "$R"/lane/summary.txt "$R"/tp/summary.txt 2>/dev/null
for f in "$R"/lane/engine_*.txt "$R"/tp/*.txt; do [ -f "$f" ] && echo "$f: $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$f" | tail -1)"; done
grep -h -E "^(FAILED|ERROR) " "$R"/lane/engine_*.txt "$R"/tp/*.txt 2>/dev/null | head -20
exit 0
