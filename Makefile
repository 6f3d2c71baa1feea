# make demo : the main job (fault-injection campaign + training under faults; GPU when usable)
# make test : the whole test suite
# Both create .venv and install the project into it when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench gpu-check clean mutations

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,kernels,plots,notebooks]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/abft demo --out out/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# weaken thresholds, location, repair and softmax checks on purpose; the tests must notice
# (about 7 minutes on 2 cores; scripts/mutation_check.py)
mutations: $(STAMP)
	$(BIN)/python scripts/mutation_check.py

bench: $(STAMP)
	$(BIN)/abft bench --out out/bench

clean:
	rm -rf out .pytest_cache .hypothesis
