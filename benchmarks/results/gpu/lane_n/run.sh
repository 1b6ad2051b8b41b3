#!/usr/bin/env bash
# GPU lane N (session 13, 2026-12-02): the test files sessions 12 and 13 changed, on the H200 (TP=1; the
# TP=2 stage needs an x2 machine, none lent). Session 12's test_store fix (engine facts read from the
# isolated engine's report) was not re-run on a GPU; session 13 changed test_compat (one fresh process),
# test_engine (the C-level warnings test: CPU only, skips here), test_stream (a stop on an isolated
# engine), test_edits (a TP-only test: skips at TP=1), test_isolated_lifecycle (two loads in a row),
# test_isolated (its TP test moved to test_edits).
#   bash run.sh a   test_store, test_compat, test_stream, test_edits, test_engine, test_pure   (~6 min)
#   bash run.sh b   test_isolated_lifecycle, test_isolated                                      (~6 min)
#   bash run.sh c   test_stream again (after the fix for what a found: its stop test asked the isolated toy
#                   for 100 tokens, past its 64-token context)                                  (~2 min)
# From the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
set -u
R="${OUT:-benchmarks/results/gpu/lane_n}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1 VLLM_PLUGINS="" NNVLLM_GPU_MEMORY_UTILIZATION=0.1 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
start=$(date +%s)
case "${1:?a, b or c}" in
  a) TESTS="tests/test_store.py tests/test_compat.py tests/test_stream.py tests/test_edits.py tests/test_engine.py tests/test_pure.py" ;;
  b) TESTS="tests/test_isolated_lifecycle.py tests/test_isolated.py" ;;
  c) TESTS="tests/test_stream.py" ;;
esac
OUT="$R/engine_$1" STAGES=engine STAGE_TIMEOUT="${STAGE_TIMEOUT:-500}" TESTS="$TESTS" \
  PYTEST_ARGS="--durations=15 -o faulthandler_timeout=400" bash scripts/test_gpu.sh > /dev/null 2>&1
echo "wall $(( $(date +%s) - start )) s for '$1'" | tee "$R/wall_$1.txt"
tail -5 "$R/engine_$1"/*.txt 2>/dev/null | tail -20
exit 0
