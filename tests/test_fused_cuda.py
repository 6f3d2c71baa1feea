"""The fused protected attention core's CUDA kernels (attention/_cuda_fused.py, kernels/fused.cu)
on CuPy, or on cupy-on-cpu without a GPU: test_fused.py's float64 reference and data, every
forward site faulted by the kernels' own injector, clean adversarial data, 16-bit dtypes, bad
input. Shapes stay small: the emulation runs every CUDA thread on the CPU."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from abftgemm import UncorrectableError
from abftgemm.checksums import unit_roundoff
from attention.context import Context
from attention.fused import FORWARD_SITES, fused_backward, fused_forward
from conftest import BACKENDS
from test_fused import _data, _reference

CUDA = [p for p in BACKENDS if p.id != "numpy"]
KINDS = [("inf", 0.0), ("nan", 0.0), ("near-inf", 0.0), ("additive", 1e3)]
#: An element of each forward site in the second query block and second key tile (32 x 32 tiles)
#: of head 1, causal-visible; accumulators hit after their first tile.
ELEMENTS = {"fused:S": (40, 35), "fused:P": (41, 33), "fused:O_acc": (45, 3),
            "fused:rowsum": (50, 0)}


def _forward(xp, q, k, v, ctx, **kw):
    out, saved = fused_forward(xp.asarray(q), xp.asarray(k), xp.asarray(v), ctx, **kw)
    return out.get(), saved


def _fault(site, kind, value, persistent=False):
    from attention._cuda_fused import DeviceFault

    row, col = ELEMENTS[site]
    return DeviceFault(site, row, col, head=1, kind=kind, value=value, persistent=persistent)


@pytest.mark.parametrize("xp", CUDA)
@given(n=st.integers(1, 2), lq=st.integers(1, 70), lk=st.integers(1, 70),
       d=st.sampled_from([8, 16, 32]), causal=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**31))
def test_forward_matches_float64_reference(xp, n, lq, lk, d, causal, dtype, seed):
    if causal:
        lk = lq
    q, k, v, do = _data(np.random.default_rng(seed), n, lq, lk, d, dtype)
    ctx = Context()
    out, saved = _forward(xp, q, k, v, ctx, causal=causal)
    assert not ctx.report.events, ctx.report.summary()
    assert saved["lse"].dtype == dtype
    want, tol = _reference(q, k, v, do, 1 / math.sqrt(d), causal)
    if dtype == np.float64:
        np.testing.assert_allclose(out, want[0], rtol=1e-9, atol=1e-12)
    else:
        assert np.all(np.abs(out - want[0]) <= tol[0]), np.max(np.abs(out - want[0]) / tol[0])


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_data(xp, dtype):
    """Tile arithmetic in float32, the output rounded once to the data's dtype."""
    q, k, v, do = _data(np.random.default_rng(3), 2, 50, 70, 32, dtype)
    ctx = Context()
    out, saved = _forward(xp, q, k, v, ctx, causal=False)
    assert not ctx.report.events, ctx.report.summary()
    assert out.dtype == dtype and saved["lse"].dtype == np.float32
    want, tol = _reference(q, k, v, do, 1 / math.sqrt(32), False)
    err = np.abs(out.astype(np.float64) - want[0])
    assert np.all(err <= tol[0] + 1.01 * unit_roundoff(dtype) * np.abs(want[0])), err.max()


@pytest.mark.parametrize("xp", CUDA)
def test_key_visible_and_fully_masked_rows(xp):
    rng = np.random.default_rng(1)
    q, k, v, do = _data(rng, 2, 40, 70, 16)
    visible = rng.random((2, 70)) < 0.5
    visible[1] = False  # head 1 sees no key at all: output 0, log-sum-exp -inf
    ctx = Context()
    out, saved = _forward(xp, q, k, v, ctx, key_visible=visible)
    assert not ctx.report.events
    want, tol = _reference(q, k, v, do, 0.25, False, visible)
    assert np.all(np.abs(out - want[0]) <= tol[0])
    assert not out[1].any() and np.all(saved["lse"].get()[1] == -np.inf)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site", FORWARD_SITES)
@pytest.mark.parametrize("kind,value", KINDS, ids=[k for k, _ in KINDS])
def test_fault_at_internal_site_is_detected_and_corrected(xp, site, kind, value):
    q, k, v, _ = _data(np.random.default_rng(2), 2, 70, 70, 16)
    clean, _ = _forward(xp, q, k, v, Context(), causal=True)
    fault = _fault(site, kind, value)
    ctx = Context(fault_hook=fault)
    got, _ = _forward(xp, q, k, v, ctx, causal=True)
    assert fault.hits == 1
    assert site in ctx.report.sites, ctx.report.summary()
    assert all(e.action == "recomputed" for e in ctx.report.events)
    assert np.array_equal(got, clean)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site", FORWARD_SITES)
def test_check_off_shows_the_damage(xp, site):
    q, k, v, _ = _data(np.random.default_rng(2), 2, 70, 70, 16)
    clean, _ = _forward(xp, q, k, v, Context(check="off"), causal=True)
    fault = _fault(site, "additive", 1e3)
    ctx = Context(check="off", fault_hook=fault)
    got, _ = _forward(xp, q, k, v, ctx, causal=True)
    assert fault.hits == 1 and not ctx.report.events
    assert not np.array_equal(got, clean)


@pytest.mark.parametrize("xp", CUDA)
def test_detect_mode_reports_and_leaves_the_fault(xp):
    q, k, v, _ = _data(np.random.default_rng(4), 2, 64, 64, 16)
    clean, _ = _forward(xp, q, k, v, Context())
    ctx = Context(check="detect", fault_hook=_fault("fused:O_acc", "near-inf", 0.0))
    with pytest.warns(Warning, match="fused:O_acc"):
        got, _ = _forward(xp, q, k, v, ctx)
    assert [e.action for e in ctx.report.events] == ["reported"]
    assert not np.array_equal(got, clean)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site", ["fused:S", "fused:P", "fused:O_acc"])
def test_persistent_fault_raises(xp, site):
    q, k, v, _ = _data(np.random.default_rng(5), 2, 64, 64, 16)
    ctx = Context(fault_hook=_fault(site, "inf", 0.0, persistent=True))
    with pytest.raises(UncorrectableError, match=site):
        _forward(xp, q, k, v, ctx)


@pytest.mark.parametrize("xp", CUDA)
def test_located_element_of_a_score_fault(xp):
    from attention._cuda_fused import DeviceFault

    q, k, v, _ = _data(np.random.default_rng(6), 1, 50, 50, 16)
    ctx = Context(fault_hook=DeviceFault("fused:S", 37, 7, kind="additive", value=100.0))
    _forward(xp, q, k, v, ctx)
    (event,) = ctx.report.events
    assert (event.pattern, event.rows, event.cols) == ("0D", (37,), (7,))


@pytest.mark.parametrize("xp", CUDA)
def test_no_false_positive_on_adversarial_clean_data(xp):
    """Logits near float32 overflow of exp (and far beyond), constant rows, rows that see one key
    or none, causal and not: 24 calls, no event."""
    rng = np.random.default_rng(7)
    for call in range(24):
        n, lq, d = 2, int(rng.integers(1, 70)), int(rng.choice([8, 16, 32]))
        causal = bool(call % 2)
        lk = lq if causal else int(rng.integers(1, 70))
        spread = float(10.0 ** rng.uniform(0, 15)) if call % 3 else 1.0
        q, k, v, _ = _data(rng, n, lq, lk, d, spread=math.sqrt(spread))
        if call % 5 == 0:
            k[:] = k[:, :1]  # identical keys: flat rows
        visible = None
        if call % 4 == 0:
            visible = rng.random((n, lk)) < 0.3
            visible[0] = False
        ctx = Context()
        out, _ = _forward(xp, q, k, v, ctx, causal=causal, key_visible=visible)
        assert not ctx.report.events, (call, ctx.report.summary())
        assert np.isfinite(out).all()


@pytest.mark.parametrize("xp", CUDA)
def test_bad_input(xp):
    q, k, v, _ = _data(np.random.default_rng(0), 1, 8, 8, 8)
    dq, dk, dv = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    with pytest.raises(TypeError, match="float16, bfloat16"):
        fused_forward(xp.asarray(q.astype(np.int32)), dk, dv, Context())
    with pytest.raises(ValueError, match="causal"):
        fused_forward(dq, xp.asarray(k[:, :4]), xp.asarray(v[:, :4]), Context(), causal=True)
    with pytest.raises(ValueError, match="head dims"):
        big = xp.asarray(np.zeros((1, 4, 160), np.float32))
        fused_forward(big, big, big, Context())
    bad = q.copy()
    bad[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="INF or NaN"):
        fused_forward(xp.asarray(bad), dk, dv, Context())
    with pytest.raises(ValueError, match="key_visible"):
        fused_forward(dq, dk, dv, Context(), key_visible=xp.ones((1, 8)))
    with pytest.raises(TypeError, match="DeviceFault"):
        fused_forward(dq, dk, dv, Context(fault_hook=lambda site, tile: None))
    _, saved = fused_forward(dq, dk, dv, Context())
    with pytest.raises(NotImplementedError, match="backward"):
        fused_backward(saved, dq, Context())
