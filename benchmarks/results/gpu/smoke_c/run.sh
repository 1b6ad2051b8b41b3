#!/usr/bin/env bash
# A last short check on one H200 (the session's device time was nearly spent): the tests that failed
# in lane_b, with every engine replaying CUDA graphs (NNVLLM_CUDA_GRAPHS=1), four pytest processes at once.
set -u
R="${OUT:-benchmarks/results/gpu/smoke_c}"
mkdir -p "$R"
export NNVLLM_CUDA_GRAPHS=1 VLLM_PLUGINS="" TOKENIZERS_PARALLELISM=false
T="${SMOKE_TIMEOUT:-85}"
( timeout -k 3 "$T" python3 -m pytest -q -ra tests/test_analyses.py -k "patch or compare_vllm" > "$R/analyses.txt" 2>&1 ) &
( timeout -k 3 "$T" python3 -m pytest -q -ra tests/test_widgets.py -k "compare_view_vllm" > "$R/widgets.txt" 2>&1 ) &
( timeout -k 3 "$T" python3 -m pytest -q -ra tests/test_isolated.py -k "loopback or engines_lists" > "$R/isolated.txt" 2>&1 ) &
( timeout -k 3 "$T" python3 -m pytest -q -ra tests/test_capture.py > "$R/capture.txt" 2>&1 ) &
wait
for f in "$R"/*.txt; do echo "$f: $(tail -1 "$f")"; done
