"""Attention dropout in the fused core (attention/fused.py): its keep decisions
(attention/dropout_hash.py), the same results as the unfused core run with the materialized mask
(bare product and layer, float32 and float64, causal or not, key padding), faults at every fused
site with dropout on, and the core choice."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from abftgemm.backend import to_host
from abftgemm.faults import Fault
from abftgemm.report import FaultDetectedWarning
from attention import MultiHeadAttention
from attention.context import Context
from attention.core import core_backward, core_forward
from attention.dropout_hash import draw_seed, keep_mask
from attention._cpu_fused import BC
from attention.fused import DROPOUT_HOOK_SITE, fused_backward, fused_forward
from attention.fused_final import GRAD_SITE, OUTPUT_SITE, verify_grads, verify_output
from conftest import BACKENDS

SITES = ("fused:S", "fused:P", "fused:O_acc", "fused:rowsum", "fused:dP", "fused:dS",
         "fused:dQ_acc", "fused:dK_acc", "fused:dV_acc", DROPOUT_HOOK_SITE)
#: Where a fault in the dropped probabilities shows: the accumulators that read them.
SEEN_AT = {DROPOUT_HOOK_SITE: ("fused:O_acc", "fused:dV_acc")}
TOL = {np.float32: {"rtol": 2e-4, "atol": 2e-5}, np.float64: {"rtol": 1e-10, "atol": 1e-12}}


def _data(rng, n, lq, lk, d, dtype=np.float32):
    return tuple(rng.standard_normal(shape).astype(dtype)
                 for shape in ((n, lq, d), (n, lk, d), (n, lk, d), (n, lq, d)))


def _fused(q, k, v, do, ctx, **kw):
    out, saved = fused_forward(q, k, v, ctx, **kw)
    return (out,) + fused_backward(saved, do, ctx)


# ------------------------------------------------------------------ keep decisions


def test_keep_mask_statistics_and_seeds():
    shape = (3, 70, 90)
    count = math.prod(shape)
    for p in (0.1, 0.5, 0.9):
        keep = keep_mask(7, p, shape)
        assert keep.shape == shape and keep.dtype == bool and keep.flags.c_contiguous
        sigma = math.sqrt(count * p * (1 - p))
        assert abs(keep.sum() - count * (1 - p)) < 5 * sigma, (p, keep.mean())
    a, b = keep_mask(1, 0.5, shape), keep_mask(2, 0.5, shape)
    assert np.array_equal(a, keep_mask(1, 0.5, shape))
    assert 0.4 < (a != b).mean() < 0.6  # independent draws differ in about half the entries
    assert not keep_mask(3, 1.0, shape).any()
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="probability"):
            keep_mask(1, bad, shape)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        keep_mask(-1, 0.5, shape)
    with pytest.raises(TypeError, match="integer"):
        keep_mask(1.5, 0.5, shape)


def test_the_kernels_keep_what_keep_mask_materializes():
    """With V the identity, each output row is the row of dropped probabilities: zero exactly
    where the mask drops (and P > 0)."""
    n, lq, lk = 2, 70, 100
    rng = np.random.default_rng(0)
    q = 0.1 * rng.standard_normal((n, lq, lk))
    k = np.ascontiguousarray(np.broadcast_to(np.eye(lk), (n, lk, lk)))
    out, _ = fused_forward(q, k, k.copy(), Context(), dropout=0.4, dropout_seed=99)
    assert np.array_equal(out != 0, keep_mask(99, 0.4, (n, lq, lk)))


# ------------------------------------------------------------------ against the unfused core


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_equals_unfused_with_the_materialized_mask(dtype, causal):
    n, lq, d, p, seed = 3, 150, 16, 0.3, 1234
    lk = lq if causal else 130
    rng = np.random.default_rng(1)
    q, k, v, do = _data(rng, n, lq, lk, d, dtype)
    visible = rng.random((n, lk)) < 0.8  # key padding
    ctx = Context()
    got = _fused(q, k, v, do, ctx, causal=causal, key_visible=visible, dropout=p,
                 dropout_seed=seed)
    assert not ctx.report.events, ctx.report.summary()
    keep = keep_mask(seed, p, (n, lq, lk))
    ref = Context()
    out, saved = core_forward(q, k, v, ref, causal=causal, attn_mask=np.broadcast_to(
        ~visible[:, None, :], (n, lq, lk)).copy(), dropout=p, dropout_keep=keep, core="unfused")
    want = (out,) + core_backward(saved, do, ref)
    assert not ref.report.events
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, err_msg=name, rtol=TOL[dtype]["rtol"],
                                   atol=TOL[dtype]["atol"] * np.abs(w).max())
    other = _fused(q, k, v, do, Context(), causal=causal, key_visible=visible, dropout=p,
                   dropout_seed=seed + 1)
    assert not np.array_equal(other[0], got[0])  # another seed, other decisions


def test_core_forward_runs_dropout_fused_and_falls_back_with_a_given_mask():
    rng = np.random.default_rng(2)
    q, k, v, do = _data(rng, 2, 40, 40, 8)
    out, saved = core_forward(q, k, v, Context(), dropout=0.5, dropout_seed=5)
    assert saved["core"] == "fused"
    keep = keep_mask(5, 0.5, (2, 40, 40))
    out_u, saved_u = core_forward(q, k, v, Context(), dropout=0.5, dropout_keep=keep)
    assert saved_u["core"] == "unfused"
    np.testing.assert_allclose(out, out_u, rtol=2e-4, atol=2e-5)
    for g, w in zip(core_backward(saved, do, Context()), core_backward(saved_u, do, Context())):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5 * np.abs(w).max())
    with pytest.raises(ValueError, match="dropout_keep"):
        core_forward(q, k, v, Context(), dropout=0.5, dropout_keep=keep, core="fused")
    with pytest.raises(ValueError, match="not both"):
        core_forward(q, k, v, Context(), dropout=0.5, dropout_keep=keep, dropout_seed=5)


def test_all_dropped_gives_zero_output_and_value_gradient():
    q, k, v, do = _data(np.random.default_rng(3), 2, 30, 30, 8)
    ctx = Context()
    out, dq, dk, dv = _fused(q, k, v, do, ctx, dropout=1.0, dropout_seed=0)
    assert not ctx.report.events
    assert not out.any() and not dv.any() and not dq.any() and not dk.any()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_runs_dropout_on_the_fused_core(dtype, causal):
    """The layer draws the seed from ``rng``; the unfused layer given that seed's mask (or the
    seed itself) computes the same step."""
    rng = np.random.default_rng(4)
    batch, seq, d_model, heads, p = 2, 70, 16, 2, 0.25
    x = rng.standard_normal((batch, seq, d_model)).astype(dtype)
    dy = rng.standard_normal((batch, seq, d_model)).astype(dtype)
    mask = rng.random((batch, seq)) < 0.85
    results = {}
    for core in ("auto", "unfused"):
        layer = MultiHeadAttention(d_model, heads, dtype=dtype, causal=causal, core=core,
                                   seed=0)
        if core == "auto":
            y, cache = layer.forward(x, mask, dropout=p, rng=np.random.default_rng(9))
        else:
            keep = keep_mask(draw_seed(np.random.default_rng(9)), p, (batch * heads, seq, seq))
            y, cache = layer.forward(x, mask, dropout=p, dropout_keep=keep)
        assert layer.last_core == ("fused" if core == "auto" else "unfused")
        dx, grads = layer.backward(dy, cache)
        assert not layer.last_report.events, layer.last_report.summary()
        results[core] = (y, dx, *grads.values())
    tol = TOL[np.dtype(dtype).type]
    for g, w in zip(results["auto"], results["unfused"]):  # d_bq is 0 up to rounding
        np.testing.assert_allclose(g, w, rtol=tol["rtol"],
                                   atol=tol["atol"] * max(np.abs(w).max(), 1.0))


def test_layer_non_finite_input_runs_the_unfused_core_on_the_same_decisions():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 20, 16)).astype(np.float32)
    x[0, 3, 2] = np.inf
    layer = MultiHeadAttention(16, 2, seed=0)
    y, cache = layer.forward(x, dropout=0.5, dropout_seed=77)
    assert layer.last_core == "unfused"
    ref = MultiHeadAttention(16, 2, seed=0, core="unfused")
    y_ref, _ = ref.forward(x, dropout=0.5, dropout_keep=keep_mask(77, 0.5, (2, 20, 20)))
    assert np.array_equal(np.isnan(y), np.isnan(y_ref))
    np.testing.assert_array_equal(y[np.isfinite(y)], y_ref[np.isfinite(y)])


# ------------------------------------------------------------------ faults with dropout on


@pytest.mark.parametrize("site", SITES)
def test_fault_with_dropout_on_is_detected_and_corrected(site):
    q, k, v, do = _data(np.random.default_rng(6), 2, 130, 130, 32)
    kw = {"causal": True, "dropout": 0.2, "dropout_seed": 31}
    clean = _fused(q, k, v, do, Context(), **kw)
    fault = Fault("near-inf", "element", seed=3, sites=site)
    ctx = Context(fault_hook=fault)
    got = _fused(q, k, v, do, ctx, **kw)
    assert fault.injected and any(fault.injected[0].changed)
    assert set(ctx.report.sites) & set(SEEN_AT.get(site, (site,))), ctx.report.summary()
    assert all(e.action == "recomputed" for e in ctx.report.events)
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


def test_final_output_check_recomputes_with_the_same_dropout():
    """A fault in O after the kernels (fused:out) is repaired by a recomputation that keeps the
    call's dropout; the backward's final checks pass on it."""
    q, k, v, do = _data(np.random.default_rng(9), 2, 90, 90, 16)
    kw = {"causal": True, "dropout": 0.3, "dropout_seed": 12}
    out_clean, saved_clean = fused_forward(q, k, v, Context(), **kw)
    fault = Fault("near-inf", "element", seed=1, sites=OUTPUT_SITE)
    ctx = Context(fault_hook=fault)
    out, saved = verify_output(*fused_forward(q, k, v, ctx, **kw), ctx)
    assert fault.injected
    assert [(e.site, e.action) for e in ctx.report.events] == [(OUTPUT_SITE, "recomputed")]
    assert np.array_equal(out, out_clean)
    grads = fused_backward(saved, do, ctx)
    assert verify_grads(saved, do, grads, ctx) is grads
    assert ctx.report.checked[GRAD_SITE] == 1 and len(ctx.report.events) == 1


@pytest.mark.parametrize("skip", [0, 1, 2, 3])
def test_dropout_site_fault_in_any_tile_is_corrected(skip):
    """Faults in the dropped tile of later calls of the site, a quarter of its calls apart: the
    forward sees it once per tile (skip 0, 1: tiles of two query blocks), then the
    backward once per tile (skip 2, 3)."""
    q, k, v, do = _data(np.random.default_rng(7), 1, 130, 130, 16)
    kw = {"dropout": 0.5, "dropout_seed": 8}
    clean = _fused(q, k, v, do, Context(), **kw)
    blocks = -(-130 // BC)
    fault = Fault("additive", "element", seed=skip, sites=DROPOUT_HOOK_SITE, magnitude=1e3,
                  skip=skip * 2 * blocks * blocks // 4)
    ctx = Context(fault_hook=fault)
    got = _fused(q, k, v, do, ctx, **kw)
    assert fault.injected
    assert set(ctx.report.sites) & set(SEEN_AT[DROPOUT_HOOK_SITE]), ctx.report.summary()
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


def test_check_off_shows_a_dropout_site_fault():
    q, k, v, do = _data(np.random.default_rng(8), 1, 70, 70, 16)
    kw = {"dropout": 0.3, "dropout_seed": 4}
    clean = _fused(q, k, v, do, Context(check="off"), **kw)
    ctx = Context(check="off", fault_hook=Fault("additive", "element", seed=1,
                                                sites=DROPOUT_HOOK_SITE, magnitude=1e3))
    got = _fused(q, k, v, do, ctx, **kw)
    assert not ctx.report.events
    assert not np.array_equal(got[0], clean[0])


@pytest.mark.parametrize("xp", BACKENDS)
def test_bad_dropout_arguments(xp):
    q, k, v, _ = (xp.asarray(t) for t in _data(np.random.default_rng(0), 1, 8, 8, 8))
    with pytest.raises(ValueError, match="probability"):
        fused_forward(q, k, v, Context(), dropout=1.5)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        fused_forward(q, k, v, Context(), dropout=0.5, dropout_seed=2 ** 64)


@pytest.mark.parametrize("xp", BACKENDS)
def test_gpu_data_run_the_unfused_core_on_the_seeds_decisions(xp):
    """Device arrays (CuPy, or its CPU stand-in) run dropout on the unfused core: the seed's keep
    decisions materialized, the same output as the fused core on the host; the CUDA fused
    kernels, called directly, draw the same decisions (tests/test_fused_cuda_dropout.py)."""
    q, k, v, _ = _data(np.random.default_rng(9), 2, 20, 20, 8, np.float64)
    want, saved = core_forward(q, k, v, Context(), dropout=0.4, dropout_seed=3)
    assert saved["core"] == "fused"
    if xp is np:
        return
    dev = tuple(xp.asarray(t) for t in (q, k, v))
    got, saved = core_forward(*dev, Context(), dropout=0.4, dropout_seed=3)
    assert saved["core"] == "unfused"
    np.testing.assert_allclose(to_host(got), want, rtol=1e-10, atol=1e-12)
    fused, _ = fused_forward(*dev, Context(), dropout=0.4, dropout_seed=3)
    np.testing.assert_allclose(to_host(fused), want, rtol=1e-10, atol=1e-12)


def test_core_backward_of_a_non_finite_gradient_keeps_the_decisions():
    q, k, v, do = _data(np.random.default_rng(10), 2, 30, 30, 8, np.float64)
    do[1, 4, 3] = np.nan
    _, saved = core_forward(q, k, v, Context(), dropout=0.5, dropout_seed=6)
    assert saved["core"] == "fused"
    got = core_backward(saved, do, Context())
    _, ref = core_forward(q, k, v, Context(), dropout=0.5,
                          dropout_keep=keep_mask(6, 0.5, (2, 30, 30)))
    for g, w in zip(got, core_backward(ref, do, Context())):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dv_final_check_with_dropout_predicts_from_the_kept_sums(xp, p):
    """With dropout ``dV``'s column sums are predicted from the forward's kept sums ``r_i``
    (``saved["sums"][..., 3]``, those of the materialized ``P keep / (1 - p)`` in float64): a
    clean run passes and is checked; the prediction without them (the rows that see a key, as
    without dropout) would flag it; one element of ``dV`` moved by 1.5 thresholds of its column
    is flagged at ``fused:dV_out`` and repaired bit for bit."""
    from attention.fused_final import _grad_ratios

    rng = np.random.default_rng(11)
    n, length, d = 2, (90 if xp is np else 40), 16
    q, k, v, do = _data(rng, n, length, length, d)
    kw = {"causal": True, "dropout": p, "dropout_seed": 21}
    ctx = Context()
    out, saved = verify_output(*fused_forward(*(xp.asarray(t) for t in (q, k, v)), ctx, **kw),
                               ctx)
    s = (q.astype(np.float64) @ k.astype(np.float64).transpose(0, 2, 1)) / math.sqrt(d)
    s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    kept = (probs * keep_mask(21, p, (n, length, length)) / (1 - p)).sum(-1)
    np.testing.assert_allclose(to_host(saved["sums"][..., 3]), kept, rtol=1e-5)
    grads = fused_backward(saved, xp.asarray(do), ctx)
    assert verify_grads(saved, xp.asarray(do), grads, ctx) is grads
    assert ctx.report.checked[GRAD_SITE] == 1 and not ctx.report.events
    _, diff, tau = (to_host(t) for t in _grad_ratios(saved, xp.asarray(do), grads[2]))
    assert np.all(diff <= tau)
    dv = to_host(grads[2]).astype(np.float64)
    unweighted = np.abs(do.astype(np.float64).sum(1) - dv.sum(1))
    assert np.any(unweighted > tau), "the kept sums would not matter"
    clean = [to_host(t) for t in (out, *grads)]
    fault = Fault("additive", "element", sites=GRAD_SITE, batch=1, row=7, col=3,
                  magnitude=1.5 * (tau[1, 3] + diff[1, 3]))
    ctx = Context(fault_hook=fault)
    out, saved = verify_output(*fused_forward(*(xp.asarray(t) for t in (q, k, v)), ctx, **kw),
                               ctx)
    grads = verify_grads(saved, xp.asarray(do), fused_backward(saved, xp.asarray(do), ctx), ctx)
    assert fault.injected
    assert [(e.site, e.action, e.batch, e.cols) for e in ctx.report.events] == \
        [(GRAD_SITE, "recomputed", 1, (3,))]
    for g, c in zip((out, *grads), clean):
        assert np.array_equal(to_host(g), c)
    # an error of a size fixed here, not by the check's own threshold (about 2e-3 to 2e-2 at
    # p = 0.1 to 0.9: 1.2 to 11 times the threshold without dropout, which grows with ks), in
    # the column sums alone (the row check would see it as well)
    changed = to_host(grads[2]).copy()
    changed[0, 5, 2] += 0.1
    ratio, _, _ = _grad_ratios(saved, xp.asarray(do), xp.asarray(changed))
    assert to_host(ratio)[0, 2] > 1
    fault = Fault("additive", "element", sites=GRAD_SITE, batch=0, row=5, col=2, magnitude=0.1)
    ctx = Context(check="detect", fault_hook=fault)
    out, saved = fused_forward(*(xp.asarray(t) for t in (q, k, v)), ctx, **kw)
    with pytest.warns(FaultDetectedWarning, match=GRAD_SITE):
        verify_grads(saved, xp.asarray(do), fused_backward(saved, xp.asarray(do), ctx), ctx)


def test_dv_final_check_with_dropout_after_an_unchecked_forward_judges_rows():
    """A forward run with ``check="off"`` carries no kept sums, so with dropout ``dV``'s column
    sums have no prediction; its rows are still judged against the checksums the backward
    carried: a fault in the returned ``dV`` is found and repaired."""
    q, k, v, do = _data(np.random.default_rng(12), 1, 40, 40, 8)
    out, saved = fused_forward(q, k, v, Context(check="off"), dropout=0.2, dropout_seed=3)
    assert saved["sums"] is None
    clean = fused_backward(saved, do, Context())
    ctx = Context(fault_hook=Fault("additive", "element", sites=GRAD_SITE, row=5, col=2,
                                   magnitude=0.5))
    grads = verify_grads(saved, do, fused_backward(saved, do, ctx), ctx)
    assert ctx.report.checked[GRAD_SITE] == ctx.report.checked["fused:dK_out"] == 1
    assert [(e.site, e.action, e.rows) for e in ctx.report.events] == [
        (GRAD_SITE, "recomputed", (5,))]
    for g, c in zip(grads, clean):
        assert np.array_equal(g, c)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropped_entry_whose_scaled_gradient_overflows_is_zero(xp, dtype):
    """A dropped entry (keep 0) whose ``dP' / (1 - p)`` overflows: ``dP`` is 0 there, as the
    unfused core makes it; the kernels and the dS check multiplied by keep (``INF * 0``, NaN),
    so a clean backward reported faults and raised in ``check="correct"`` (and the final
    check's own overflow warned)."""
    big = {np.float32: 1e37, np.float64: 1e307}[dtype]
    q = k = np.zeros((1, 1, 4), dtype)
    v, do = np.ones((1, 1, 4), dtype), np.full((1, 1, 4), big, dtype)
    p = 0.99
    seed = next(s for s in range(1000) if not keep_mask(s, p, (1, 1, 1))[0, 0, 0])
    for check in ("detect", "correct"):
        ctx = Context(check=check)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, saved = verify_output(*fused_forward(
                *(xp.asarray(t) for t in (q, k, v)), ctx, dropout=p, dropout_seed=seed), ctx)
            grads = verify_grads(saved, xp.asarray(do), fused_backward(saved, xp.asarray(do),
                                                                       ctx), ctx)
        assert not ctx.report.events, ctx.report.summary()
        for g in grads:
            assert not to_host(g).any()
