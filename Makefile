# Two commands a new user needs: `make quickstart` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

quickstart: $(STAMP)  # a fresh run dir each time: runs/quickstart-<date-time>
	$(BIN)/rlsys run configs/quickstart.yaml run.name=quickstart-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)  # everything: unit, integration (a local Ray cluster) and sandbox tests
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)  # no Ray cluster, no sandbox engines: a minute or two
	$(BIN)/python -m pytest -q -m "not integration and not sandbox" tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

.PHONY: venv quickstart test test-fast lint bench
