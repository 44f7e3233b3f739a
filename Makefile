# The two commands of the README: `make demo` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
SETUP_INPUTS := scripts/setup.sh pyproject.toml $(wildcard backends/*/pyproject.toml)

.PHONY: setup demo test lint

setup: $(VENV)/.installed

$(VENV)/.installed: $(SETUP_INPUTS)
	bash scripts/setup.sh

demo: setup
	$(PY) tools/backend_manager.py info
	$(PY) demo/generate.py --backend auto

lint: setup
	$(PY) -m ruff check yirage backends tools tests examples

test: lint
	$(PY) -m pytest
