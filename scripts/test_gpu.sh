#!/usr/bin/env bash
# The GPU lane: the engine test suite, the notebooks and, with --tp 2, the tensor-parallel tests, on CUDA.
#
#   scripts/test_gpu.sh [--tp N]        (or TP=N scripts/test_gpu.sh; make test-gpu GPU_TP=N)
#
# On a lent H200 (vLLM and nnsight come from the staged bundle, see shared/gpu/README.md):
#   source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH && bash scripts/test_gpu.sh
#
# Stages (each continues after a failure; the script exits 1 at the end if any stage failed):
#   engine     python3 -m pytest -q -ra $TESTS --tp 1          (TESTS defaults to tests/)
#   notebooks  python3 -m pytest -q -ra --nbmake notebooks/    (needs nbmake + ipykernel + ipywidgets)
#   tp_vllm    python3 -m pytest -q -ra tests/test_vllm.py tests/test_edits.py tests/test_stream.py --tp N  (only with N >= 2;
#              the llama engine there is isolated, so this covers both transports: tests/conftest.py seed_engine)
# Environment:
#   OUT              where each stage's log goes (default benchmarks/results/gpu/); also summary.txt and
#                    fidelity_<stage>.json (every vLLM-vs-transformers check with its calibrated bound)
#   STAGES           a subset to run, e.g. STAGES="engine" or STAGES="tp_vllm"
#   NOTEBOOKS        what the notebooks stage runs (default notebooks/), e.g. "notebooks/0[1-3]*.ipynb"
#   TESTS            what the engine stage runs (default tests/), e.g. "tests/test_capture.py tests/test_vllm.py"
#   STAGE_TIMEOUT    seconds per stage (default: none)
#   GPUS             split the engine stage into parallel pytest processes, one per entry, each with
#                    CUDA_VISIBLE_DEVICES set to it (e.g. GPUS="0 0 1": two on GPU 0, one on GPU 1);
#                    test files are dealt out by size (scripts/split_tests.py), logs in engine_<k>.txt.
#                    Test engines hold ~2 GiB each (tests/conftest.py), so several share a GPU.
#   WORKERS          pytest-xdist workers for the engine stage (default 8 where xdist imports, else none:
#                    one process); files stay whole on a worker, test_families.py's families are dealt
#                    out one by one (tests/conftest.py). Lane F: 8 workers on one H200, engine starts
#                    ~60 s each then (benchmarks/results/gpu/README.md). NB_WORKERS: the same for the
#                    notebooks (default 3). 0: no xdist.
#   PYTEST_ARGS      extra pytest arguments for every stage (e.g. "--durations=20")
#   NNVLLM_NO_SETUP=1  never create a venv; use python3 as it is
#   PYTHON           the interpreter (default python3)
# Without NNVLLM_NO_SETUP and with no interpreter that imports vllm and nnsight, `make setup` builds .venv.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TP="${TP:-1}"
while [ $# -gt 0 ]; do
  case "$1" in
    --tp) TP="${2:?--tp needs a number}"; shift 2 ;;
    --tp=*) TP="${1#--tp=}"; shift ;;
    -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "test_gpu.sh: unknown argument '$1' (expected --tp N)" >&2; exit 2 ;;
  esac
done
case "$TP" in ''|*[!0-9]*) echo "test_gpu.sh: --tp/TP must be a number, got '$TP'" >&2; exit 2 ;; esac

# A vLLM general plugin (vllm-lens is one) loads into every vLLM process and nnsight's engine then
# fails to start; keep all plugins out.
export VLLM_PLUGINS=""
export TOKENIZERS_PARALLELISM=false
OUT_DIR="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT_DIR"

PY="${PYTHON:-python3}"
if ! "$PY" -c "import vllm, nnsight" >/dev/null 2>&1; then
  if [ "${NNVLLM_NO_SETUP:-0}" = 1 ]; then
    echo "test_gpu.sh: $PY cannot import vllm and nnsight, and NNVLLM_NO_SETUP=1 forbids a venv." >&2
    echo "  On the H200: source /root/nnvllm-gpu.env && export PYTHONPATH=\$PWD:\$PYTHONPATH" >&2
    exit 2
  fi
  echo "test_gpu.sh: $PY cannot import vllm and nnsight; building .venv with make setup"
  make setup || { echo "test_gpu.sh: make setup failed" >&2; exit 2; }
  PY=.venv/bin/python
fi

if [ -z "${STAGES:-}" ]; then
  STAGES="engine notebooks"
  [ "$TP" -ge 2 ] && STAGES="$STAGES tp_vllm"
fi

versions=$("$PY" - <<'EOF' 2>/dev/null
import importlib, importlib.metadata, sys
def v(name):
    try:
        mod = importlib.import_module(name)
    except Exception as e:
        return f"missing({type(e).__name__})"
    try:
        return getattr(mod, "__version__", None) or importlib.metadata.version(name)
    except Exception:
        return "?"
torch = importlib.import_module("torch")
cuda = f"cuda {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no CUDA"
print(f"python {sys.version.split()[0]} | torch {torch.__version__} ({cuda}) | vllm {v('vllm')} | "
      f"nnsight {v('nnsight')} | transformers {v('transformers')} | nbmake {v('nbmake')} | "
      f"ipywidgets {v('ipywidgets')}")
EOF
)
gpus=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 || echo "no nvidia-smi") | tr '\n' ';' | sed 's/;$//')
rev=$(git rev-parse --short HEAD 2>/dev/null || echo "no git")
dirty=$(git status --porcelain 2>/dev/null | grep -qv '^??' && echo "+local changes" || true)
# A copy of a working tree can carry a stale HEAD (the lent GPU machine's does): name the code that
# ran by a hash of its files too (compare with the same command on the machine that sent it).
code=$(find nnvllm tests scripts -name '*.py' -o -name '*.sh' 2>/dev/null | LC_ALL=C sort | xargs cat 2>/dev/null | sha256sum | cut -c1-12)
rev="$rev (code $code)"

# Parallel stages where pytest-xdist is there; -v -v names every test as it ends (a killed stage's log
# then says what ran).
XDIST_ENGINE="" XDIST_NB=""
if "$PY" -c "import xdist" >/dev/null 2>&1; then
  [ "${WORKERS:-8}" -gt 0 ] && XDIST_ENGINE="-v -v -n ${WORKERS:-8} --dist loadfile"
  [ "${NB_WORKERS:-3}" -gt 0 ] && XDIST_NB="-v -v -n ${NB_WORKERS:-3}"
fi

declare -a names rcs secs
failed=0
run_stage() {  # name, then the command
  local name="$1"; shift
  local log="$OUT_DIR/$name.txt" t0 rc
  {
    echo "# stage $name: $*"
    echo "# date $(date -u '+%Y-%m-%dT%H:%M:%SZ') | nnvllm $rev$dirty | TP=$TP | VLLM_PLUGINS='$VLLM_PLUGINS'"
    echo "# nvidia-smi -L: $gpus"
    echo "# versions: $versions"
  } | tee "$log"
  t0=$(date +%s)
  if [ -n "${STAGE_TIMEOUT:-}" ]; then
    timeout -k 30 "$STAGE_TIMEOUT" "$@" 2>&1 | tee -a "$log"; rc=${PIPESTATUS[0]}
  else
    "$@" 2>&1 | tee -a "$log"; rc=${PIPESTATUS[0]}
  fi
  local dt=$(( $(date +%s) - t0 ))
  echo "# stage $name: exit $rc after ${dt}s" | tee -a "$log"
  names+=("$name"); rcs+=("$rc"); secs+=("$dt")
  [ "$rc" -eq 0 ] || failed=1
}

for stage in $STAGES; do
  case "$stage" in
    engine)
      if [ -z "${GPUS:-}" ]; then
        NNVLLM_FIDELITY_JSON="$OUT_DIR/fidelity_engine.json" \
          run_stage engine "$PY" -m pytest -q -ra $XDIST_ENGINE ${PYTEST_ARGS:-} ${TESTS:-tests/} --tp 1
      else
        read -r -a gpus <<< "$GPUS"
        mapfile -t shares < <("$PY" scripts/split_tests.py "${#gpus[@]}" ${TESTS:-tests/})
        pids=()
        for k in "${!gpus[@]}"; do
          ( CUDA_VISIBLE_DEVICES="${gpus[$k]}" NNVLLM_FIDELITY_JSON="$OUT_DIR/fidelity_engine_$k.json" \
              run_stage "engine_$k" "$PY" -m pytest -q -ra ${PYTEST_ARGS:-} ${shares[$k]} --tp 1
            exit $failed ) &
          pids+=($!)
        done
        for k in "${!pids[@]}"; do
          wait "${pids[$k]}"; rc=$?
          dt=$(tail -1 "$OUT_DIR/engine_$k.txt" | sed -n 's/.*after \([0-9]*\)s$/\1/p')
          names+=("engine_$k"); rcs+=("$rc"); secs+=("${dt:-?}")
          [ "$rc" -eq 0 ] || failed=1
        done
      fi ;;
    notebooks)
      run_stage notebooks "$PY" -m pytest -q -ra $XDIST_NB ${PYTEST_ARGS:-} --nbmake ${NOTEBOOKS:-notebooks/} ;;
    tp_vllm)
      NNVLLM_FIDELITY_JSON="$OUT_DIR/fidelity_tp_vllm.json" \
        run_stage tp_vllm "$PY" -m pytest -q -ra ${PYTEST_ARGS:-} tests/test_vllm.py tests/test_edits.py tests/test_stream.py --tp "$TP" ;;
    *) echo "test_gpu.sh: unknown stage '$stage' (engine, notebooks, tp_vllm)" >&2
       names+=("$stage"); rcs+=(2); secs+=(0); failed=1 ;;
  esac
done

{
  echo "# test_gpu.sh --tp $TP | $(date -u '+%Y-%m-%dT%H:%M:%SZ') | nnvllm $rev$dirty"
  echo "# nvidia-smi -L: $gpus"
  echo "# versions: $versions"
  for i in "${!names[@]}"; do
    printf '%-12s %s  %5ss\n' "${names[$i]}" "$([ "${rcs[$i]}" -eq 0 ] && echo "pass" || echo "FAIL(exit ${rcs[$i]})")" "${secs[$i]}"
  done
} | tee "$OUT_DIR/summary.txt"
exit "$failed"
