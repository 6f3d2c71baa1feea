"""Shared fixtures: hypothesis profiles and the list of array backends to run every body on."""
from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# dev: quick local runs (and the GPU check, whose device time is short). ci: 300 fixed examples per
# property (the README's promise; no test overrides max_examples downward), as many as CI's time
# allows; 60 had missed a repair bug that the deep profile found. deep: HYPOTHESIS_PROFILE=deep,
# random examples, for bug hunting.
settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile("ci", max_examples=300, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _gpu_module():
    """CuPy when it imports and sees a GPU, else None (ABFT_REQUIRE_GPU=1 makes absence fatal)."""
    why = "no device"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception as exc:  # no CuPy, no driver
        why = f"{type(exc).__name__}: {exc}"
    if os.environ.get("ABFT_REQUIRE_GPU") == "1":
        raise RuntimeError(f"ABFT_REQUIRE_GPU=1 but CuPy/GPU unusable: {why}")
    return None


def _cuda_on_cpu_module():
    """The CuPy stand-in of tests/cuda_on_cpu when there is no usable GPU (it runs the same CUDA
    kernels and launch code on the CPU), else None; a skip reason when no C++ compiler exists."""
    if GPU is not None:
        return None, "a GPU is usable: the real CUDA backend runs instead"
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return None, "no host C++ compiler (g++) to build the kernels for the CPU"
    from cuda_on_cpu import standin

    return standin.cupy, ""


GPU = _gpu_module()
CUDA_ON_CPU, _CUDA_ON_CPU_SKIP = _cuda_on_cpu_module()
BACKENDS = [pytest.param(np, id="numpy"),
            pytest.param(GPU, id="cupy", marks=pytest.mark.skipif(GPU is None, reason="no GPU"))]
if GPU is None:
    BACKENDS.append(pytest.param(CUDA_ON_CPU, id="cupy-on-cpu", marks=[
        pytest.mark.cuda_on_cpu,
        pytest.mark.skipif(CUDA_ON_CPU is None, reason=_CUDA_ON_CPU_SKIP or "unavailable")]))


# The CPU run of the CUDA backend emulates every GPU thread, so CI runs a subset of it
# (docs/gpu_testing.md): each hypothesis property on cupy-on-cpu draws CUDA_ON_CPU_EXAMPLES
# examples, and the cases marked cuda_on_cpu_extended are skipped. ABFT_CUDA_ON_CPU=all
# (make test-cuda-on-cpu) runs all of it with the active profile's examples.
CUDA_ON_CPU_ALL = os.environ.get("ABFT_CUDA_ON_CPU") == "all"
CUDA_ON_CPU_EXAMPLES = 10


def pytest_collection_modifyitems(config, items):
    if CUDA_ON_CPU_ALL:
        return
    skip = pytest.mark.skip(reason="CI's cupy-on-cpu subset leaves this case out for time; "
                                   "make test-cuda-on-cpu runs it")
    for item in items:
        if item.get_closest_marker("cuda_on_cpu") and item.get_closest_marker(
                "cuda_on_cpu_extended"):
            item.add_marker(skip)


@contextlib.contextmanager
def _fewer_examples(test):
    """``test``'s hypothesis settings with at most CUDA_ON_CPU_EXAMPLES examples, for its length."""
    old = getattr(test, "_hypothesis_internal_use_settings", None)
    if old is None or CUDA_ON_CPU_ALL:
        yield
        return
    test._hypothesis_internal_use_settings = settings(
        old, max_examples=min(old.max_examples, CUDA_ON_CPU_EXAMPLES))
    try:
        yield
    finally:
        test._hypothesis_internal_use_settings = old


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tests marked cuda_on_cpu see the CuPy stand-in as ``cupy`` (in ``sys.modules``) from their
    setup to their teardown; every other test sees the real CuPy, or none."""
    if CUDA_ON_CPU is None or item.get_closest_marker("cuda_on_cpu") is None:
        yield
        return
    from cuda_on_cpu import standin

    with standin.installed(), _fewer_examples(getattr(item, "obj", None)):
        yield

