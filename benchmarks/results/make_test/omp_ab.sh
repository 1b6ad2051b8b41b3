#!/usr/bin/env bash
# OMP_WAIT_POLICY A/B (session 13): six engine test files, -n 2, spinning (libgomp default) vs PASSIVE.
# omp_ab_1.log ran default then PASSIVE; omp_ab_2.log (this script as is) PASSIVE then default.
cd /work/wt
export PYTHONPATH=/work/wt VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
F="tests/test_capture.py tests/test_edits.py tests/test_analyses.py tests/test_capture_scheduling.py tests/test_bad_input_more.py tests/test_widgets.py"
for v in PASSIVE default; do
  if [ $v = PASSIVE ]; then export OMP_WAIT_POLICY=PASSIVE; else unset OMP_WAIT_POLICY; fi
  echo "== $v"; /usr/bin/time -f "%e wall %U user %S sys" /work/main/.venv/bin/python -m pytest -q -n 2 --dist loadfile $F 2>&1 | tail -3
done
