"""Shared fixtures: hypothesis profiles and the list of array backends to run every body on."""
from __future__ import annotations

import os

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


GPU = _gpu_module()
BACKENDS = [pytest.param(np, id="numpy"),
            pytest.param(GPU, id="cupy", marks=pytest.mark.skipif(GPU is None, reason="no GPU"))]

