#!/usr/bin/env bash
# OMP_NUM_THREADS A/B (session 14): six engine test files, -n 2, OMP_WAIT_POLICY=PASSIVE in both; 1 thread vs torch's default (2 here).
cd /work/wt
export PYTHONPATH=/work/wt VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
F="tests/test_capture.py tests/test_edits.py tests/test_analyses.py tests/test_capture_scheduling.py tests/test_bad_input_more.py tests/test_widgets.py"
for v in "$@"; do
  if [ $v = one ]; then export OMP_NUM_THREADS=1; else unset OMP_NUM_THREADS; fi
  echo "== $v"; /usr/bin/time -f "%e wall %U user %S sys" /work/main/.venv/bin/python -m pytest -q -n 2 --dist loadfile $F 2>&1 | tail -3
done
