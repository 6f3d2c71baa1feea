"""The layer's softmax steps (one fused kernel per backend) against float64 math written here, and
their invariant checks against corrupted outputs. The same bodies run on NumPy (numba kernels) and
CuPy (CUDA kernels), the latter only where a GPU is present."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from abftgemm.backend import to_host
from abftgemm.checksums import unit_roundoff
from attention.softmax_steps import backward_step, forward_step
from attention.workspace import Workspace
from conftest import BACKENDS

HEADS, HEAD_DIM = 2, 4  # scale 1/sqrt(4) = 0.5: scaling the scores is exact in every dtype


@st.composite
def cases(draw):
    """Raw scores (batch*heads, seq_q, seq_k) float32/float64, dP, masks and causality."""
    dtype = np.dtype(draw(st.sampled_from(["float32", "float64"])))
    batch, seq_q, seq_k = draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    spread = draw(st.sampled_from([0.1, 3.0, 30.0]))
    scores = (rng.standard_normal((batch * HEADS, seq_q, seq_k)) * spread).astype(dtype)
    keys = rng.random((batch, seq_k)) < 0.7 if draw(st.booleans()) else None
    if keys is not None and draw(st.booleans()):
        keys[0] = False  # a batch element whose rows see no key: P = 0 there
    add = None
    if draw(st.booleans()):
        add = rng.standard_normal((1, seq_q, seq_k))
        add[0, :, -1] = -np.inf  # hides the last key
    dp = rng.standard_normal(scores.shape).astype(dtype)
    return scores, dp, keys, add, draw(st.booleans())


def _visible(keys, add, causal, shape):
    bh, sq, sk = shape
    vis = np.ones(shape, bool)
    if keys is not None:
        vis &= np.repeat(keys, HEADS, axis=0)[:, None, :]
    if causal:
        vis &= np.tril(np.ones((sq, sk), bool))
    if add is not None:
        vis &= np.isfinite(add)
    return vis


def _forward(xp, case, hook=None):
    scores, _, keys, add, causal = case
    inp = SimpleNamespace(head_dim=HEAD_DIM, n_heads=HEADS, causal=causal,
                          key_visible=None if keys is None else xp.asarray(keys),
                          attn_add=None if add is None else xp.asarray(add))
    ctx = SimpleNamespace(check="correct", fault_hook=hook)
    plan = SimpleNamespace(row_limits=None, observed=xp.zeros(scores.shape[:2] + (5,)))
    s = xp.asarray(scores)
    step = forward_step(inp, s, xp.empty_like(s), ctx, Workspace(), plan)
    return step, plan


@pytest.mark.parametrize("xp", BACKENDS)
@given(case=cases())
def test_forward_step_matches_float64_and_passes_its_check(xp, case):
    scores, _, keys, add, causal = case
    step, plan = _forward(xp, case)
    assert step.verdict()[0]
    vis = _visible(keys, add, causal, scores.shape)
    z = scores.astype(np.float64) * 0.5 + (0 if add is None else add)
    zv = np.where(vis, z, -np.inf)
    top = zv.max(-1, keepdims=True)
    e = np.where(vis, np.exp(zv - np.where(np.isfinite(top), top, 0)), 0.0)
    total = e.sum(-1, keepdims=True)
    want = e / np.where(total == 0, 1, total)
    # Relative error of a probability: the subtraction z - max and the exponential (~|z| u + 2u
    # each side), the row sum (L u) and the division and store (2u); 2 max|z| + L + 8 units.
    u = unit_roundoff(scores.dtype)
    rel = (2 * np.abs(np.where(vis, z, 0)).max(initial=0) + scores.shape[-1] + 8) * u
    got = to_host(step.probs)
    assert np.all(np.abs(got - want) <= rel * want + np.finfo(scores.dtype).tiny)
    # Row checksums of the raw scores: float64 sums of L terms in another order, L u_64 relative.
    s64 = scores.astype(np.float64)
    stats = to_host(plan.observed)
    bound = scores.shape[-1] * 2.0**-52 * np.abs(s64).sum(-1)
    assert np.all(np.abs(stats[..., 0] - s64.sum(-1)) <= bound)
    weights = np.arange(1, s64.shape[-1] + 1) / s64.shape[-1]
    assert np.all(np.abs(stats[..., 1] - (s64 * weights).sum(-1)) <= bound)


def _corrupt(how):
    def hook(site, c):
        flat = c.reshape(-1)
        k = int(np.argmax(np.abs(to_host(flat))))  # the row's top probability / largest dS
        value = float(flat[k])
        flat[k] = {"nan": np.nan, "inf": np.inf, "scale": value * 1.5 + 0.25}[how]
    return hook


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("how", ["nan", "inf", "scale"])
@given(case=cases())
def test_forward_check_flags_a_corrupted_probability(xp, how, case):
    scores, dp, keys, add, causal = case
    case = scores, dp, None, None, causal  # every row sees a key: a corrupted entry is visible
    step, _ = _forward(xp, case, _corrupt(how))
    assert not step.verdict()[0]


def _backward(xp, case, hook=None):
    scores, dp, keys, add, causal = case
    fwd, _ = _forward(xp, case)
    plan = SimpleNamespace(row_limits=None, observed=xp.zeros(dp.shape[:2] + (5,)))
    d = xp.asarray(dp)
    ctx = SimpleNamespace(check="correct", fault_hook=hook)
    step = backward_step(d, fwd.probs, xp.empty_like(d), 0.5, ctx, Workspace(), plan,
                         causal=causal)
    return step, plan


@pytest.mark.parametrize("xp", BACKENDS)
@given(case=cases())
def test_backward_step_matches_float64_and_passes_its_check(xp, case):
    step, plan = _backward(xp, case)
    assert step.verdict()[0]
    p, dp = to_host(step.p).astype(np.float64), case[1].astype(np.float64)
    terms = np.abs(p * dp).sum(-1, keepdims=True)
    want = 0.5 * p * (dp - (p * dp).sum(-1, keepdims=True))
    # r sums L terms (L u of sum |P dP|), dP - r, the products, the scale and the store (4u):
    # |error| <= (L + 4) u * 0.5 * P (|dP| + sum |P dP|).
    dtype = case[1].dtype
    bound = (dp.shape[-1] + 4) * unit_roundoff(dtype) * 0.5 * p * (np.abs(dp) + terms)
    assert np.all(np.abs(to_host(step.ds) - want) <= bound + np.finfo(dtype).tiny)
    assert np.all(np.abs(to_host(plan.observed)[..., 0] - dp.sum(-1)) <=
                  dp.shape[-1] * 2.0**-52 * np.abs(dp).sum(-1))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("how", ["nan", "inf", "scale"])
@given(case=cases())
def test_backward_check_flags_a_corrupted_gradient(xp, how, case):
    scores, dp, keys, add, causal = case
    case = scores, dp, None, None, False  # every entry visible: dS has a nonzero entry
    step, _ = _backward(xp, case, _corrupt(how))
    assert not step.verdict()[0]


@pytest.mark.parametrize("xp", BACKENDS)
def test_float16_subnormal_probabilities_skip_the_log_identity(xp):
    """Flat float16 rows of 2048 keys hold entries below float16's smallest normal (6.1e-5) but
    above 1e-3 of their row's largest: stored with an absolute precision only, the log identity
    must skip them (each such row failed its clean check when it did not); a fault still fails."""
    scores = np.random.default_rng(0).uniform(0, 13.8, (HEADS, 4, 2048)).astype(np.float16)
    case = scores, None, None, None, False  # z = scores / 2 in [0, 6.9]
    step, _ = _forward(xp, case)
    p = to_host(step.probs).astype(np.float64)
    assert ((p < 2.0**-14) & (p > 1e-3 * p.max(-1, keepdims=True))).any()
    assert step.verdict()[0]
    faulty, _ = _forward(xp, case, _corrupt("scale"))
    assert not faulty.verdict()[0]


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_mask_value_below_the_float32_range_hides_its_key_in_the_check_too(xp):
    """A float64 additive mask of -1e300 is -inf once rounded to float32, the arithmetic type:
    the softmax hides the key, and the check must too (on the GPU it once judged visibility on
    the unrounded double, so a fully masked row had to sum to 1 and failed)."""
    scores = np.random.default_rng(2).standard_normal((HEADS, 3, 5)).astype(np.float32)
    add = np.zeros((1, 3, 5))
    add[0, 1, :] = -1e300  # every key of query 1
    add[0, 2, 0] = -1e300  # one key of query 2
    step, _ = _forward(xp, (scores, None, None, add, False))
    p = to_host(step.probs)
    assert (p[:, 1] == 0).all() and (p[:, 2, 0] == 0).all()
    np.testing.assert_allclose(p[:, [0, 2]].sum(-1), 1.0, rtol=1e-6)
    assert step.verdict()[0]


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_causal_rows_are_zero_past_the_diagonal_whatever_they_hold(xp, dtype):
    """Past the diagonal of a causal row, P and dS are 0: in a row made NaN by a visible NaN
    score, and where dP holds NaN or INF (those entries stay out of r and of the check)."""
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((HEADS, 6, 6)).astype(dtype)
    scores[1, 3, 2] = np.nan
    above = np.triu(np.ones((6, 6), bool), 1)
    fwd, _ = _forward(xp, (scores, None, None, None, True))
    p = to_host(fwd.probs)
    assert np.isnan(p[1, 3, :4]).all() and (p[1, 3, 4:] == 0).all()
    assert (p[:, above] == 0).all() and np.isfinite(np.delete(p[1], 3, axis=0)).all()

    clean = scores.copy()
    clean[1, 3, 2] = 0.0
    dp = rng.standard_normal(scores.shape).astype(dtype)
    poisoned = np.where(above, np.where(rng.random(dp.shape) < 0.5, np.nan, np.inf), dp)
    step, _ = _backward(xp, (clean, poisoned.astype(dtype), None, None, True))
    assert step.verdict()[0]
    p, dp = to_host(step.p).astype(np.float64), dp.astype(np.float64)
    want = 0.5 * p * (dp - (p * dp).sum(-1, keepdims=True))  # P is 0 above the diagonal
    ds = to_host(step.ds)
    assert (ds[:, above] == 0).all()
    np.testing.assert_allclose(ds, want, rtol=0, atol=64 * unit_roundoff(np.dtype(dtype)))
