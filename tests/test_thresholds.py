"""Zero false positives on adversarial clean data, on every backend present (the calibration of
abftgemm/thresholds.py as a test; scripts/calibrate_thresholds.py prints the same ratios)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import abftgemm
from abftgemm.thresholds import element_tolerance, threshold
from conftest import BACKENDS

SPEC = importlib.util.spec_from_file_location(
    "calibrate_thresholds", Path(__file__).resolve().parents[1] / "scripts" / "calibrate_thresholds.py")
calibrate = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(calibrate)

DTYPES = [pytest.param(d, id=np.dtype(d).name) for d in abftgemm.SUPPORTED_DTYPES]
SHAPES = [(64, 256, 64), (96, 1500, 40), (700, 48, 96)]


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_adversarial_clean_products_stay_below_the_threshold(xp, dtype, shape):
    rng = np.random.default_rng(sum(shape))
    big = calibrate._largest(dtype)
    for label, a64, b64 in calibrate.cases(rng, *shape, big):
        ratio = calibrate.worst_ratio(xp, dtype, a64, b64)  # asserts nothing is flagged
        assert ratio < 1, (label, ratio)  # |d| / tau < 1 is what "not flagged" means


def test_threshold_terms():
    """The threshold is linear in both sums and grows with k and the vector length."""
    t = threshold(np.array([0.0, 1.0]), np.array([0.0, 0.0]), 64, 32, np.dtype(np.float32))
    assert 0 < t[0] < t[1]
    assert threshold(1.0, 0.0, 256, 32, np.float32) > threshold(1.0, 0.0, 64, 32, np.float32)
    # output rounding: 1.01 u_out per unit of observed |C|, plus the float64 checksum term
    # u64 (32 + 64) / (1.01 u_out) = 2e-11 and the subnormal floor 6e-5 * 96 / 1e6 / 4.9e-4 = 1.2e-5
    # relative to it: rel=1e-4 holds those and would not hold a changed coefficient.
    assert threshold(0.0, 1e6, 64, 32, np.float16) / 1e6 == pytest.approx(1.01 * 2.0 ** -11, rel=1e-4)
    assert threshold(1.0, 1.0, 64, 32, np.float32, bias=True) > threshold(1.0, 1.0, 64, 32,
                                                                           np.float32)
    assert element_tolerance(np.array([1.0]), 64, np.float16)[0] > 2 * 2.0 ** -11
