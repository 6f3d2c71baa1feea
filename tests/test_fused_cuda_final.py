"""The fused core's final checks (attention/fused_final.py) on CuPy data, or on cupy-on-cpu
without a GPU: the CUDA forward's carried output checksums against the CPU kernel's, clean runs
through all three checks, a fault in the returned O, dV or dK (the toolkit's Fault at the sites
fused:out, fused:dV_out, fused:dK_out, which the CUDA core takes as on NumPy) reported in
check="detect" and repaired bit for bit in check="correct", core="fused" with CuPy data in the
bare core and the layer, and core="auto" keeping CuPy data on the unfused core. Shapes stay small:
the emulation runs every CUDA thread on the CPU."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from abftgemm import UncorrectableError
from abftgemm.backend import to_host
from abftgemm.faults import Fault
from attention import MultiHeadAttention
from attention.context import Context
from attention.core import core_backward, core_forward
from attention.fused import fused_backward, fused_forward
from attention.fused_choice import static_reason
from attention.fused_final import (DK_SITE, FINAL_SITES, GRAD_SITE, OUTPUT_SITE, dk_column_sums,
                                   verify_grads, verify_output)
from conftest import BACKENDS
from test_fused import _data, adversarial_calls

CUDA = [p for p in BACKENDS if p.id != "numpy"]
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16),
          np.dtype(ml_dtypes.bfloat16)]


def _device(xp, *arrays):
    return tuple(xp.asarray(a) for a in arrays)


def _checked_run(xp, q, k, v, do, ctx, **kw):
    """The bare core (forced fused) on ``xp`` data with its final checks: ``(out, dq, dk, dv)``
    on the host."""
    if "attn_mask" in kw:
        kw["attn_mask"] = xp.asarray(kw["attn_mask"])
    out, saved = core_forward(*_device(xp, q, k, v), ctx, core="fused", **kw)
    assert saved["core"] == "fused"
    grads = core_backward(saved, xp.asarray(do), ctx)
    return [to_host(t) for t in (out, *grads)]


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("dropout", [0.0, 0.4])
def test_carried_sums_equal_the_cpu_kernels(xp, dtype, rtol, dropout):
    """``saved["sums"]`` of the CUDA forward: (n, L, 4) float64, plain, weighted and absolute
    row checksums and the kept probabilities' row sums (with dropout those of ``P keep ks``),
    those of the CPU kernel within the rounding of the tiles' arithmetic (32-key tiles against
    128-key ones); 0 for a row that sees no key; None with check="off". The backward's carried
    row sums of dK and dV (``saved["kv_sums"]``) likewise."""
    rng = np.random.default_rng(0)
    q, k, v, do = _data(rng, 2, 45, 70, 16, dtype)
    visible = rng.random((2, 70)) < 0.6
    visible[1] = False  # head 1 sees no key: its rows' sums are 0
    kw = dict(dropout=dropout, dropout_seed=3)
    _, cpu = fused_forward(q, k, v, Context(), key_visible=visible, **kw)
    _, gpu = fused_forward(*_device(xp, q, k, v), Context(), key_visible=xp.asarray(visible),
                           **kw)
    got = gpu["sums"].get()
    assert got.shape == (2, 45, 4) and got.dtype == np.float64
    assert not got[1].any()
    if dropout:  # the kept sums are not the rows' probability sums
        assert np.abs(got[0, :, 3] - 1).max() > 0.05
    np.testing.assert_allclose(got, cpu["sums"], rtol=rtol, atol=rtol * np.abs(cpu["sums"]).max())
    fused_backward(cpu, do, Context())
    fused_backward(gpu, xp.asarray(do), Context())
    want = cpu["kv_sums"]
    np.testing.assert_allclose(gpu["kv_sums"].get(), want, rtol=rtol,
                               atol=rtol * np.abs(want).max())
    _, off = fused_forward(*_device(xp, q, k, v), Context(check="off"))
    assert off["sums"] is None


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clean_runs_pass_the_three_final_checks(xp, dtype):
    """Causal, an additive mask with a fully masked query row, key padding: every final check
    runs once and none flags; the results equal the NumPy fused core's within the tiles'
    rounding."""
    rng = np.random.default_rng(1)
    q, k, v, do = _data(rng, 2, 40, 40, 16, dtype)
    add = rng.standard_normal((2, 40, 40))
    add[:, 5] = -np.inf
    for kw in ({"causal": True}, {"attn_mask": add}):
        ctx = Context()
        got = _checked_run(xp, q, k, v, do, ctx, **kw)
        assert not ctx.report.events, ctx.report.summary()
        assert all(ctx.report.checked[s] == 1 for s in FINAL_SITES), ctx.report.checked
        want = _checked_run(np, q, k, v, do, Context(), **kw)
        for g, w in zip(got, want):
            assert g.dtype == dtype
            g, w = g.astype(np.float64), w.astype(np.float64)
            np.testing.assert_allclose(g, w, rtol=0, atol=8 * np.finfo(dtype).eps
                                       * max(np.abs(w).max(), 1.0))


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_false_positive_on_adversarial_clean_data(xp, dtype):
    """Scores up to ~80, identical keys, key padding with a head that sees no key, additive
    masks with fully masked query rows, causal and not, dropout up to p = 1: the final checks
    run on every call and never flag."""
    rng = np.random.default_rng(int(dtype.num))
    for call, q, k, v, do, kw in adversarial_calls(rng, 12, 70, [8, 16, 32], dtype,
                                                    [0.1, 0.5, 1.0]):
        ctx = Context()
        q, k, v, do = _device(xp, q, k, v, do)
        kw = {name: xp.asarray(t) if isinstance(t, np.ndarray) else t for name, t in kw.items()}
        out, saved = verify_output(*fused_forward(q, k, v, ctx, **kw), ctx)
        verify_grads(saved, do, fused_backward(saved, do, ctx), ctx)
        assert not ctx.report.events, (call, ctx.report.summary())
        assert ctx.report.checked[OUTPUT_SITE] == ctx.report.checked[DK_SITE] == 1
        assert ctx.report.checked[GRAD_SITE] == 1


@pytest.mark.parametrize("xp", CUDA)
def test_with_dropout_every_final_check_runs(xp):
    """With dropout fused:out, fused:dK_out and fused:dV_out check (dV's prediction weighted by
    the kept sums the forward kernel carries out)."""
    q, k, v, do = _data(np.random.default_rng(2), 1, 40, 40, 16)
    ctx = Context()
    _checked_run(xp, q, k, v, do, ctx, causal=True, dropout=0.3, dropout_seed=4)
    assert not ctx.report.events, ctx.report.summary()
    assert ctx.report.checked[OUTPUT_SITE] == ctx.report.checked[DK_SITE] == 1
    assert ctx.report.checked[GRAD_SITE] == 1


def _fault(xp, site, q, k, v, do, **kw):
    """A fault at ``site`` (head 1, row 7, column 3) that its check must flag: at fused:dK_out
    one that moves the column's sum past 1.5 times its threshold (the thresholds as the CuPy
    run computes them), elsewhere +10."""
    magnitude = 10.0
    if site == DK_SITE:
        out, saved = fused_forward(*_device(xp, q, k, v), Context())
        _, dk, _ = fused_backward(saved, xp.asarray(do), Context())
        diff, tau = (t.get() for t in dk_column_sums(saved, xp.asarray(do), dk))
        assert np.all(diff <= tau)
        magnitude = 1.5 * (tau[1, 3] + diff[1, 3])
    return Fault("additive", "element", sites=site, batch=1, row=7, col=3, magnitude=magnitude,
                 **kw)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site", FINAL_SITES)
def test_a_fault_after_the_kernels_is_repaired_bit_for_bit(xp, site):
    q, k, v, do = _data(np.random.default_rng(3), 2, 40, 40, 16)
    clean = _checked_run(xp, q, k, v, do, Context(), causal=True)
    fault = _fault(xp, site, q, k, v, do)
    ctx = Context(fault_hook=fault)
    got = _checked_run(xp, q, k, v, do, ctx, causal=True)
    assert fault.injected and fault.injected[0].changed == [True]
    assert [(e.site, e.action, e.batch) for e in ctx.report.events] == [(site, "recomputed", 1)]
    assert ctx.report.events[0].cols == (3,)
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site", FINAL_SITES)
def test_detect_mode_reports_the_fault_and_leaves_it(xp, site):
    q, k, v, do = _data(np.random.default_rng(4), 2, 40, 40, 16)
    q, k, v, do = _device(xp, q, k, v, do)
    ctx = Context(check="detect")
    out, saved = fused_forward(q, k, v, ctx, causal=True)
    grads = fused_backward(saved, do, ctx)
    clean = [out.get()] + [g.get() for g in grads]
    fault = _fault(xp, site, *(t.get() for t in (q, k, v, do)))
    ctx = Context(check="detect", fault_hook=fault)
    with pytest.warns(Warning, match=site):
        if site == OUTPUT_SITE:
            got = [verify_output(out, saved, ctx)[0].get()] + [g.get() for g in grads]
        else:
            got = [out.get()] + [g.get() for g in verify_grads(saved, do, grads, ctx)]
    (event,) = ctx.report.events
    assert (event.site, event.action, event.batch) == (site, "reported", 1)
    assert event.magnitude > event.threshold
    index = {OUTPUT_SITE: 0, DK_SITE: 2, GRAD_SITE: 3}[site]
    for i, (g, c) in enumerate(zip(got, clean)):
        assert np.array_equal(g, c) == (i != index)
    assert got[index][1, 7, 3] != clean[index][1, 7, 3]


@pytest.mark.parametrize("xp", CUDA)
def test_a_persistent_fault_raises(xp):
    q, k, v, do = _data(np.random.default_rng(5), 1, 40, 40, 16)
    ctx = Context(fault_hook=Fault("nan", "element", seed=0, sites=OUTPUT_SITE, times=None))
    with pytest.raises(UncorrectableError, match=OUTPUT_SITE):
        _checked_run(xp, q, k, v, do, ctx)


@pytest.mark.parametrize("xp", CUDA)
def test_a_toolkit_fault_at_a_kernel_site_is_refused(xp):
    """The kernels inject their own sites' faults (DeviceFault); a toolkit Fault may name only
    sites outside them."""
    q, k, v, _ = _data(np.random.default_rng(6), 1, 8, 8, 8)
    for sites in ("fused:S", None, (OUTPUT_SITE, "fused:O_acc")):
        ctx = Context(fault_hook=Fault("nan", "element", sites=sites))
        with pytest.raises(TypeError, match="DeviceFault"):
            fused_forward(*_device(xp, q, k, v), ctx)


@pytest.mark.parametrize("xp", CUDA)
def test_forced_fused_core_runs_cupy_data_in_the_layer(xp):
    """core="fused" with CuPy data: the fused CUDA kernels and their final checks between the
    projections, equal to the unfused layer within float32 rounding; a fault at fused:out in
    the layer is repaired bit for bit."""
    rng = np.random.default_rng(7)
    x, dy = (xp.asarray(rng.standard_normal((2, 40, 32)).astype(np.float32)) for _ in range(2))
    results = {}
    for core in ("fused", "unfused"):
        layer = MultiHeadAttention(32, 2, causal=True, dtype="float32", xp=xp, core=core, seed=0)
        y, cache = layer.forward(x)
        assert layer.last_core == core
        sites = set(layer.last_report.checked)
        dx, grads = layer.backward(dy, cache)
        sites |= set(layer.last_report.checked)
        assert not layer.last_report.events
        assert (set(FINAL_SITES) <= sites) == (core == "fused")
        results[core] = [y.get(), dx.get()] + [grads[n].get() for n in sorted(grads)]
    for got, want in zip(results["fused"], results["unfused"]):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    layer = MultiHeadAttention(32, 2, causal=True, dtype="float32", xp=xp, core="fused", seed=0)
    fault = Fault("additive", "element", seed=1, sites=OUTPUT_SITE, magnitude=10.0)
    y, cache = layer.forward(x, fault_hook=fault)
    assert fault.injected and [e.site for e in layer.last_report.events] == [OUTPUT_SITE]
    assert np.array_equal(y.get(), results["fused"][0])


@pytest.mark.parametrize("xp", CUDA)
def test_auto_keeps_cupy_data_on_the_unfused_core(xp):
    q, k, v, _ = _data(np.random.default_rng(8), 2, 8, 8, 8)
    reason = static_reason(xp, np.dtype(np.float32), None, Context())
    assert "slower than the unfused core" in reason and "core='fused'" in reason
    assert static_reason(xp, np.dtype(np.float32), None, Context(), forced=True) is None
    assert static_reason(np, np.dtype(np.float32), None, Context()) is None
    _, saved = core_forward(*_device(xp, q, k, v), Context())
    assert saved["core"] == "unfused"
    layer = MultiHeadAttention(16, 2, dtype="float32", xp=xp)
    layer.forward(xp.asarray(np.zeros((1, 8, 16), np.float32)))
    assert layer.last_core == "unfused"
