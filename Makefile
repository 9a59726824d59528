# The two set-up commands of the README: `make demo` and `make test` (CI runs `make test`).
# PYTHON is any Python >= 3.12 (pyenv reads .python-version, which accepts any 3.12).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Test workers: one per CPU core of this machine (override: make test JOBS=4).
JOBS ?= $(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)

.PHONY: demo test test-full test-gpu check env clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 12) else f"gdn_jax needs Python >= 3.12; {sys.executable} is {v.major}.{v.minor}")'
	$(PYTHON) -m venv $(VENV)
	@echo "installing gdn_jax and its test dependencies into $(VENV) (about a minute) ..."
	$(PY) -m pip install --progress-bar on -e '.[test]'
	@touch $@

demo: $(VENV)/.installed
	$(PY) -m gdn_jax demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(JOBS)

# The whole CPU matrix: `make test` plus the cases marked `full` (tests/conftest.py).
test-full: $(VENV)/.installed
	$(PY) -m pytest -q -n $(JOBS) --full

check: $(VENV)/.installed
	$(PY) -m gdn_jax check

env: $(VENV)/.installed
	$(PY) -m gdn_jax env

# On the GPU machine: the compiled-kernel tests, with the venv's Python. Make the venv there with
# the CUDA extra first: `make .venv/.installed && .venv/bin/pip install -e '.[cuda,test]'`.
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache
