#!/usr/bin/env bash
# The GPU lane: what runs on a CUDA machine and not in `make test`.
#
#   bash scripts/gpu_lane.sh [STAGE ...]        (default: setup suite notebooks; make test-gpu)
#
# Stages, run in the order given; each goes on after another fails, and the script exits 1 at the
# end if any failed:
#   setup      make the interpreter ready. On the lent H200 (no network; see ../shared/gpu/README.md):
#              install each part of the staged bundle carried under .gpu/ (GPU_PARTS=N, the part
#              count bundle.sh printed: `GPU_PARTS=25 bash scripts/gpu_lane.sh setup`, one part per
#              command, carry [".gpu/K", ".gpu/setup.sh", ".gpu/sha256"]); the last part writes
#              /root/nnvllm-gpu.env, which every stage sources. The suite and notebooks need what
#              the image lacks beside vLLM: `bash ../shared/gpu/bundle.sh .gpu ipywidgets nbmake
#              ipykernel ruff` (ruff: tests/test_lint.py); sae-lens, datasets and Ray (the SAE and Ray tests
#              skip without them) come as parts of their own: scripts/gpu_extras.sh. Elsewhere: `make
#              setup` where python3 cannot import vllm and nnsight.
#   suite      the test suite at TP=1: pytest with WORKERS xdist workers (default 8) on one GPU, each
#              test engine with a fixed 1 GiB KV cache, so that many share the GPU
#   notebooks  the notebooks under nbmake (NB_WORKERS, default 3; needs nbmake, ipykernel, ipywidgets)
#   bench      the GPU benchmarks in BENCH (default "llama1b gpt2s big"), each in its own process with
#              BENCH_TIMEOUT seconds (default 540), alone on the GPU; results in NNVLLM_RESULTS
#              (default $OUT), in the shape of benchmarks/results/ (benchmarks/provenance.py): copy
#              them back there. Items:
#                llama1b             capture_gpu.py, Llama-1B shape 64 x 128, bare vLLM / in-process / isolated
#                gpt2s               capture_gpu.py, GPT-2-small shape 64 x 32, the same cases, 15 calls each
#                big                 capture_gpu.py, 1,024 x 128 streamed to disk with nv.collect (8 GB budget)
#                llama1b_every_case  capture_gpu.py, Llama-1B shape, every case (vllm-lens, nnsight, eager...;
#                                    vllm-lens==1.2.1 in the bundle: bundle.sh .gpu vllm-lens==1.2.1 ...)
#                gpt2s_every_case    capture_gpu.py, GPT-2-small shape, every case
#                steer               capture_gpu.py, steering cost on the graph and the eager engine
#                trace               capture_gpu.py, an nnsight trace of every block's output against nv.generate
#                                    (1, 8, 64 prompts; docs/capture.md, "nnsight traces on a graph engine")
#                trace_isolated      capture_gpu.py, the same trace on an isolated engine (nv.load's default)
#                ab                  capture_gpu.py's AB_CASES (default nv_trace; 1 and AB_PROMPTS prompts, default
#                                    8, BENCH_REPEATS calls each, default 5) with nnvllm from AB_BASE, a folder holding another version's
#                                    nnvllm/ package (made here: git archive <commit> nnvllm | tar -x -C ab/base),
#                                    and from this tree, in turns, AB_ROUNDS (default 2) of each, one process per
#                                    run: runs ab_base1, ab_head1... in ab.json, each with the code hash of the
#                                    package it imported
#                trace_profile       capture_gpu.py, the 1- and 8-prompt trace under cProfile, worker included
#                defaults            capture_gpu.py, nv.load's defaults against bare vLLM, 12 calls each
#                                    (docs/capture.md, "What it costs")
#                graphsites          capture_gpu.py, what the graphs' copies of every site cost against the
#                                    residual stream's alone (NNVLLM_GRAPH_SITES=resid), 12 calls each
#                compiled            capture_gpu.py, NNVLLM_COMPILE=1 (torch.compile with the taps inside) against
#                                    vLLM's default and nv.load's graph engine, 12 calls each
#                paired              capture_gpu.py, bare vLLM's default, nv.load's default and the in-process engine
#                                    in one process, called in turns (BENCH_TURNS)
#                paired_split        capture_gpu.py, the paired case with vLLM under nnvllm's settings and the
#                                    in-process engine's own generate too: each step of the gap, per turn
#                paired_mirror       capture_gpu.py, the paired case with nv.load(path) started with
#                                    NNVLLM_HANDOVER=mirror beside it (the hand-off written during the generation)
#                split               capture_gpu.py, where nv.generate's cost over the engine's own generate goes:
#                                    text vs token-id prompts, tokens only, every layer; then each under cProfile
#                kernels             capture_gpu.py, one call of bare vLLM's default and of each split form under
#                                    torch.profiler: the device's busy time against the wall time, the costliest
#                                    kernels, the host's synchronizing calls (and bare vLLM with nnvllm's settings)
#                host                capture_gpu.py, one call of bare vLLM's default, of bare vLLM with nnvllm's
#                                    settings and of each split form under cProfile, engine core in the process
#                trace_saves         trace_saves.py, a trace's saved tensors back as raw bytes against torch's
#                                    pickling, Llama-1B shape 64 x 32 (docs/engines.md, "What a trace sends back")
#                trace_payload       trace_payload.py, what a trace sends with each invoke, the same shape
#                fp32                fp32_gpu.py, where fp32 vLLM differs from transformers, layer by layer
#                profile             profile_collect.py, where a 1,024 x 128 collect spends its time
#                profile_sae         profile_collect.py --saes 16384, the same for sae_gpu.py's feature dataset
#                engines             engines.py, in-process against isolated on the toy model
#                heads               heads_gpu.py, q/k/z capture GB/s against resid, 2,048-token patterns, attribution
#                patterns            patterns_gpu.py, every pattern of a 2,048- and 4,096-position request (torch only)
#                attribute           attribute.py, nv.attribute's client computation over a 64 x 128 run (torch only)
#                sae                 sae_gpu.py, 16 bf16 SAEs of 16k top-32 against bare generate, and a
#                                    1,024 x 128 feature dataset to disk with nv.collect
#                sae_fp32            the same with fp32 SAEs (the random SAE files' dtype)
#   tp         the tests that take --tp, at TP (default 2) on TP GPUs (nvidia-h200-x2): test_vllm,
#              test_edits, test_stream (the llama engine there is isolated, so both transports run)
#
# Environment:
#   OUT            where logs and results go (default build/gpu_lane). On the lent machine $OUT comes
#                  back (at most 8 files): when more than 8 are there at the end, the logs are packed
#                  into logs.tar.gz.
#   TESTS          what the suite runs (default tests/); SPLIT=k/N runs the k-th of N shares of it,
#                  dealt by file size (scripts/split_tests.py), for a suite longer than one command
#   NOTEBOOKS      what the notebooks stage runs (default notebooks/)
#   STAGE_TIMEOUT  seconds per test stage (default: none); PYTEST_ARGS: more pytest arguments
#   PYTHON         the interpreter (default python3)
#   BENCH_REPEATS  the timed calls of each series of bench items trace and ab (default 5) and trace_isolated (3)
#   BENCH_TURNS    the turns of bench items paired and paired_split (default 24, whose 95% interval of each
#                  median ratio is the 7th-18th of the ratios; 12 give the 3rd-10th; paired_split with 24
#                  turns and six forms took 492 s on the H100, engine starts included: a command of its own,
#                  BENCH_TIMEOUT=590)
#   BENCH_CASES    the cases of bench items llama1b, gpt2s, compiled and split (capture_gpu.py --cases), each
#                  in its own process and recorded as it ends: the cases first listed come back first
#                  from a command cut at its limit
#
# On a lent GPU machine, after setup, the suite on the defaults takes more than three commands of its 10
# minutes (an H100, 8 workers: shares of 3 took more than 480 s beside the notebooks, 416 s, and more than
# 555 s), and the notebooks can run beside one share (two lanes side by side, each with its own OUT; the
# machine returns at most 8 files of $OUT in all):
#   SPLIT=1/4 OUT=$OUT/a bash scripts/gpu_lane.sh suite & OUT=$OUT/b bash scripts/gpu_lane.sh notebooks & wait
#   SPLIT=2/4 bash scripts/gpu_lane.sh suite   (and 3/4, 4/4)
#   bash scripts/gpu_lane.sh bench
# A stage can also outlive its command: started in a process session of its own, it runs on until the
# machine goes back, and the next commands wait for it and pack its OUT (the whole suite in one run, 12
# workers beside the notebooks, reported 758 of its 799 tests in 1,000 s on an H100 and 792 in 1,300 s on
# an H200; give it about 1,400 s):
#   setsid bash -c 'WORKERS=12 STAGE_TIMEOUT=1400 OUT=/root/whole bash scripts/gpu_lane.sh suite' </dev/null &>/dev/null &
#   (next command)  until [ -f /root/whole/summary.txt ] || [ $SECONDS -gt 560 ]; do sleep 10; done
#                   tar -C /root/whole -czf $OUT/whole.tar.gz .
# Each stage writes OUT/logs/<stage>.txt (its log, headed by the date, commit, GPUs and versions),
# OUT/summary.txt and OUT/gpu_tests_<machine>.json (each test stage's counts, as a run of that name).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(setup suite notebooks)
for s in "${STAGES[@]}"; do
  case "$s" in
    setup|suite|notebooks|bench|tp) ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_lane.sh: unknown stage '$s' (expected setup, suite, notebooks, bench or tp)" >&2; exit 2 ;;
  esac
done

OUT_DIR="${OUT:-build/gpu_lane}"
mkdir -p "$OUT_DIR/logs"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOGS="$OUT_DIR/logs"
export NNVLLM_RESULTS="${NNVLLM_RESULTS:-$OUT_DIR}"
# A vLLM general plugin (vllm-lens is one) loads into every vLLM process and nnsight's engine then
# fails to start; only capture_gpu.py's vllm_lens case gets the plugins back (bench, below).
export VLLM_PLUGINS="" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

env_file=/root/nnvllm-gpu.env
use_env() { [ -f "$env_file" ] && source "$env_file"; return 0; }
use_env

declare -a names rcs secs
failed=0
note() {  # name, exit status, seconds
  names+=("$1"); rcs+=("$2"); secs+=("$3")
  [ "$2" -eq 0 ] || failed=1
}

setup() {
  if [ -f .gpu/setup.sh ] && [ -n "${GPU_PARTS:-}" ]; then
    local k n="$GPU_PARTS"
    for k in $(ls .gpu | grep -E '^[0-9]+$' | sort -n); do bash .gpu/setup.sh "$k" "$n" || return 1; done
    use_env
  elif ! "$PY" -c "import vllm, nnsight" >/dev/null 2>&1; then
    make setup || return 1
  fi
  [ -x .venv/bin/python ] && ! "$PY" -c "import vllm, nnsight" >/dev/null 2>&1 && PY=.venv/bin/python
  "$PY" -c "import vllm, nnsight" >/dev/null 2>&1 || { echo "setup: vllm and nnsight not importable yet (more parts to come?)"; return 0; }
  "$PY" -c "import torch, vllm, nnsight; print('ready: torch', torch.__version__, '| vllm', vllm.__version__, '| nnsight', nnsight.__version__)"
}

ready() {  # the interpreter the test and bench stages need
  "$PY" -c "import vllm, nnsight" >/dev/null 2>&1 && return 0
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import vllm, nnsight" >/dev/null 2>&1; then PY=.venv/bin/python; return 0; fi
  echo "gpu_lane.sh: $PY cannot import vllm and nnsight; run the setup stage first" >&2
  return 1
}

header() {  # what every log starts with: the date, the code, the GPUs, the versions
  local rev code
  rev=$(git rev-parse --short HEAD 2>/dev/null || echo "no git")
  git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && rev="$rev +local changes"
  # A copy of a working tree can carry a stale HEAD: name the code by a hash of its sources too
  # (benchmarks/provenance.py code_hash: compare with the machine that sent it).
  code=$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import provenance; print(provenance.code_hash())" 2>/dev/null)
  echo "# date $(date -u '+%Y-%m-%dT%H:%M:%SZ') | commit ${NNVLLM_COMMIT:-$rev} | code $code"
  echo "# GPUs: $( (nvidia-smi -L 2>/dev/null || echo none) | tr '\n' ';')"
  echo "# versions: $("$PY" -c "
import sys; sys.path.insert(0, 'benchmarks'); import provenance as p
print(' | '.join([f'vllm {p.vllm_version()}'] + [f'{d} {p._version(d)}' for d in
                 ('torch', 'nnsight', 'transformers', 'nbmake', 'ipywidgets')]))" 2>/dev/null)"
}

run_logged() {  # name, then the command; its log is LOGS/<name>.txt
  local name="$1" log="$LOGS/$1.txt" t0 rc; shift
  { header; echo "# command: $*"; } > "$log"
  t0=$(date +%s)
  if [ -n "${STAGE_TIMEOUT:-}" ]; then
    # SIGINT first: pytest stopped that way still prints its summary (failures, --durations).
    timeout -s INT -k 45 "$STAGE_TIMEOUT" "$@" >> "$log" 2>&1; rc=$?
  else
    "$@" >> "$log" 2>&1; rc=$?
  fi
  printf '\n# exit %s after %ss\n' "$rc" "$(( $(date +%s) - t0 ))" >> "$log"  # on a line of its own
  tail -n 3 "$log"
  note "$name" "$rc" "$(( $(date +%s) - t0 ))"
  return "$rc"
}

# Test engines hold a fixed 1 GiB KV cache each, so that the workers' engines share one GPU, and
# vLLM's start check then needs only a tenth of it free.
# NNVLLM_FAILURES_NOW: each failure's traceback is logged when it happens (tests/conftest.py), and
# faulthandler writes every thread's stack of a test still running after FAULT_TIMEOUT seconds, and of
# a pytest process (an xdist worker too) still alive FAULT_TIMEOUT seconds after its session ended, so a
# stage cut at STAGE_TIMEOUT still says why its tests failed or where one hung.
TEST_ENV=(env "NNVLLM_GPU_MEMORY_UTILIZATION=${NNVLLM_GPU_MEMORY_UTILIZATION:-0.1}"
          "NNVLLM_KV_CACHE_MEMORY_BYTES=${NNVLLM_KV_CACHE_MEMORY_BYTES:-1073741824}" NNVLLM_FAILURES_NOW=1)

xdist() {  # workers variable, its default, more xdist arguments: "-vv -n K ..." where xdist imports and K > 0
  local k="${!1:-$2}"; shift 2
  # -vv (net -v beside the stages' -q) names each test as it ends: a stage killed at its limit still says what ran.
  "$PY" -c "import xdist" >/dev/null 2>&1 && [ "$k" -gt 0 ] && echo "-vv -n $k $*"
  return 0
}

suite() {
  local tests="${TESTS:-tests/}"
  if [ -n "${SPLIT:-}" ]; then
    local k="${SPLIT%/*}" n="${SPLIT#*/}"
    tests=$("$PY" scripts/split_tests.py "$n" $tests | sed -n "${k}p")
    [ -n "$tests" ] || { echo "suite: SPLIT=$SPLIT selects no files" >&2; note suite 2 0; return; }
  fi
  run_logged suite "${TEST_ENV[@]}" NNVLLM_FIDELITY_JSON="$LOGS/fidelity_suite.json" \
    "$PY" -m pytest -q -ra --durations=30 -o faulthandler_timeout="${FAULT_TIMEOUT:-180}" $(xdist WORKERS 8 --dist loadfile) \
    ${PYTEST_ARGS:-} $tests --tp 1
}

notebooks() {  # -p notebook_kernels: a new kernel for a notebook whose kernel dies at start (tests/notebook_kernels.py)
  run_logged notebooks "${TEST_ENV[@]}" PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m pytest -q -ra $(xdist NB_WORKERS 3) -p notebook_kernels ${PYTEST_ARGS:-} --nbmake ${NOTEBOOKS:-notebooks/}
}

tp() {
  local n gpus
  n="${TP:-2}"
  gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$gpus" -lt "$n" ]; then
    { echo "tp: TP=$n needs $n GPUs, $gpus here (nvidia-h200-x2 for TP=2)"; echo "# exit 2 after 0s"; } | tee "$LOGS/tp.txt"
    note tp 2 0; return
  fi
  run_logged tp "${TEST_ENV[@]}" NNVLLM_FIDELITY_JSON="$LOGS/fidelity_tp.json" "$PY" -m pytest -q -ra ${PYTEST_ARGS:-} \
    tests/test_vllm.py tests/test_edits.py tests/test_stream.py --tp "$n"
}

bench_item() {  # name, then the command: alone on the GPU, with the engines' own memory settings
  local name="$1"; shift
  STAGE_TIMEOUT="${BENCH_TIMEOUT:-540}" run_logged "bench_$name" \
    env -u NNVLLM_GPU_MEMORY_UTILIZATION -u NNVLLM_KV_CACHE_MEMORY_BYTES "$@"
}

bench() {
  # capture_gpu.py keeps vLLM's plugins out of every case but vllm_lens itself; the other scripts
  # start nnsight's engine in their own process, where a plugin must stay out (VLLM_PLUGINS="").
  local c="env -u VLLM_PLUGINS $PY benchmarks/capture_gpu.py" root=/tmp/nnvllm-bench item
  for item in ${BENCH:-llama1b gpt2s big}; do
    case "$item" in
      llama1b) bench_item "$item" $c --name llama1b --shape llama1b --prompts 64 --tokens 128 --repeats 5 \
                 --timeout 170 --root $root --cases ${BENCH_CASES:-bare_graphs,nv_default,nv_graphs,nv_isolated} ;;
      gpt2s) bench_item "$item" $c --name gpt2s --shape gpt2s --prompts 64 --tokens 32 --repeats 15 \
               --timeout 170 --root $root --cases ${BENCH_CASES:-bare_graphs,nv_default,nv_graphs,nv_isolated} ;;
      big) bench_item "$item" $c --name big --shape llama1b --big 1024 --tokens 128 --budget 8GB \
             --big-batches 256 --timeout 400 --root $root ;;
      llama1b_every_case|gpt2s_every_case)
        local shape="${item%_every_case}" cases
        cases=$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from capture_gpu import ALL_CASES; print(ALL_CASES['$shape'])")
        if [ "$shape" = llama1b ]; then set -- --prompts 64 --tokens 128; else set -- --prompts 64 --tokens 32; fi
        bench_item "$item" $c --name "$item" --shape "$shape" "$@" --timeout 150 --root $root --cases "$cases" ;;
      steer) bench_item "$item" $c --name llama1b_steer --shape llama1b --prompts 64 --tokens 128 \
               --timeout 200 --root $root --cases nv_steer,nv_steer_eager ;;
      trace) bench_item "$item" $c --name llama1b_trace_seams --shape llama1b --prompts 64 --tokens 128 --repeats ${BENCH_REPEATS:-5} \
               --timeout 230 --root $root --cases nv_trace ;;
      trace_isolated) bench_item "$item" $c --name llama1b_trace_isolated --shape llama1b --prompts 64 --tokens 128 \
                        --repeats ${BENCH_REPEATS:-3} --timeout 230 --root $root --cases nv_trace_isolated ;;
      trace_profile) bench_item "$item" $c --name llama1b_trace_profile --shape llama1b --prompts 64 --tokens 128 \
                       --timeout 230 --root $root --cases nv_trace_profile ;;
      defaults) bench_item "$item" $c --name llama1b_defaults --shape llama1b --prompts 64 --tokens 128 --repeats 12 \
                  --timeout 140 --root $root --cases bare_graphs,nv_graphs,nv_graphs_nopieces,nv_default,bare_nocompile ;;
      graphsites) bench_item "$item" $c --name llama1b_graphsites --shape llama1b --prompts 64 --tokens 128 --repeats 12 \
                    --timeout 140 --root $root --cases bare_nocompile,nv_graphs,nv_graphs_residgraphs ;;
      compiled) bench_item "$item" $c --name llama1b_compiled --shape llama1b --prompts 64 --tokens 128 --repeats 12 \
                  --timeout 200 --root $root --cases ${BENCH_CASES:-bare_graphs,nv_graphs_compiled,nv_graphs_compiled_residgraphs,nv_graphs} ;;
      paired) bench_item "$item" $c --name llama1b_paired --shape llama1b --prompts 64 --tokens 128 --repeats ${BENCH_TURNS:-24} \
                --timeout 400 --root $root --cases paired ;;
      paired_split) bench_item "$item" $c --name llama1b_paired_split --shape llama1b --prompts 64 --tokens 128 \
                      --repeats ${BENCH_TURNS:-24} --timeout 560 --root $root --cases paired_split ;;
      paired_mirror) bench_item "$item" $c --name llama1b_paired_mirror --shape llama1b --prompts 64 --tokens 128 \
                       --repeats ${BENCH_TURNS:-24} --timeout 560 --root $root --cases paired_mirror ;;
      ab)  # a case with nnvllm from AB_BASE and from this tree, in turns (see the header)
        if [ ! -d "${AB_BASE:-}/nnvllm" ]; then
          echo "bench ab: AB_BASE must be a folder holding an nnvllm/ package (git archive <commit> nnvllm | tar -x -C <folder>)" >&2
          note bench_ab 2 0; continue
        fi
        local r side pp base_dir limit=300  # (the first engine start on a fresh machine took over 160 s)
        base_dir="$(cd "$AB_BASE" && pwd)"
        for r in $(seq 1 "${AB_ROUNDS:-2}"); do
          for side in base head; do
            pp="$PYTHONPATH"; [ "$side" = base ] && pp="$base_dir:$PYTHONPATH"
            bench_item "ab_$side$r" env PYTHONPATH="$pp" $c --name "ab_$side$r" --shape llama1b --prompts "${AB_PROMPTS:-8}" --tokens 128 \
              --repeats ${BENCH_REPEATS:-5} --timeout $limit --root $root --cases "${AB_CASES:-nv_trace}" --out "$NNVLLM_RESULTS/ab.json"
            limit=170
          done
        done ;;
      kernels) bench_item "$item" $c --name llama1b_kernels --shape llama1b --prompts 64 --tokens 128 \
                 --timeout 300 --root $root --cases ${BENCH_CASES:-bare_kernels,bare_nocompile_kernels,nv_split_kernels} ;;
      host) bench_item "$item" $c --name llama1b_host --shape llama1b --prompts 64 --tokens 128 \
              --timeout 300 --root $root --cases ${BENCH_CASES:-bare_profile,bare_nocompile_profile,nv_split_profile} ;;
      split) bench_item "$item" $c --name llama1b_split --shape llama1b --prompts 64 --tokens 128 --repeats 8 \
               --timeout 300 --root $root --cases ${BENCH_CASES:-nv_split,nv_split_profile} ;;
      trace_saves|trace_payload)  # (a Llama-1B-shape checkpoint, built as capture_gpu.py builds it)
        local ckpt
        ckpt=$("$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, 'benchmarks'); import capture_gpu as cg; print(cg.build('llama1b', Path('$root')))")
        bench_item "$item" "$PY" benchmarks/$item.py --model "$ckpt" --prompts 64 --tokens 32 --repeats 3 ;;
      fp32) bench_item "$item" "$PY" benchmarks/fp32_gpu.py --jobs 4 --timeout 200 ;;
      profile) bench_item "$item" "$PY" benchmarks/profile_collect.py --shape llama1b --prompts 1024 --tokens 128 \
                 --budget 8GB --root $root ;;
      profile_sae) bench_item "$item" "$PY" benchmarks/profile_collect.py --shape llama1b --prompts 1024 --tokens 128 \
                     --saes 16384 --budget 4GB --root $root ;;
      engines) bench_item "$item" "$PY" benchmarks/engines.py --repeats 7 ;;
      heads) bench_item "$item" "$PY" benchmarks/heads_gpu.py ;;
      patterns) bench_item "$item" "$PY" benchmarks/patterns_gpu.py ;;
      attribute) bench_item "$item" "$PY" benchmarks/attribute.py ;;
      sae) bench_item "$item" "$PY" benchmarks/sae_gpu.py --sae-dtype bfloat16 --collect 1024 --root $root ;;
      sae_fp32) bench_item "$item" "$PY" benchmarks/sae_gpu.py --collect 1024 --root $root ;;
      *) echo "bench: unknown item '$item'" >&2; note "bench_$item" 2 0 ;;
    esac
  done
}

summary() {
  local i
  {
    header
    for i in "${!names[@]}"; do
      printf '%-24s %s  %5ss\n' "${names[$i]}" "$([ "${rcs[$i]}" -eq 0 ] && echo pass || echo "FAIL(exit ${rcs[$i]})")" "${secs[$i]}"
    done
  } | tee "$OUT_DIR/summary.txt"
}

record_counts() {  # a test stage's name: its counts, from pytest's last line, as a run of gpu_tests_<machine>.json,
  # written as soon as the stage ends, so that a command cut at its limit during a later stage keeps them
  "$PY" - "$LOGS" "$1" <<'EOF' || true
import re, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from provenance import provenance, record
logs = Path(sys.argv[1])
for stage in sys.argv[2:]:
    log = logs / f"{stage}.txt"
    if not log.is_file():
        continue
    text = log.read_text(errors="replace")
    command = re.search(r"^# command: (.*)$", text, re.M)
    end = re.findall(r"^# exit (\d+) after (\d+)s$", text, re.M)
    counts = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    run = {"exit": int(end[-1][0]) if end else None, "seconds": int(end[-1][1]) if end else None}
    run.update({w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)",
                                                    counts[-1] if counts else "")})
    # -vv's per-test lines ("[gw1] [ 91%] FAILED tests/...") too: a stage cut at its limit prints no -ra list
    found = re.findall(r"^(?:\[gw\d+\] \[ *\d+%\] )?(?:FAILED|ERROR) (\S+)", text, re.M)
    run["failures"] = list(dict.fromkeys(found))
    date = re.search(r"^# date (\S+)", text, re.M)
    prov = {**provenance(), "command": command.group(1) if command else f"bash scripts/gpu_lane.sh {stage}"}
    if date:
        prov["date"] = date.group(1)
    record("gpu_tests", stage, run, prov=prov)
EOF
}

pack() {  # $OUT returns at most 8 files from the lent machine
  local n
  n=$(find "$OUT_DIR" -type f | wc -l)
  if [ -n "${OUT:-}" ] && [ "$n" -gt 8 ]; then
    tar -C "$OUT_DIR" -czf "$OUT_DIR/logs.tar.gz" logs && rm -rf "$LOGS"
    echo "packed the logs into $OUT_DIR/logs.tar.gz ($n files were there)"
  fi
}

for s in "${STAGES[@]}"; do
  echo "== $s"
  case "$s" in
    setup) t0=$(date +%s); setup; note setup $? $(( $(date +%s) - t0 )) ;;
    *) if ready; then "$s"; else note "$s" 2 0; fi
       case "$s" in suite|notebooks|tp) record_counts "$s" ;; esac ;;
  esac
done
summary
pack
exit "$failed"
