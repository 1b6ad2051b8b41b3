#!/usr/bin/env bash
# GPU lane L (written in session 11, 2026-12-01, for the next lease; NOT YET RUN). What lane K left open:
#   bash run.sh iso      where the isolated engine's ~60 ms a call go (lane K, GPT-2-small 64 x 32: 1.40x in-process,
#                        tokens only 1.45x): the same 15 calls a case, now with the server's phases per call
#                        (per_call[...]["client_server_{lock,arm,add,generate,collect,total}"] beside "client_http")
#                        (~4 min)
#   bash run.sh profile  where a 1,024 x 128 collect's time goes (lane K: 2.04x bare, 2.40x with 64-prompt chunks, so
#                        a per-chunk cost): benchmarks/profile_collect.py, per-chunk wall and worker timings (~2 min)
#   bash run.sh a        half A of the engine suite beside the six notebooks, on the tree whose half B passed in
#                        lane K's second lease (lane K ran half A on the tree before the _one_gc_pass fix)
#   bash run.sh tp       on nvidia-h200-x2 only: the TP=2 stages (never run on a GPU since session 4)
# a and tp run lane_j/run.sh's modes (ENGINE_TIMEOUT, NB_TIMEOUT, TP_TIMEOUT apply; lane K ran a in 313 s).
# From the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/lane_l}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1 VLLM_PLUGINS=""
start=$(date +%s)
case "${1:?iso, profile, a or tp}" in
  iso)
    timeout -k 5 "${GPT2_TIMEOUT:-280}" python3 benchmarks/capture_gpu.py --shape gpt2s --prompts 64 --tokens 32 \
      --repeats 15 --timeout 130 --root /tmp/b0 --out "$R/gpt2s.json" --cases nv_graphs,nv_isolated \
      > "$R/gpt2s.log" 2>&1 ;;
  profile)
    timeout -k 5 "${BENCH_TIMEOUT:-300}" python3 benchmarks/profile_collect.py --shape llama1b --prompts 1024 \
      --tokens 128 --budget 8GB --root /tmp/b0 --out "$R/profile" > "$R/profile.log" 2>&1 ;;
  a|tp)
    OUT="$R" bash "$(dirname "$0")/../lane_j/run.sh" "$1"
    exit 0 ;;
esac
echo "wall $(( $(date +%s) - start )) s for '$1'" | tee "$R/wall_$1.txt"
exit 0
