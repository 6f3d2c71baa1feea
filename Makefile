# make demo : the main job (fault-injection campaign + training under faults; GPU when usable)
# make test : the whole test suite (with CI's subset of the CUDA kernels run on the CPU)
# make test-cuda-on-cpu : all of the CUDA-on-CPU tests (docs/gpu_testing.md)
# Both create .venv and install the project into it when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-cuda-on-cpu bench clean mutations

# make demo installs the package and matplotlib, plus CuPy only where nvidia-smi lists a GPU;
# make test installs torch, transformers and the test, kernel-compile (CuPy, NVRTC), plot and
# notebook extras.
DEMO_STAMP := $(VENV)/.installed-demo
GPU_EXTRA  := $(shell nvidia-smi -L >/dev/null 2>&1 && echo ",cuda13")

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(DEMO_STAMP): setup.py pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[plots$(GPU_EXTRA)]"
	touch $@

$(STAMP): setup.py pyproject.toml | $(BIN)/python
	# torch is optional (its tests skip without it). The CPU build first: on these machines pip
	# takes torch==2.13.0 from local disk; elsewhere "pip install torch" may fetch a CUDA build
	# of several GB, so that is left to the user.
	$(BIN)/python -m pip install -q "torch==2.13.0" || echo "torch not installed: its tests will skip"
	$(BIN)/python -m pip install -q -e ".[test,kernels,plots,notebooks]"
	# transformers for tests/test_hf.py (alone, not ".[hf]": that extra also asks for torch,
	# which could make pip fetch a CUDA build where the local CPU one did not install)
	$(BIN)/python -m pip install -q "transformers>=5.17,<6" || echo "transformers not installed: tests/test_hf.py will skip"
	# PEFT (LoRA) and accelerate (transformers' Trainer) for tests/test_hf_wrapped.py and
	# tests/test_hf_trainer.py, likewise optional
	$(BIN)/python -m pip install -q "peft>=0.13" accelerate || echo "peft, accelerate not installed: their tests will skip"
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/abft demo --out out/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# every cupy-on-cpu case with the profile's hypothesis examples (CI runs a subset; docs/gpu_testing.md)
test-cuda-on-cpu: $(STAMP)
	ABFT_CUDA_ON_CPU=all $(BIN)/python -m pytest -q -m cuda_on_cpu

# weaken thresholds, location, repair, softmax checks and the CUDA kernels on purpose; the tests
# must notice
# (scripts/mutation_check.py; each CUDA kernel mutation is killed in 7-34 s on 2 shared cores)
mutations: $(STAMP)
	$(BIN)/python scripts/mutation_check.py

bench: $(STAMP)
	$(BIN)/abft bench --out out/bench

# numba's on-disk cache checks only a kernel's own file: after editing a module whose helpers are
# inlined into kernels elsewhere (attention/_cpu_vmath.py, abftgemm/cpu_kernels.py), run make clean
clean:
	rm -rf out .pytest_cache .hypothesis
	find abftgemm attention tests -name '*.nbi' -delete -o -name '*.nbc' -delete
	rm -rf $${ABFT_SIMT_CACHE:-$$HOME/.cache/abftgemm-simt}
