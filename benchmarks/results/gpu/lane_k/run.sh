#!/usr/bin/env bash
# GPU lane K (written in session 10, 2026-12-01, for the next lease; NOT YET RUN). What lane J left open:
#   bash run.sh iso      isolated vs in-process settled: GPT-2-small 64 x 32 with 15 timed calls a case (lane J:
#                        1.26 with 3 calls, 0.87 with 7), beside bare vLLM with nnvllm's graph settings; then the
#                        Llama-1B shape 64 x 128, in-process and isolated, 5 calls each (killed by a timeout in
#                        lane J) (~8 min)
#   bash run.sh big      1,024 x 128 streamed to disk (lane J: 2.16x bare, the disk 1.4-1.6 GB/s), default chunks
#                        and batch_size 128 and 64: does a shorter unoverlapped last shard pay? (~3 min)
#   bash run.sh a        half A of the engine suite beside the six notebooks (lane J: 193 passed; 6 passed)
#   bash run.sh b        half B, test_gpu_graphs.py included (lane J: its only failure, bound since changed)
#   bash run.sh tp       on nvidia-h200-x2 only: the TP=2 stages
# a, b and tp run lane_j/run.sh's modes of the same names (its ENGINE_TIMEOUT, NB_TIMEOUT, TP_TIMEOUT apply;
# lane J ran a with 545 s each, b with 420 s), writing here.
# One H200, 30 min of device time: staging (~70 s + the machine's start, ~150 s counted), iso, big, a, b.
# From the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/lane_k}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1 VLLM_PLUGINS=""
start=$(date +%s)
case "${1:?iso, big, a, b or tp}" in
  iso)
    timeout -k 5 "${GPT2_TIMEOUT:-250}" python3 benchmarks/capture_gpu.py --shape gpt2s --prompts 64 --tokens 32 \
      --repeats 15 --timeout 120 --root /tmp/b0 --out "$R/gpt2s.json" --cases nv_graphs,nv_isolated,bare_nocompile \
      > "$R/gpt2s.log" 2>&1
    left=$(( ${ISO_TIMEOUT:-570} - ($(date +%s) - start) - 5 ))
    timeout -k 5 "$left" python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 --repeats 5 \
      --timeout 150 --root /tmp/b0 --out "$R/llama1b.json" --cases nv_graphs,nv_isolated > "$R/llama1b.log" 2>&1 ;;
  big)
    mkdir -p /tmp/b0
    { dd if=/dev/zero of=/tmp/b0/dd.bin bs=16M count=256 conv=fsync 2>&1 | tail -1; rm -f /tmp/b0/dd.bin; } > "$R/disk.txt"
    timeout -k 5 "${BENCH_TIMEOUT:-400}" python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128 \
      --timeout 380 --root /tmp/b0 --budget 8GB --big-batches 128,64 --out "$R/big.json" > "$R/big.log" 2>&1 ;;
  a|b|tp)  # the suite's halves, the notebooks and TP=2 as lane J ran them (its run.sh), results here
    OUT="$R" bash "$(dirname "$0")/../lane_j/run.sh" "$1"
    exit 0 ;;
esac
echo "wall $(( $(date +%s) - start )) s for '$1'" | tee "$R/wall_$1.txt"
for f in "$R"/*.json; do
  [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], json.dumps({k: v for k, v in d.get('seconds', {}).items() if isinstance(v, (float, dict)) and not k.endswith(('timings', 'stats'))}), json.dumps(d.get('ratios')), {k: v[-400:] for k, v in d.get('errors', {}).items()})" "$f"
done
exit 0
