"""Attention dropout in the fused CUDA kernels (attention/kernels/fused.cu, on CuPy or on
cupy-on-cpu without a GPU): the keep decisions of attention/dropout_hash.py bit for bit, the CPU
fused core's results for the same seed, the unfused core's with the materialized mask, p = 1, and
faults at the forward and backward sites (the dropped tile included) with dropout on. Shapes stay
small: the emulation runs every CUDA thread on the CPU."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from abftgemm.checksums import unit_roundoff
from attention.context import Context
from attention.core import core_backward, core_forward
from attention.dropout_hash import keep_mask
from attention.fused import DROPOUT_HOOK_SITE, fused_backward, fused_forward
from conftest import BACKENDS

CUDA = [p for p in BACKENDS if p.id != "numpy"]
NAMES = ("out", "dq", "dk", "dv")
#: CUDA against the CPU core and the unfused core: float32 tiles of 32 (CUDA) and 64 (CPU) keys
#: sum in other orders.
TOL = {np.float32: {"rtol": 2e-4, "atol": 2e-5}, np.float64: {"rtol": 1e-10, "atol": 1e-12}}
#: An element of each site in the second query block and second key tile (32 x 32 tiles) of head
#: 1, causal-visible; accumulators hit after their first tile.
ELEMENTS = {"fused:S": (40, 35), "fused:P": (41, 33), "fused:O_acc": (45, 3),
            "fused:rowsum": (50, 0), DROPOUT_HOOK_SITE: (40, 34), "fused:dP": (40, 35),
            "fused:dS": (41, 33), "fused:dQ_acc": (45, 3), "fused:dK_acc": (35, 3),
            "fused:dV_acc": (36, 5)}
#: (site, the call whose kernels take the fault).
CASES = [(s, "forward") for s in ("fused:S", "fused:P", "fused:O_acc", "fused:rowsum",
                                  DROPOUT_HOOK_SITE)] + [
    (s, "backward") for s in ("fused:S", "fused:P", "fused:dP", "fused:dS", "fused:dQ_acc",
                              "fused:dK_acc", "fused:dV_acc", DROPOUT_HOOK_SITE)]
#: Where a fault in the dropped probabilities shows: the accumulator that reads them.
SEEN_AT = {(DROPOUT_HOOK_SITE, "forward"): "fused:O_acc",
           (DROPOUT_HOOK_SITE, "backward"): "fused:dV_acc"}


def _data(rng, n, lq, lk, d, dtype=np.float32):
    return tuple(rng.standard_normal(shape).astype(dtype)
                 for shape in ((n, lq, d), (n, lk, d), (n, lk, d), (n, lq, d)))


def _run(xp, q, k, v, do, ctx, backward_ctx=None, **kw):
    """Output and gradients, as NumPy arrays, of ``xp`` data."""
    out, saved = fused_forward(xp.asarray(q), xp.asarray(k), xp.asarray(v), ctx, **kw)
    grads = fused_backward(saved, xp.asarray(do), ctx if backward_ctx is None else backward_ctx)
    if xp is np:
        return [out, *grads]
    return [out.get()] + [g.get() for g in grads]


def _close(got, want, dtype):
    tol = TOL[dtype]
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == dtype
        np.testing.assert_allclose(g, w, err_msg=name, rtol=tol["rtol"],
                                   atol=tol["atol"] * max(np.abs(w).max(), 1.0))


@pytest.mark.parametrize("xp", CUDA)
def test_the_kernels_keep_what_keep_mask_materializes(xp):
    """With V the identity, each output row is the row of dropped probabilities: zero exactly
    where the hash drops (P > 0 everywhere), the same decisions as the NumPy hash."""
    n, lq, lk = 2, 40, 70
    rng = np.random.default_rng(0)
    q = 0.1 * rng.standard_normal((n, lq, lk))
    k = np.ascontiguousarray(np.broadcast_to(np.eye(lk), (n, lk, lk)))
    out, saved = fused_forward(xp.asarray(q), xp.asarray(k), xp.asarray(k), Context(),
                               dropout=0.4, dropout_seed=2 ** 64 - 99)
    assert saved["dropout"] == (0.4, 2 ** 64 - 99)
    assert np.array_equal(out.get() != 0, keep_mask(2 ** 64 - 99, 0.4, (n, lq, lk)))


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_equals_the_cpu_core_and_the_unfused_core(xp, dtype, causal):
    n, lq, d, p, seed = 2, 70, 16, 0.3, 1234
    lk = lq if causal else 45
    rng = np.random.default_rng(1)
    q, k, v, do = _data(rng, n, lq, lk, d, dtype)
    visible = rng.random((n, lk)) < 0.8  # key padding
    kw = {"causal": causal, "key_visible": visible, "dropout": p, "dropout_seed": seed}
    ctx = Context()
    got = _run(xp, q, k, v, do, ctx, **{**kw, "key_visible": xp.asarray(visible)})
    assert not ctx.report.events, ctx.report.summary()
    cpu = _run(np, q, k, v, do, Context(), **kw)
    _close(got, cpu, dtype)
    ref = Context()
    keep = keep_mask(seed, p, (n, lq, lk))
    out, saved = core_forward(q, k, v, ref, causal=causal, attn_mask=np.broadcast_to(
        ~visible[:, None, :], (n, lq, lk)).copy(), dropout=p, dropout_keep=keep, core="unfused")
    _close(got, [out, *core_backward(saved, do, ref)], dtype)
    assert not ref.report.events
    plain = _run(xp, q, k, v, do, Context(), causal=causal, key_visible=xp.asarray(visible))
    for g, c in zip(got, plain):  # dropout did something
        assert not np.allclose(g, c)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_data_equal_the_cpu_core(xp, dtype):
    """Both compute in float32 with ``ks`` in float32; their results, rounded once to the data's
    dtype, differ by the float32 tiles' summation order: within a few of the data's units."""
    q, k, v, do = _data(np.random.default_rng(2), 2, 50, 70, 16, dtype)
    kw = {"dropout": 0.25, "dropout_seed": 77}
    ctx = Context()
    got = _run(xp, q, k, v, do, ctx, **kw)
    assert not ctx.report.events, ctx.report.summary()
    cpu = _run(np, q, k, v, do, Context(), **kw)
    u = unit_roundoff(dtype)
    for name, g, w in zip(NAMES, got, cpu):
        assert g.dtype == dtype
        g, w = g.astype(np.float64), w.astype(np.float64)
        np.testing.assert_allclose(g, w, err_msg=name, rtol=4 * u, atol=4 * u * np.abs(w).max())


@pytest.mark.parametrize("xp", CUDA)
def test_all_dropped_gives_zero(xp):
    q, k, v, do = _data(np.random.default_rng(3), 2, 40, 40, 16)
    ctx = Context()
    got = _run(xp, q, k, v, do, ctx, causal=True, dropout=1.0, dropout_seed=0)
    assert not ctx.report.events, ctx.report.summary()
    assert not any(g.any() for g in got)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site,phase", CASES, ids=[f"{s}-{ph}" for s, ph in CASES])
def test_fault_with_dropout_on_is_corrected(xp, site, phase):
    from attention._cuda_fused import DeviceFault

    q, k, v, do = _data(np.random.default_rng(6), 2, 70, 70, 16)
    kw = {"causal": True, "dropout": 0.2, "dropout_seed": 31}
    # the element must be kept for a fault in the dropped tile to change the product
    assert keep_mask(31, 0.2, (2, 70, 70))[1][ELEMENTS[DROPOUT_HOOK_SITE]]
    clean = _run(xp, q, k, v, do, Context(), **kw)
    row, col = ELEMENTS[site]
    fault = DeviceFault(site, row, col, head=1, kind="additive", value=1e3)
    ctx, quiet = Context(fault_hook=fault), Context()
    first, second = (ctx, quiet) if phase == "forward" else (quiet, ctx)
    got = _run(xp, q, k, v, do, first, second, **kw)
    assert fault.hits == 1, fault
    assert SEEN_AT.get((site, phase), site) in ctx.report.sites, ctx.report.summary()
    assert all(e.action == "recomputed" for e in ctx.report.events)
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


@pytest.mark.parametrize("xp", CUDA)
def test_check_off_shows_a_dropout_site_fault(xp):
    from attention._cuda_fused import DeviceFault

    q, k, v, do = _data(np.random.default_rng(8), 2, 70, 70, 16)
    kw = {"dropout": 0.2, "dropout_seed": 31}
    clean = _run(xp, q, k, v, do, Context(check="off"), **kw)
    row, col = ELEMENTS[DROPOUT_HOOK_SITE]
    fault = DeviceFault(DROPOUT_HOOK_SITE, row, col, head=1, kind="additive", value=1e3)
    ctx = Context(check="off", fault_hook=fault)
    got = _run(xp, q, k, v, do, ctx, Context(check="off"), **kw)
    assert fault.hits == 1 and not ctx.report.events
    assert not np.array_equal(got[0][1, row], clean[0][1, row])
    assert np.array_equal(np.delete(got[0][1], row, 0), np.delete(clean[0][1], row, 0))


@pytest.mark.parametrize("xp", CUDA)
def test_device_fault_names_the_dropped_tile(xp):
    from abftgemm.faults import Fault
    from attention._cuda_fused import device_fault

    fault = Fault("additive", "element", seed=0, sites=DROPOUT_HOOK_SITE, magnitude=1e3,
                  batch=1, row=40, col=34)
    got = device_fault(fault, (2, 70, 16), 70, np.float32, causal=True)
    assert (got.site, got.head, got.row, got.col, got.step) == (DROPOUT_HOOK_SITE, 1, 40, 34, 0)
    with pytest.raises(ValueError, match="one site of"):
        device_fault(Fault("additive", "element", sites="fused:nowhere"), (2, 70, 16), 70,
                     np.float32)
