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

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

.PHONY: venv quickstart test bench
