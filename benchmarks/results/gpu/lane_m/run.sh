#!/usr/bin/env bash
# GPU lane M (session 12, 2026-12-01). Lane L (this session's first lease) found:
#   - GPT-2-small 64 x 32, isolated / in-process 1.147 (lane K: 1.40); the server's add phase (64 requests
#     added while vLLM's scheduler is held) 27.6 ms, not overlapped; the client's decoding of the reply
#     (torch.load, weights_only) ~9 ms.
#   - the 1,024 x 128 collect's chunks of 280 cost two scheduler passes each? (max_num_seqs, graph sizes).
# This lane measures the fixes (replies as JSON; chunks cut by the engine's batch limit, equal sizes):
#   bash run.sh iso   nv_graphs and nv_isolated (15 calls each), then nv_isolated with NNVLLM_ONE_BATCH=0
#                     (the requests trickle in as in-process, no scheduler hold)           (~5 min)
#   bash run.sh big   1,024 x 128 collect (8 GB budget) against bare, plus batch_size 256 and 512, each
#                     beside bare generate and nv.generate in the same chunks              (~3 min)
#   bash run.sh llama Llama-1B 64 x 128: bare_graphs, nv_graphs, nv_isolated (5 calls each)      (~4 min)
#   bash run.sh changed  the test files this session changed (test_isolated, test_store, test_pure) (~4 min)
# (llama and changed ran as inline commands, these exact lines, in the lease that ran iso and big.)
# From the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/lane_m}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1 VLLM_PLUGINS=""
start=$(date +%s)
case "${1:?iso, big, llama or changed}" in
  iso)
    timeout -k 5 "${GPT2_TIMEOUT:-250}" python3 benchmarks/capture_gpu.py --shape gpt2s --prompts 64 --tokens 32 \
      --repeats 15 --timeout 130 --root /tmp/b0 --out "$R/gpt2s.json" --cases nv_graphs,nv_isolated \
      > "$R/gpt2s.log" 2>&1
    NNVLLM_ONE_BATCH=0 timeout -k 5 "${TRICKLE_TIMEOUT:-150}" python3 benchmarks/capture_gpu.py --shape gpt2s \
      --prompts 64 --tokens 32 --repeats 15 --timeout 130 --root /tmp/b0 --out "$R/gpt2s_trickle.json" \
      --cases nv_isolated > "$R/gpt2s_trickle.log" 2>&1 ;;
  big)
    timeout -k 5 "${BENCH_TIMEOUT:-300}" python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128 \
      --timeout 280 --root /tmp/b0 --budget 8GB --big-batches 256,512 --out "$R/big.json" > "$R/big.log" 2>&1 ;;
  llama)
    timeout -k 5 400 python3 benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128 --repeats 5 \
      --timeout 150 --root /tmp/b0 --out "$R/llama1b.json" --cases bare_graphs,nv_graphs,nv_isolated > "$R/llama1b.log" 2>&1 ;;
  changed)
    export NNVLLM_GPU_MEMORY_UTILIZATION=0.1 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
    OUT="$R/engine_changed" STAGES=engine STAGE_TIMEOUT=320 TESTS="tests/test_isolated.py tests/test_store.py tests/test_pure.py" \
      PYTEST_ARGS="--durations=15 -o faulthandler_timeout=300" bash scripts/test_gpu.sh > /dev/null 2>&1 ;;
esac
echo "wall $(( $(date +%s) - start )) s for '$1'" | tee "$R/wall_$1.txt"
for f in "$R"/*.json; do
  [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], json.dumps({k: v for k, v in d.get('seconds', {}).items() if isinstance(v, (float, dict)) and not k.endswith(('timings', 'stats'))}), json.dumps(d.get('ratios')), {k: v[-400:] for k, v in d.get('errors', {}).items()})" "$f"
done
exit 0
