"""The fused core's final check of dK (attention/fused_final.py, site fused:dK_out): the column
sums of dK over the keys are 0 (the rows of dS sum to 0). Clean data never flag it (adversarial
data, masks, dropout, 16-bit dtypes), a column changed by more than its threshold is detected,
repaired in check="correct" and reported in check="detect"."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from abftgemm import FaultDetectedWarning, UncorrectableError
from abftgemm.backend import to_host
from abftgemm.faults import Fault
from attention.context import Context
from attention.fused import fused_backward, fused_forward
from attention.fused_final import (DK_SITE, GRAD_SITE, GRAD_SITES, _grad_ratios, dk_column_sums,
                                   verify_grads)
from conftest import BACKENDS
from test_fused import _data, _run, adversarial_calls

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16),
          np.dtype(ml_dtypes.bfloat16)]


def _backward(q, k, v, do, **kw):
    """A clean forward and backward (no final check): ``(saved, (dq, dk, dv))``."""
    ctx = Context()
    _, saved = fused_forward(q, k, v, ctx, **kw)
    grads = fused_backward(saved, do, ctx)
    assert not ctx.report.events
    return saved, grads


def _exact_column_sums(q, k, v, do, causal):
    """Float64 ``1^T dK`` of the unmasked or causal core: 0 up to float64 rounding."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    s = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[2])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[1:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    ds = p * (do @ v.transpose(0, 2, 1) - (do * o).sum(-1, keepdims=True))
    return (ds.transpose(0, 2, 1) @ q).sum(1) / math.sqrt(q.shape[2])


def test_the_column_sums_are_zero_in_exact_arithmetic():
    """The identity the check rests on, in float64, against the size of the terms."""
    q, k, v, do = _data(np.random.default_rng(0), 2, 90, 90, 16, np.float64)
    sums = _exact_column_sums(q, k, v, do, causal=True)
    _, (_, dk, _) = _backward(q, k, v, do, causal=True)
    assert np.abs(sums).max() < 1e-12 * np.abs(dk).sum(1).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_false_positive_on_adversarial_clean_data(dtype):
    """Logits up to near float32's exp overflow, identical keys (flat rows), key padding with a
    head that sees no key, additive masks with fully masked query rows, causal and not, dropout
    (p up to 1): 48 calls per dtype, the check never flags and runs on every one."""
    rng = np.random.default_rng(int(dtype.num))
    for call, q, k, v, do, kw in adversarial_calls(rng, 48, 140, [8, 16, 64], dtype,
                                                    [0.1, 0.5, 0.9, 1.0]):
        ctx = Context()
        got = _run(q, k, v, do, ctx, **kw)
        assert not ctx.report.events, (call, ctx.report.summary())
        assert ctx.report.checked[DK_SITE] == 1
        assert all(np.isfinite(g.astype(np.float64)).all() for g in got)


def test_threshold_is_tight_enough_to_matter():
    """On standard normal data the threshold is below the dK values it guards: a change of a
    small fraction of a column's magnitude ``sum_j |dK_jc|`` exceeds it (float32 tiles: about
    0.2% at L = 130, the worst-case bounds of the module docstring; 16-bit rounding adds)."""
    for dtype, frac in ((np.float32, 0.004), (np.float16, 0.01), (ml_dtypes.bfloat16, 0.06),
                        (np.float64, 1e-11)):
        q, k, v, do = _data(np.random.default_rng(1), 2, 130, 130, 32, dtype)
        saved, (_, dk, _) = _backward(q, k, v, do, causal=True)
        diff, tau = dk_column_sums(saved, do, dk)
        assert np.all(diff <= tau)
        mags = np.abs(dk.astype(np.float64)).sum(1)
        assert np.all(tau < frac * mags), (dtype, (tau / mags).max())


def _column_fault(saved, do, dk, sign=1.0):
    """A fault that moves one dK column's sum (head 1, column 3) by 1.5 times the column's
    threshold plus its clean sum, so that the sum ends beyond the threshold, at key 7."""
    diff, tau = dk_column_sums(saved, do, dk)
    assert np.all(diff <= tau)
    magnitude = sign * 1.5 * (tau[1, 3] + diff[1, 3])
    return Fault("additive", "element", sites=DK_SITE, batch=1, row=7, col=3,
                 magnitude=magnitude), magnitude, tau[1, 3]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_column_beyond_the_threshold_is_corrected(dtype):
    q, k, v, do = _data(np.random.default_rng(2), 2, 100, 100, 16, dtype)
    clean = _run(q, k, v, do, Context(), causal=True)
    saved, grads = _backward(q, k, v, do, causal=True)
    fault, magnitude, tau = _column_fault(saved, do, grads[1])
    assert abs(magnitude) > tau
    ctx = Context(fault_hook=fault)
    got = _run(q, k, v, do, ctx, causal=True)
    assert fault.injected and any(fault.injected[0].changed)
    assert [(e.site, e.action, e.cols) for e in ctx.report.events] == [(DK_SITE, "recomputed",
                                                                        (3,))]
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


def test_detect_mode_reports_the_column_and_leaves_it():
    q, k, v, do = _data(np.random.default_rng(3), 2, 100, 100, 16, np.float16)
    saved, grads = _backward(q, k, v, do, causal=True)
    clean = [g.copy() for g in grads]
    fault, _, _ = _column_fault(saved, do, grads[1], sign=-1.0)
    ctx = Context(check="detect", fault_hook=fault)
    with pytest.warns(Warning, match=DK_SITE):
        got = verify_grads(saved, do, grads, ctx)
    (event,) = ctx.report.events
    assert (event.site, event.action, event.batch, event.cols) == (DK_SITE, "reported", 1, (3,))
    assert event.magnitude > event.threshold
    assert not np.array_equal(got[1], clean[1]) and np.array_equal(got[2], clean[2])


def test_with_dropout_the_dk_check_runs_and_repairs():
    """dS's rows sum to 0 with dropout too: fused:dK_out checks (and fused:dV_out)."""
    q, k, v, do = _data(np.random.default_rng(4), 2, 90, 90, 16)
    kw = {"causal": True, "dropout": 0.3, "dropout_seed": 5}
    clean = _run(q, k, v, do, Context(), **kw)
    ctx = Context(fault_hook=Fault("additive", "element", seed=2, sites=DK_SITE, magnitude=1.0))
    got = _run(q, k, v, do, ctx, **kw)
    assert DK_SITE in ctx.report.checked and GRAD_SITE in ctx.report.checked
    assert [(e.site, e.action) for e in ctx.report.events] == [(DK_SITE, "recomputed")]
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


def test_both_backward_checks_judge_the_recomputed_gradients():
    """A fault at fused:dV_out recomputes the backward; its dK and dV are both checked again
    (a persistent fault at one site raises, naming it)."""
    q, k, v, do = _data(np.random.default_rng(5), 1, 80, 80, 16)
    ctx = Context(fault_hook=Fault("nan", "element", seed=0, sites=GRAD_SITE))
    _run(q, k, v, do, ctx)
    assert [(e.site, e.action) for e in ctx.report.events] == [(GRAD_SITE, "recomputed")]
    assert all(ctx.report.checked[s] == 1 for s in GRAD_SITES)
    ctx = Context(fault_hook=Fault("inf", "element", seed=0, sites=DK_SITE, times=None))
    with pytest.raises(UncorrectableError, match=DK_SITE):
        _run(q, k, v, do, ctx)


def test_verify_grads_runs_the_sites_asked_for():
    q, k, v, do = _data(np.random.default_rng(6), 1, 64, 64, 8)
    saved, grads = _backward(q, k, v, do)
    ctx = Context()
    assert verify_grads(saved, do, grads, ctx, sites=(DK_SITE,)) is grads
    assert set(ctx.report.checked) == {DK_SITE}
    for bad in ((), ("fused:out",), ("fused:dQ_out",)):
        with pytest.raises(ValueError, match="sites must be some of"):
            verify_grads(saved, do, grads, Context(), sites=bad)


@pytest.mark.parametrize("kind", ["nan", "additive"])
def test_scores_around_1e9_keep_a_finite_threshold(kind):
    """Scores around 1e9, where float32's ``lse`` alone has lost ``log l`` (the threshold had no
    finite value there, only INF or NaN sums were flagged): with the log-sum-exp kept as ``lse +
    lse_lo`` the bound stays finite, clean data pass, and a NaN or an error of 10 thresholds in
    dK is found and repaired. (Finite, not tight: the worst-case bound is 2000-4000 times a
    column's ``sum |dK|`` here, where P is nearly one-hot and dK small.)"""
    q, k, v, do = _data(np.random.default_rng(7), 2, 70, 70, 16, spread=3e4)
    saved, (_, dk, _) = _backward(q, k, v, do, causal=True)
    assert np.abs(saved["lse"]).max() > 1e7
    diff, tau = dk_column_sums(saved, do, dk)
    assert np.isfinite(tau).all() and (diff <= tau).all()
    clean = _run(q, k, v, do, Context(), causal=True)
    magnitude = 10 * float(tau.max())
    ctx = Context(fault_hook=Fault(kind, "element", seed=1, sites=DK_SITE, magnitude=magnitude))
    got = _run(q, k, v, do, ctx, causal=True)
    assert [(e.site, e.action) for e in ctx.report.events] == [(DK_SITE, "recomputed")]
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


def test_a_row_lowered_at_every_key_keeps_the_final_thresholds_tight():
    """A query row that an additive mask lowers by 1e9 at every key (a padded row): its
    ``lse`` is about 1e9, but the backward's error comes from ``lse_lo``, not ``u |lse|``, so
    the dK and dV thresholds stay those of the head without the row (they were INF and 2e7
    times larger), and a unit error is found."""
    q, k, v, do = _data(np.random.default_rng(9), 2, 40, 40, 16)
    mask = np.zeros((40, 40), np.float32)
    taus = []
    for low in (0.0, -1e9):
        mask[7] = low
        saved, (_, dk, dv) = _backward(q, k, v, do, attn_mask=mask)
        taus.append((dk_column_sums(saved, do, dk)[1], _grad_ratios(saved, do, dv)[2]))
    for plain, lowered in zip(*taus):
        assert np.isfinite(lowered).all() and (lowered <= 2 * plain).all()
    for site in GRAD_SITES:
        ctx = Context(check="detect", fault_hook=Fault("additive", "element", seed=3, sites=site,
                                                       magnitude=1.0))
        with pytest.warns(FaultDetectedWarning):
            _run(q, k, v, do, ctx, attn_mask=mask)
        assert site in ctx.report.sites


@pytest.mark.parametrize("site,dtype,fault", [
    (DK_SITE, np.float32, "pair"), (DK_SITE, np.float32, "exponent bit"),
    (GRAD_SITE, np.float16, "pair")])
def test_a_fault_that_cancels_in_a_column_sum_shows_in_its_magnitude(site, dtype, fault):
    """A pair of opposite near-INF values in one column, or a whole column scaled by 2^128 (the
    top bit of each exponent set): the column's sum barely moves, and the threshold grew with
    the observed magnitude (dK's always, dV's for 16-bit data), so they passed. ``sum_j
    |x_jc|`` is now judged against its bound from the inputs, and the threshold takes the
    smaller of the two."""
    q, k, v, do = (x.astype(dtype) for x in _data(np.random.default_rng(10), 2, 60, 60, 8))
    clean = _run(q, k, v, do, Context(), causal=True)
    fired = []

    def hook(name, x):
        if name != site or fired:
            return
        fired.append(name)
        if fault == "pair":
            big = 1e10 if dtype == np.float32 else 32752.0
            x[0, 3, 2], x[0, 9, 2] = big, -big
        else:
            column = x[1, :, 4]
            column[...] = (column.view(np.uint32) | np.uint32(1 << 30)).view(np.float32)

    ctx = Context(fault_hook=hook)
    got = _run(q, k, v, do, ctx, causal=True)
    assert fired and [(e.site, e.action) for e in ctx.report.events] == [(site, "recomputed")]
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


def test_a_dk_beyond_float16s_range_raises_naming_overflow():
    """Scores scaled by 1e30 make one-hot rows: dK is 0 in exact arithmetic, and its rounding
    noise times the scale is past float16's range in the kernels' float32 (INF once rounded).
    The recomputation gives the same INF: the error says what INF may be."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(shape).astype(np.float16)
                   for shape in ((1, 20, 16), (1, 33, 16), (1, 33, 16), (1, 20, 16)))
    ctx = Context()
    out, saved = fused_forward(q, k, v, ctx, scale=1e30)
    grads = fused_backward(saved, do, ctx)
    assert not np.isfinite(grads[1]).all()
    with pytest.raises(UncorrectableError, match="genuine overflow of float16"):
        verify_grads(saved, do, grads, ctx)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("site", GRAD_SITES)
@pytest.mark.parametrize("kind,extra", [("scale", {"factor": -1.0}), ("scale", {"factor": 0.0}),
                                        ("scale", {"factor": 0.5}), ("bitflip", {"bit": 31})],
                         ids=["negated", "zeroed", "halved", "sign bits"])
def test_a_whole_column_scaled_negated_or_zeroed_is_found_by_its_rows(xp, site, kind, extra):
    """A fault that scales one column of the returned ``dK`` (or ``dV``) keeps ``dK``'s column
    sum 0 (and may keep ``dV``'s near its prediction): it passed ``fused:dK_out`` with gradients
    off by up to 150%. The rows of both are judged against the row checksums the backward
    kernel carried beside its accumulators: found, located at a row, repaired bit for bit."""
    q, k, v, do = (xp.asarray(t) for t in _data(np.random.default_rng(0), 2, 64, 64, 16))

    def step(ctx):
        out, saved = fused_forward(q, k, v, ctx, causal=True)
        return verify_grads(saved, do, fused_backward(saved, do, ctx), ctx)

    clean = step(Context())
    fault = Fault(kind, "column", seed=0, sites=site, batch=0, col=3, **extra)
    ctx = Context(fault_hook=fault)
    got = step(ctx)
    assert fault.injected
    (event,) = ctx.report.events
    assert (event.site, event.action, event.batch) == (site, "recomputed", 0) and event.rows
    for g, c in zip(got, clean):
        assert np.array_equal(to_host(g), to_host(c))
