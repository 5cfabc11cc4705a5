# Entry points for developers and CI. Every target installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_PINS := -c requirements-build.txt -c requirements-lock.txt

.PHONY: install vllm apply export check-patches rebase-check test nightly rehearsal demo lint clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The system Python, before the venv exists: tools/dev/vllm_tree.py and
# fetch_vllm_sdist.py (and the package __init__ files) import only the
# standard library.
VLLM_TREE_TOOL := tools/__init__.py tools/dev/__init__.py \
	tools/dev/vllm_tree.py tools/dev/fetch_vllm_sdist.py

vllm/.git: patches/vllm/series $(VLLM_TREE_TOOL)
	$(PYTHON) -m tools.dev.vllm_tree materialize
	@touch $@

# Installs torch 2.8.0, the patched vLLM python-only and editable, the plugin
# editable and the dev tools. Re-runs only when a requirements file changes.
$(STAMP): $(VENV)/bin/python vllm/.git requirements-build.txt requirements-dev.txt requirements-lock.txt setup.py pyproject.toml tools/dev/install_npu_double.py
	$(PY) -m pip install -r requirements-build.txt -r requirements-dev.txt $(PIP_PINS)
	SETUPTOOLS_SCM_PRETEND_VERSION=0.11.0 VLLM_TARGET_DEVICE=empty \
	  $(PY) -m pip install --no-build-isolation -e ./vllm $(PIP_PINS)
	# setuptools-scm rewrites vllm/_version.py; keep the tree as committed.
	git -C vllm checkout -- vllm/_version.py
	# Put the tree on sys.path too: a regular package found there beats the
	# namespace package that ./vllm would be when the repo root is on
	# sys.path (python -m tools..., tools that import tests.*).
	$(PY) -c "import pathlib, site; pathlib.Path(site.getsitepackages()[0], 'vllm-tree.pth').write_text(str(pathlib.Path('vllm').resolve()) + '\n')"
	# VLLM_ASCEND_NPU_DOUBLE=1: `import torch_npu` finds the test-only
	# contract double (tests/npu_double) in every process.
	$(PY) -m tools.dev.install_npu_double
	$(PY) -m pip install --no-build-isolation -e . $(PIP_PINS)
	@touch $@

install: $(STAMP)

vllm: vllm/.git

apply: vllm/.git
	$(PYTHON) -m tools.dev.vllm_tree apply

export:
	$(PYTHON) -m tools.dev.vllm_tree export

check-patches: $(STAMP)
	$(PY) -m tools.dev.vllm_tree check --alone

# Each patch alone on the newest vLLM release on the package index (or
# VLLM_VERSION=X), compared by content: already upstream (with the upstream
# change), applies, moved (to where) or conflicts, written to
# patches/rebase-<version>.{json,md}. Needs the index; not in `make test`.
rebase-check: $(STAMP)
	$(PY) -m tools.dev.rebase_check $(if $(VLLM_VERSION),--version $(VLLM_VERSION))

# The series check (its metadata, vLLM's pinned formatters, and every
# patch's tests once with the whole series; `make check-patches` runs them at
# each prefix and alone) runs next to the tests on the other core; its output
# follows theirs. Both must pass.
test: $(STAMP) apply
	@log=$$(mktemp); \
	$(PY) -m tools.dev.vllm_tree check --tip-only > $$log 2>&1 & check=$$!; \
	$(PY) -m pytest -q --durations=40 -m "not heavy" tests; tests=$$?; \
	wait $$check; checked=$$?; cat $$log; rm -f $$log; \
	echo "make test: tests exit $$tests, series check exit $$checked"; \
	[ $$tests -eq 0 ] && [ $$checked -eq 0 ]

# Nightly regression against benchmarks/nightly/baseline.json (runs and the
# trend page in benchmarks/nightly/runs); NIGHTLY_ARGS="--smoke", "--model
# PATH", "--device npu --preset serve", "--update-baseline". First the
# tests marked heavy (more parallel layouts, which `make test` leaves out).
nightly: $(STAMP) apply
	$(PY) -m pytest -q -m heavy tests
	$(PY) -m tools.nightly $(NIGHTLY_ARGS)

# The reference serve command (DP 2 x TP 8 + EP, W8A8, graph capture sizes)
# at DP 2 x TP 2 + EP (W8A8 with a float MTP layer, its capture sizes, then
# none, then no MTP) at GLM-4.5's depth
# through the torch_npu double: builds the checkpoint into
# ~/.cache/vllm-ascend/glm45-depth, prints graphs against the stream budget,
# device memory by use and MTP == no-MTP. Not in CI; REHEARSAL_ARGS="--runs
# mtp", "--npu-memory-gib G --max-model-len N --max-num-batched-tokens N".
rehearsal: $(STAMP) apply
	$(PY) -m tools.dev.rehearsal $(REHEARSAL_ARGS)

# vLLM v0.11.0's ruff and isort settings (pyproject.toml); both run, and
# either failing fails the target. `ruff check --fix` and `isort` (without
# --check-only) fix what they can.
LINT_PATHS := vllm_ascend tests tools
lint: $(STAMP)
	@$(PY) -m ruff check $(LINT_PATHS); ruff=$$?; \
	$(PY) -m isort --check-only $(LINT_PATHS); isort=$$?; \
	[ $$ruff -eq 0 ] && [ $$isort -eq 0 ]

clean:
	rm -rf $(VENV) vllm

demo: $(STAMP) apply
	$(PY) -m tools.demo.spec_config
	$(PY) -m tools.demo.serve
	$(PY) -m tools.bench.mtp
