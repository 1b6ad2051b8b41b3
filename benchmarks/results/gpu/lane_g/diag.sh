#!/usr/bin/env bash
# Lane G, third command: test_stream.py alone (its stop test hung in `run.sh a`), every Python process
# dumping its threads on SIGUSR1 (a sitecustomize) so a hang shows where engine and client wait;
# then test_capture_scheduling.py (its file-count test raced the background file work in `run.sh b`).
set -u
R="${OUT:-benchmarks/results/gpu/lane_g}/diag"
mkdir -p "$R" /tmp/fh
cat > /tmp/fh/sitecustomize.py <<'PY'
import faulthandler, os, signal
try:
    faulthandler.register(signal.SIGUSR1, file=open(f"/tmp/fh/{os.getpid()}.txt", "w"), all_threads=True)
except Exception:
    pass
PY
export PYTHONPATH=/tmp/fh:$PYTHONPATH NNVLLM_NO_SETUP=1
export NNVLLM_GPU_MEMORY_UTILIZATION=0.1 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
desc() { for c in $(pgrep -P "$1"); do echo "$c"; desc "$c"; done; }
start=$(date +%s)
timeout -k 5 "${STREAM_TIMEOUT:-200}" python3 -m pytest -v -v -rA tests/test_stream.py --durations=10 \
  -o faulthandler_timeout="${FH:-140}" > "$R/stream.txt" 2>&1 &
P=$!
( sleep "${DUMP_AT:-160}"; kill -USR1 $(desc $P) 2>/dev/null; sleep 3; for f in /tmp/fh/*.txt; do
    [ -s "$f" ] && { echo "== $f: $(cat /proc/$(basename "$f" .txt)/cmdline 2>/dev/null | tr '\0' ' ' | head -c 200)"; cat "$f"; }
  done > "$R/dumps.txt" ) &
D=$!
wait $P; echo "stream exit $? after $(( $(date +%s) - start )) s" >> "$R/stream.txt"
kill $D 2>/dev/null
timeout -k 5 "${SCHED_TIMEOUT:-150}" python3 -m pytest -v -v -n 4 tests/test_capture_scheduling.py > "$R/sched.txt" 2>&1
echo "sched exit $? after $(( $(date +%s) - start )) s" >> "$R/sched.txt"
tail -3 "$R/stream.txt" "$R/sched.txt"; grep -h -E "^(FAILED|ERROR)" "$R"/*.txt | head; ls -la "$R"
