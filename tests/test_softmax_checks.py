"""The CPU (numba) softmax invariant checks agree with the array-module versions the GPU runs.

Both are run here on NumPy arrays: the numba kernels through ``check_forward``/``check_backward``,
the array versions directly (``_forward_errors``/``_backward_ratio``). They sum in different
precisions (float64 vs the accumulation dtype), so errors agree up to the tolerance's scale and
the verdicts agree whenever the error is clearly on one side of the tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attention import softmax as sm


@st.composite
def probabilities(draw):
    """``(p, z, visible)``: a softmax of random scores, float32 or float64, masked or not."""
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rows, length = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    z = (rng.standard_normal((2, rows, length)) * draw(st.sampled_from([0.1, 3.0, 30.0])))
    z = z.astype(dtype)
    visible = None
    if draw(st.booleans()):
        visible = rng.random((2, rows, length)) < 0.7
        visible[0, 0] = False  # a fully hidden row
    return sm.softmax_forward(z, visible, dtype), z, visible


def corrupt(x: np.ndarray, how: str) -> np.ndarray:
    x = x.copy()
    flat = x.reshape(-1)
    k = int(np.argmax(np.abs(flat)))
    flat[k] = {"nan": np.nan, "inf": np.inf, "scale": flat[k] * 1.5 + 0.25}[how]
    return x


def _forward_ok_array(p, z, visible):
    """The array version's verdict (the one the GPU runs), on NumPy arrays."""
    errors = sm._forward_errors(p.astype(z.dtype), z, visible)
    return sm._forward_verdict(errors, p.dtype, z.dtype, z.shape[-1])[0]


@given(case=probabilities())
def test_forward_check_passes_clean_softmax_like_the_array_version(case):
    p, z, visible = case
    assert sm.check_forward(p, z, visible)[0]
    assert _forward_ok_array(p, z, visible)


@pytest.mark.parametrize("how", ["nan", "inf", "scale"])
@given(case=probabilities())
def test_forward_check_flags_a_corrupted_entry_like_the_array_version(case, how):
    p, z, visible = case
    if visible is not None:  # corrupt a visible entry: hidden ones are not checked
        visible[...] = True
        p = sm.softmax_forward(z, visible, p.dtype)
    bad = corrupt(p, how)
    assert not sm.check_forward(bad, z, visible)[0]
    assert not _forward_ok_array(bad, z, visible)


@st.composite
def backward_cases(draw):
    p, z, _ = draw(probabilities())
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    dp = rng.standard_normal(p.shape).astype(p.dtype)
    return sm.softmax_backward(dp, p, p.dtype), dp, p


@given(case=backward_cases())
def test_backward_check_agrees_with_the_array_version(case):
    ds, dp, p = case
    u, tiny = sm._backward_tolerance(ds)
    ok, _, _ = sm.check_backward(ds, dp, p)
    assert ok and sm._backward_ratio(ds, dp, p, u, tiny)[0] <= 1
    for how in ("nan", "inf", "scale"):
        bad = corrupt(ds, how)
        assert not sm.check_backward(bad, dp, p)[0]
        assert sm._backward_ratio(bad, dp, p, u, tiny)[0] > 1
