# The two set-up commands of the README: `make demo` and `make test`.
# `python` is the pyenv interpreter that .python-version (3.12.1) selects.
PYTHON ?= python
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-gpu clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 12) else f"gdn_jax needs Python >= 3.12 (pyenv reads .python-version); {sys.executable} is {v.major}.{v.minor}")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

demo: $(VENV)/.installed
	$(PY) -m gdn_jax demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2

# On the GPU machine (jax[cuda13] installed): the same tests plus the compiled-kernel ones.
test-gpu:
	python3 -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache
