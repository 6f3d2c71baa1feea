# make demo : the main job (fault-injection campaign + training under faults; GPU when usable)
# make test : the whole test suite (with CI's subset of the CUDA kernels run on the CPU)
# make test-cuda-on-cpu : all of the CUDA-on-CPU tests (docs/gpu_testing.md)
# Both create .venv and install the project into it when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-cuda-on-cpu bench clean mutations

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is optional (its tests skip without it). The CPU build first: on these machines pip
	# takes torch==2.13.0 from local disk; elsewhere "pip install torch" may fetch a CUDA build
	# of several GB, so that is left to the user.
	$(BIN)/python -m pip install -q "torch==2.13.0" || echo "torch not installed: its tests will skip"
	$(BIN)/python -m pip install -q -e ".[test,kernels,plots,notebooks]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/abft demo --out out/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# every cupy-on-cpu case with the profile's hypothesis examples (CI runs a subset; docs/gpu_testing.md)
test-cuda-on-cpu: $(STAMP)
	ABFT_CUDA_ON_CPU=all $(BIN)/python -m pytest -q -m cuda_on_cpu

# weaken thresholds, location, repair, softmax checks and the CUDA kernels on purpose; the tests
# must notice
# (73 s on 2 shared cores with numba's cache warm; 6.5 min the first time; scripts/mutation_check.py)
mutations: $(STAMP)
	$(BIN)/python scripts/mutation_check.py

bench: $(STAMP)
	$(BIN)/abft bench --out out/bench

# numba's on-disk cache checks only a kernel's own file: after editing a module whose helpers are
# inlined into kernels elsewhere (attention/_cpu_vmath.py, abftgemm/_cpu.py), run make clean
clean:
	rm -rf out .pytest_cache .hypothesis
	find abftgemm attention tests -name '*.nbi' -delete -o -name '*.nbc' -delete
	rm -rf $${ABFT_SIMT_CACHE:-$$HOME/.cache/abftgemm-simt}
