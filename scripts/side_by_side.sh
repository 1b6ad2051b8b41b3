#!/usr/bin/env bash
# Run stages side by side: side_by_side.sh NAME "COMMAND" [NAME "COMMAND" ...]
# Each command's output goes to its own log; when all have ended, each log is printed in the order
# given, under its name, with its exit status and wall time. Exits 1 if any command failed.
# (make test: on the 2-core CI machine the TP=2 stage, the notebooks and the docs build each leave a
# core idle part of the time; side by side they share the two.)
set -u
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
names=() pids=()
start=$(date +%s)
while [ $# -ge 2 ]; do
  i=${#names[@]}
  names+=("$1")
  ( s=$(date +%s); bash -c "$2" > "$dir/$i.log" 2>&1; rc=$?; echo "$rc $(( $(date +%s) - s ))" > "$dir/$i.rc" ) &
  pids+=($!)
  shift 2
done
[ $# -eq 0 ] || { echo "side_by_side.sh: expected NAME COMMAND pairs" >&2; exit 2; }
wait "${pids[@]}"
failed=0
for i in "${!names[@]}"; do
  read -r rc secs < "$dir/$i.rc"
  echo "==== ${names[$i]}: exit $rc after ${secs}s"
  cat "$dir/$i.log"
  [ "$rc" -eq 0 ] || failed=1
done
echo "==== side by side: $(( $(date +%s) - start ))s for ${#names[@]} stages"
exit $failed
