"""Attention dropout: the protected layer and attention product against float64 math with the same
mask, faults at every site with dropout on, the dropout check itself, and bad input."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from abftgemm.backend import to_host
from abftgemm.faults import Fault, Recorder
from attention import INVARIANT_SITES, SITES, Context
from attention import reference as ref
from attention.core import core_backward, core_forward
from attention.dropout import DROPOUT_SITE
from attention.dropout_hash import keep_mask as seeded_keep_mask
from conftest import BACKENDS
from test_attention import problem as layer_problem

#: Relative error allowed against float64 math, per layer dtype: the flash-attention style budget
#: of tests/test_attention.py is per tensor; here a plain bound of the dtype's roundoff over the
#: chain of ten dependent steps and sums of up to 3 * d_model terms covers every tensor.
TOL = {"float64": 1e-11, "float32": 2e-4}


def keep_mask(rng, shape, p):
    return rng.random(shape) >= p


def run(layer, x, mask, dy, p, keep, hook=None):
    y, cache = layer.forward(x, mask, fault_hook=hook, dropout=p, dropout_keep=keep)
    dx, grads = layer.backward(dy, cache, fault_hook=hook)
    report = layer.last_report  # the forward's findings and the backward's
    return {"y": y, "dx": dx, **grads}, report, cache


def reference_outputs(layer, x, mask, dy, p, keep):
    params = {k: to_host(v).astype(np.float64) for k, v in layer.params.items()}
    b, s, _ = x.shape
    y, cache = ref.forward(to_host(x).astype(np.float64), params, layer.n_heads,
                           None if mask is None else to_host(mask), layer.causal, dropout=p,
                           dropout_keep=to_host(keep).reshape(b, layer.n_heads, s, s))
    dx, grads = ref.backward(to_host(dy).astype(np.float64), cache, params, layer.n_heads)
    return {"y": y, "dx": dx, **grads}


def assert_close(got, want, tol):
    for key, w in want.items():
        g = to_host(got[key]).astype(np.float64)
        err = np.abs(g - w).max(initial=0)
        assert err <= tol * max(np.abs(w).max(initial=0), 1.0), (key, err)


def problem(xp, dtype, p, batch=2, seq=6, d_model=8, heads=2, causal=False, masked=False,
            seed=0):
    """The layer problem of tests/test_attention.py, and a dropout mask with probability ``p``."""
    layer, x, mask, dy = layer_problem(xp, dtype, batch, seq, d_model, heads, causal, masked,
                                       seed)
    keep = xp.asarray(keep_mask(np.random.default_rng(seed + 2), (batch * heads, seq, seq), p))
    return layer, x, mask, dy, keep


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(seq=st.integers(1, 7), heads=st.integers(1, 3), causal=st.booleans(),
       masked=st.booleans(), p=st.sampled_from([0.1, 0.5, 1.0]), seed=st.integers(0, 1000))
def test_layer_with_dropout_matches_float64_math_with_the_same_mask(xp, dtype, seq, heads,
                                                                    causal, masked, p, seed):
    layer, x, mask, dy, keep = problem(xp, dtype, p, seq=seq, d_model=2 * heads, heads=heads,
                                       causal=causal, masked=masked, seed=seed)
    got, report, cache = run(layer, x, mask, dy, p, keep)
    assert not report.detected, report.summary()
    assert report.checked[DROPOUT_SITE] == 1
    assert_close(got, reference_outputs(layer, x, mask, dy, p, keep), TOL[dtype])
    # what the context multiplied: P * keep / (1 - p), exactly as one rounding makes it
    probs, dropped = to_host(cache["probs"]), to_host(cache["probs_dropped"])
    scale = 0.0 if p == 1 else 1 / (1 - p)
    assert np.array_equal(dropped, np.where(to_host(keep), probs * probs.dtype.type(scale), 0))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_dropout_is_close_to_float64_math(xp, dtype):
    layer, x, mask, dy, keep = problem(xp, dtype, 0.3, seq=8, causal=True)
    got, report, _ = run(layer, x, mask, dy, 0.3, keep)
    assert not report.detected, report.summary()
    assert_close(got, reference_outputs(layer, x, mask, dy, 0.3, keep), 0.05)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("site", SITES + tuple(INVARIANT_SITES) + (DROPOUT_SITE,))
def test_faults_with_dropout_are_repaired(xp, site):
    layer, x, mask, dy, keep = problem(xp, "float64", 0.4, causal=True, masked=True)
    clean, _, _ = run(layer, x, mask, dy, 0.4, keep)
    for kind, pattern in (("nan", "element"), ("additive", "element"), ("inf", "row")):
        fault = Fault(kind, pattern, seed=2, sites=site, row=3, magnitude=3.0)
        got, report, _ = run(layer, x, mask, dy, 0.4, keep, fault)
        assert fault.injected, "the fault never fired"
        if any(fault.injected[0].changed):  # a dropped entry may already be 0
            assert site in report.sites, (kind, report.summary())
        assert_close(got, {k: to_host(v) for k, v in clean.items()}, 1e-12)


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_dropout_fault_is_recomputed_and_unprotected_it_spreads(xp):
    layer, x, mask, dy, keep = problem(xp, "float32", 0.2, seq=8)
    clean, _, _ = run(layer, x, mask, dy, 0.2, keep)
    fault = Fault("additive", "element", seed=0, sites=DROPOUT_SITE, row=2, col=1, magnitude=0.5)
    got, report, _ = run(layer, x, mask, dy, 0.2, keep, fault)
    assert [e.action for e in report.events if e.site == DROPOUT_SITE] == ["recomputed"]
    assert_close(got, {k: to_host(v) for k, v in clean.items()}, 1e-6)
    layer.check = "off"
    fault = Fault("additive", "element", seed=0, sites=DROPOUT_SITE, row=2, col=1, magnitude=0.5)
    damaged, report, _ = run(layer, x, mask, dy, 0.2, keep, fault)
    assert not report.events and DROPOUT_SITE not in report.checked
    assert np.abs(to_host(damaged["y"]) - to_host(clean["y"])).max() > 1e-2


@pytest.mark.parametrize("xp", BACKENDS)
def test_dropout_site_reaches_the_hook_only_with_dropout(xp):
    layer, x, mask, dy, keep = problem(xp, "float32", 0.5)
    recorder = Recorder()
    run(layer, x, mask, dy, 0.5, keep, recorder)
    assert recorder.sites == set(SITES) | set(INVARIANT_SITES) | {DROPOUT_SITE}
    recorder = Recorder()
    run(layer, x, mask, dy, 0.0, None, recorder)
    assert DROPOUT_SITE not in recorder.sites


@pytest.mark.parametrize("xp", BACKENDS)
def test_attention_product_with_dropout_matches_float64_math(xp):
    rng = np.random.default_rng(3)
    n, sq, sk, d, p = 3, 5, 7, 4, 0.3
    q, k, v, d_out = (rng.standard_normal(s) for s in ((n, sq, d), (n, sk, d), (n, sk, d),
                                                         (n, sq, d)))
    keep = keep_mask(rng, (n, sq, sk), p)
    ctx = Context()
    out, saved = core_forward(*(xp.asarray(t) for t in (q, k, v)), ctx, dropout=p,
                              dropout_keep=xp.asarray(keep))
    dq, dk, dv = core_backward(saved, xp.asarray(d_out), ctx)
    assert not ctx.report.detected and ctx.report.checked[DROPOUT_SITE] == 1
    s = q @ k.transpose(0, 2, 1) / np.sqrt(d)
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    dropped = probs * keep / (1 - p)
    d_probs = d_out @ v.transpose(0, 2, 1) * keep / (1 - p)
    d_s = probs * (d_probs - (d_probs * probs).sum(-1, keepdims=True)) / np.sqrt(d)
    for got, want in ((out, dropped @ v), (dv, dropped.transpose(0, 2, 1) @ d_out),
                      (dq, d_s @ k), (dk, d_s.transpose(0, 2, 1) @ q)):
        np.testing.assert_allclose(to_host(got), want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("core", ["unfused", "auto"])
def test_drawn_masks_keep_the_expected_share_and_follow_the_generator(core):
    """The unfused core draws its mask from ``rng``; the fused core (``"auto"`` here) the seed of
    its keep decisions, materialized by :func:`attention.dropout_hash.keep_mask`."""
    layer, x, _, dy, _ = problem(np, "float64", 0.25, batch=4, seq=32)
    layer.core = core
    _, c1 = layer.forward(x, dropout=0.25, rng=np.random.default_rng(7))
    _, c2 = layer.forward(x, dropout=0.25, rng=np.random.default_rng(7))
    assert c1["core"] == ("fused" if core == "auto" else "unfused")
    if core == "unfused":
        keep = c1["inputs"].dropout.keep
        assert np.array_equal(keep, c2["inputs"].dropout.keep)
    else:
        p, seed = c1["inputs"].fused_dropout
        assert (p, seed) == c2["inputs"].fused_dropout
        keep = seeded_keep_mask(seed, p, (4 * layer.n_heads, 32, 32))
    # 8192 Bernoulli(0.75) draws: the share kept is 0.75 +- 5 standard deviations
    assert abs(keep.mean() - 0.75) < 5 * np.sqrt(0.75 * 0.25 / keep.size)


@pytest.mark.parametrize("xp", BACKENDS)
def test_bad_dropout_arguments_raise_clearly(xp):
    layer, x, _, _, keep = problem(xp, "float32", 0.5)
    with pytest.raises(ValueError, match="dropout must be a probability"):
        layer.forward(x, dropout=1.5, dropout_keep=keep)
    with pytest.raises(ValueError, match="dropout_keep was given with dropout=0"):
        layer.forward(x, dropout_keep=keep)
    with pytest.raises(ValueError, match="boolean array of shape"):
        layer.forward(x, dropout=0.5, dropout_keep=keep[:1])
    with pytest.raises(ValueError, match="boolean array of shape"):
        layer.forward(x, dropout=0.5, dropout_keep=keep.astype(np.float32))
