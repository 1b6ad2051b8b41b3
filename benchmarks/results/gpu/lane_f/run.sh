#!/usr/bin/env bash
# GPU lane F (session 6, 2026-12-01): only one nvidia-h200 was lent (no x2), so everything on GPU 0.
#   bash run.sh lane    the engine suite (scripts/test_gpu.sh, stage engine: one pytest with 8 xdist
#                       workers, files whole per worker, the slowest files first) and, at the same time,
#                       the six notebooks (stage notebooks, 3 xdist workers).
#   bash run.sh bench   the 64 x 128 Llama-1B-shape capture with its hand-off and client timings
#                       (bare graphs, nnvllm in-process and isolated), alone on the GPU; then the tests
#                       that failed in `lane` again (pytest --lf), if any.
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`.
# Everything is also packed into $R.tar.gz (at the end, and at PACK_AT seconds for a killed command).
set -u
R="${OUT:-benchmarks/results/gpu/lane_f}"
mkdir -p "$R"
pack() { tar -C "$(dirname "$R")" -czf "$R.tar.gz" "$(basename "$R")" 2>/dev/null; }
( exec > /dev/null 2>&1; sleep "${PACK_AT:-570}"; pack ) &
sleeper=$!
export NNVLLM_NO_SETUP=1
# every test engine holds a fixed 1 GiB KV cache; vLLM's start check then needs only a tenth of the GPU free
export NNVLLM_GPU_MEMORY_UTILIZATION=0.1 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
start=$(date +%s)
case "${1:-lane}" in
  lane)
    # the slowest files first (lane D/E durations), so no long file starts last; then the rest of tests/
    heavy="tests/test_isolated_lifecycle.py tests/test_isolated.py tests/test_docs.py tests/test_engines_list.py
           tests/test_families.py tests/test_widgets.py tests/test_bad_input.py tests/test_stream.py tests/test_edits.py
           tests/test_interrupt.py tests/test_engine.py tests/test_analyses_llama.py"
    ( OUT="$R/engine" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-550}" TESTS="$(echo $heavy $(ls tests/test_*.py | grep -v -x -F -f <(printf '%s\n' $heavy)))" \
        PYTEST_ARGS="-n ${WORKERS:-8} --dist loadfile --durations=40 -o faulthandler_timeout=500" \
        bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    ( OUT="$R/notebooks" STAGES=notebooks STAGE_TIMEOUT="${NB_TIMEOUT:-550}" \
        PYTEST_ARGS="-n ${NB_WORKERS:-3} --durations=10" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    wait ;;
  bench)
    ( unset NNVLLM_GPU_MEMORY_UTILIZATION NNVLLM_KV_CACHE_MEMORY_BYTES
      VLLM_PLUGINS="" timeout -k 5 "${BENCH_TIMEOUT:-300}" python3 benchmarks/capture_gpu.py --shape llama1b \
        --prompts 64 --tokens 128 --timeout 120 --root /tmp/b0 --out "$R/llama1b.json" \
        --cases bare_graphs,nv_graphs,nv_isolated > "$R/llama1b.log" 2>&1 )
    # the tests and notebooks that failed in `lane` (from its logs' short summaries), run again
    mapfile -t again < <(grep -h -E "^(FAILED|ERROR) " "$R"/engine/*.txt "$R"/notebooks/*.txt 2>/dev/null \
                         | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' | sort -u)
    if [ "${#again[@]}" -gt 0 ]; then
      printf '%s\n' "${again[@]}" > "$R/again_ids.txt"
      timeout -k 10 "${AGAIN_TIMEOUT:-240}" env VLLM_PLUGINS="" python3 -m pytest -q -ra \
        -n "$(( ${#again[@]} < 4 ? ${#again[@]} : 4 ))" --dist loadfile --durations=20 --nbmake "${again[@]}" \
        > "$R/again.txt" 2>&1
      echo "# exit $?" >> "$R/again.txt"
    fi ;;
esac
echo "wall $(( $(date +%s) - start )) s for '${1:-lane}'" > "$R/wall_${1:-lane}.txt"
pkill -P $sleeper 2>/dev/null; kill $sleeper 2>/dev/null
pack
cat "$R"/wall_*.txt
tail -n 4 "$R"/*/summary.txt 2>/dev/null
for f in "$R"/*/*.txt "$R"/again.txt; do case "$f" in *summary*) ;; *) echo "$f: $(grep -E 'passed|failed|exit' "$f" | tail -2 | tr '\n' ' ')";; esac; done
grep -h -E "^(FAILED|ERROR) " "$R"/*/*.txt 2>/dev/null | head -40
[ -f "$R/llama1b.json" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('seconds')), json.dumps(d.get('ratios')), {k: v[-600:] for k, v in d.get('errors', {}).items()})" "$R/llama1b.json"
exit 0
