# make demo : the main job (fault-injection campaign + training under faults; GPU when usable)
# make test : the whole test suite
# Both create .venv and install the project into it when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench gpu-check clean

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,kernels,plots,notebooks]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/abft demo --out out/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/abft bench --out out/bench

clean:
	rm -rf out .pytest_cache .hypothesis
