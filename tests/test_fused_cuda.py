"""The fused protected attention core's CUDA kernels (attention/_cuda_fused.py, kernels/fused.cu)
on CuPy, or on cupy-on-cpu without a GPU: test_fused.py's float64 reference and data, every
internal site (forward and backward) faulted by the kernels' own injector, clean adversarial
data, 16-bit dtypes, bad input. Shapes stay small: the emulation runs every CUDA thread on the
CPU."""
from __future__ import annotations

import math
from functools import partial

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from abftgemm import UncorrectableError
from abftgemm.checksums import unit_roundoff
from attention.context import Context
from attention.fused import fused_backward, fused_forward
from conftest import BACKENDS
from test_fused import _data, _reference, additive_mask, assert_clean_call

CUDA = [p for p in BACKENDS if p.id != "numpy"]
KINDS = [("inf", 0.0), ("nan", 0.0), ("near-inf", 0.0), ("additive", 1e3)]
#: An element of each site in the second query block and second key tile (32 x 32 tiles) of head
#: 1, causal-visible; accumulators hit after their first tile.
ELEMENTS = {"fused:S": (40, 35), "fused:P": (41, 33), "fused:O_acc": (45, 3),
            "fused:rowsum": (50, 0), "fused:dP": (40, 35), "fused:dS": (41, 33),
            "fused:dQ_acc": (45, 3), "fused:dK_acc": (35, 3), "fused:dV_acc": (36, 5)}
#: (site, the call whose kernels take the fault): S and P are recomputed in the backward too.
CASES = [(s, "forward") for s in ("fused:S", "fused:P", "fused:O_acc", "fused:rowsum")] + [
    (s, "backward") for s in ("fused:S", "fused:P", "fused:dP", "fused:dS", "fused:dQ_acc",
                              "fused:dK_acc", "fused:dV_acc")]
IDS = [f"{s}-{phase}" for s, phase in CASES]


def _forward(xp, q, k, v, ctx, **kw):
    out, saved = fused_forward(xp.asarray(q), xp.asarray(k), xp.asarray(v), ctx, **kw)
    return out.get(), saved


def _run(xp, q, k, v, do, ctx, backward_ctx=None, **kw):
    """Output and gradients (NumPy); ``backward_ctx`` (default ``ctx``) for the backward."""
    out, saved = _forward(xp, q, k, v, ctx, **kw)
    grads = fused_backward(saved, xp.asarray(do), ctx if backward_ctx is None else backward_ctx)
    return [out] + [g.get() for g in grads]


def _fault(site, kind, value, persistent=False):
    from attention._cuda_fused import DeviceFault

    row, col = ELEMENTS[site]
    return DeviceFault(site, row, col, head=1, kind=kind, value=value, persistent=persistent)


def _faulted_run(xp, q, k, v, do, site, phase, fault, check="correct"):
    """One fwd+bwd whose ``phase`` call carries ``fault``; the context(s) that saw it."""
    ctx, clean = Context(check=check, fault_hook=fault), Context(check=check)
    if phase == "forward":
        return _run(xp, q, k, v, do, ctx, clean, causal=True), ctx
    return _run(xp, q, k, v, do, clean, ctx, causal=True), ctx


@pytest.mark.parametrize("xp", CUDA)
@given(n=st.integers(1, 2), lq=st.integers(1, 70), lk=st.integers(1, 70),
       d=st.sampled_from([8, 16, 32]), causal=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**31))
def test_forward_matches_float64_reference(xp, n, lq, lk, d, causal, dtype, seed):
    if causal:
        lk = lq
    q, k, v, do = _data(np.random.default_rng(seed), n, lq, lk, d, dtype)
    ctx = Context()
    got = _run(xp, q, k, v, do, ctx, causal=causal)
    assert not ctx.report.events, ctx.report.summary()
    want, tol = _reference(q, k, v, do, 1 / math.sqrt(d), causal)
    for name, g, w, t in zip(("out", "dq", "dk", "dv"), got, want, tol):
        assert g.dtype == dtype
        if dtype == np.float64:
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12, err_msg=name)
        else:
            assert np.all(np.abs(g - w) <= t), (name, np.max(np.abs(g - w) / t))


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_data(xp, dtype):
    """Tile arithmetic in float32, each result rounded once to the data's dtype; the output, and
    through it D = rowsum(dO O), carry the data's rounding: the float32 bounds of the reference
    with the data's unit roundoff."""
    q, k, v, do = _data(np.random.default_rng(3), 2, 50, 70, 32, dtype)
    ctx = Context()
    out, saved = _forward(xp, q, k, v, ctx, causal=False)
    assert saved["lse"].dtype == np.float32
    got = [out] + [g.get() for g in fused_backward(saved, xp.asarray(do), ctx)]
    assert not ctx.report.events, ctx.report.summary()
    want, tol = _reference(q, k, v, do, 1 / math.sqrt(32), False)
    grow = unit_roundoff(dtype) / unit_roundoff(np.float32)
    for name, g, w, t in zip(("out", "dq", "dk", "dv"), got, want, tol):
        assert g.dtype == dtype
        err = np.abs(g.astype(np.float64) - w)
        assert np.all(err <= grow * t), (name, np.max(err / t))


@pytest.mark.parametrize("xp", CUDA)
def test_key_visible_and_fully_masked_rows(xp):
    rng = np.random.default_rng(1)
    q, k, v, do = _data(rng, 2, 40, 70, 16)
    visible = rng.random((2, 70)) < 0.5
    visible[1] = False  # head 1 sees no key at all: output 0, log-sum-exp -inf
    ctx = Context()
    out, saved = _forward(xp, q, k, v, ctx, key_visible=visible)
    assert np.all(saved["lse"].get()[1] == -np.inf)
    got = [out] + [g.get() for g in fused_backward(saved, xp.asarray(do), ctx)]
    assert not ctx.report.events
    want, tol = _reference(q, k, v, do, 0.25, False, visible)
    for g, w, t in zip(got, want, tol):
        assert np.all(np.abs(g - w) <= t)
    assert all(not g[1].any() for g in got)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site,phase", [("fused:S", "forward"), ("fused:P", "forward"),
                                        ("fused:P", "backward"), ("fused:dS", "backward"),
                                        ("fused:dQ_acc", "backward")])
@pytest.mark.parametrize("masks", ["attn_mask", "attn_mask+key_add"])
def test_fault_under_an_additive_mask_is_corrected(xp, site, phase, masks):
    rng = np.random.default_rng(12)
    q, k, v, do = _data(rng, 2, 70, 70, 16)
    kw = {"causal": True, "attn_mask": xp.asarray(additive_mask(rng, (2, 70, 70)))}
    if masks == "attn_mask+key_add":
        kw["key_add"] = xp.asarray(additive_mask(rng, (1, 70), hidden=0.1))
    clean = _run(xp, q, k, v, do, Context(), **kw)
    fault = _fault(site, "near-inf", 0.0)
    ctx, quiet = Context(fault_hook=fault), Context()
    first, second = (ctx, quiet) if phase == "forward" else (quiet, ctx)
    got = _run(xp, q, k, v, do, first, second, **kw)
    assert fault.hits == 1 and site in ctx.report.sites, ctx.report.summary()
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


@pytest.mark.parametrize("xp", CUDA)
def test_bad_additive_mask(xp):
    q, k, v, _ = (xp.asarray(t) for t in _data(np.random.default_rng(0), 2, 8, 6, 8))
    for bad, match in ((np.zeros((2, 6, 8)), "shape"), (np.full((8, 6), np.nan), "NaN"),
                       (np.full((8, 6), 1e300), "largest"), (np.zeros((8, 6), bool), "float")):
        with pytest.raises((TypeError, ValueError), match=match):
            fused_forward(q, k, v, Context(), attn_mask=xp.asarray(bad))


@pytest.mark.parametrize("xp", CUDA)
def test_bad_per_key_mask(xp):
    q, k, v, _ = (xp.asarray(t) for t in _data(np.random.default_rng(0), 2, 8, 6, 8))
    for bad, match in ((np.zeros((3, 6)), "m dividing"), (np.full((2, 6), np.nan), "NaN"),
                       (np.full((1, 6), 1e300), "largest"), (np.zeros((2, 6), bool), "float")):
        with pytest.raises((TypeError, ValueError), match=match):
            fused_forward(q, k, v, Context(), key_add=xp.asarray(bad))
    big = np.full((1, 6), 0.75 * float(np.finfo(np.float32).max))
    with pytest.raises(ValueError, match="largest"):  # each in range, their sum beyond
        fused_forward(q, k, v, Context(), attn_mask=xp.asarray(np.tile(big, (8, 1))),
                      key_add=xp.asarray(big))


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site,phase", CASES, ids=IDS)
@pytest.mark.parametrize("kind,value", KINDS, ids=[k for k, _ in KINDS])
def test_fault_at_internal_site_is_detected_and_corrected(xp, site, phase, kind, value):
    q, k, v, do = _data(np.random.default_rng(2), 2, 70, 70, 16)
    clean = _run(xp, q, k, v, do, Context(), causal=True)
    fault = _fault(site, kind, value)
    got, ctx = _faulted_run(xp, q, k, v, do, site, phase, fault)
    assert fault.hits == 1
    assert site in ctx.report.sites, ctx.report.summary()
    assert all(e.action == "recomputed" for e in ctx.report.events)
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("site,phase", [("fused:S", "forward"), ("fused:O_acc", "forward"),
                                        ("fused:dP", "backward"), ("fused:dK_acc", "backward")])
def test_fault_in_16_bit_data_is_corrected(xp, dtype, site, phase):
    """The tensor-core tile products (head dim 32) and the float32 accumulators of 16-bit data."""
    q, k, v, do = _data(np.random.default_rng(2), 2, 70, 70, 32, dtype)
    clean = _run(xp, q, k, v, do, Context(), causal=True)
    fault = _fault(site, "near-inf", 0.0)
    got, ctx = _faulted_run(xp, q, k, v, do, site, phase, fault)
    assert fault.hits == 1 and site in ctx.report.sites, ctx.report.summary()
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("bit", [18, 21])
def test_mid_size_output_fault_in_16_bit_data_is_corrected(xp, dtype, bit):
    """A mantissa bit of the float32 output accumulator of 16-bit data (a change of 3% to
    25%): the forward kernel judged the output after rounding it to 16 bits, with 16-bit
    thresholds, and passed such faults (the output off by 13%); the CPU kernels judge it in
    float32, as the kernel now does."""
    from attention._cuda_fused import DeviceFault

    q, k, v, do = _data(np.random.default_rng(2), 2, 70, 70, 32, dtype)
    clean = _run(xp, q, k, v, do, Context(), causal=True)
    row, col = ELEMENTS["fused:O_acc"]
    fault = DeviceFault("fused:O_acc", row, col, head=1, kind="bitflip", bit=bit)
    got, ctx = _faulted_run(xp, q, k, v, do, "fused:O_acc", "forward", fault)
    assert fault.hits == 1 and "fused:O_acc" in ctx.report.sites, ctx.report.summary()
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site,phase", CASES, ids=IDS)
def test_check_off_shows_the_damage(xp, site, phase):
    q, k, v, do = _data(np.random.default_rng(2), 2, 70, 70, 16)
    clean = _run(xp, q, k, v, do, Context(check="off"), causal=True)
    fault = _fault(site, "additive", 1e3)
    got, ctx = _faulted_run(xp, q, k, v, do, site, phase, fault, check="off")
    assert fault.hits == 1 and not ctx.report.events
    assert any(not np.array_equal(g, c) for g, c in zip(got, clean))


@pytest.mark.parametrize("xp", CUDA)
def test_detect_mode_reports_and_leaves_the_fault(xp):
    q, k, v, do = _data(np.random.default_rng(4), 2, 64, 64, 16)
    clean = _run(xp, q, k, v, do, Context())
    ctx = Context(check="detect", fault_hook=_fault("fused:dK_acc", "near-inf", 0.0))
    with pytest.warns(Warning, match="fused:dK_acc"):
        got = _run(xp, q, k, v, do, ctx)
    assert [e.action for e in ctx.report.events] == ["reported"]
    assert not np.array_equal(got[2], clean[2])


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site", ["fused:S", "fused:O_acc", "fused:dS", "fused:dK_acc",
                                  "fused:dQ_acc"])
def test_persistent_fault_raises(xp, site):
    q, k, v, do = _data(np.random.default_rng(5), 2, 64, 64, 16)
    ctx = Context(fault_hook=_fault(site, "inf", 0.0, persistent=True))
    with pytest.raises(UncorrectableError, match=site):
        _run(xp, q, k, v, do, ctx)


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
        assert_clean_call(partial(_run, xp), rng, call, 70, [8, 16, 32], np.float32,
                          lambda: math.sqrt(float(10.0 ** rng.uniform(0, 15)) if call % 3
                                            else 1.0))


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_no_false_positive_on_adversarial_16_bit_data(xp, dtype):
    """Wide logits (scores up to ~10^6 in float32), flat rows, rows without a key, in 16-bit data
    whose tile products run on tensor cores (head dims 16 and 32): 12 calls, no event."""
    rng = np.random.default_rng(8)
    for call in range(12):
        assert_clean_call(partial(_run, xp), rng, call, 70, [16, 32], dtype,
                          lambda: float(10.0 ** rng.uniform(0, 2)))


@pytest.mark.parametrize("xp", BACKENDS)
def test_no_false_positive_where_ds_underflows(xp):
    """Probabilities just above float32's smallest normal number (logits 87 below each row's
    top, from an additive mask) times ``dP - D = 0.5``: ``dS`` entries of one sign below the
    smallest normal, which the GPU flushes to 0 (CuPy compiles with ``-ftz=true``;
    ``cupy-on-cpu`` flushes as the GPU does), each off by up to that number. In a tile of keys
    that holds no row's top (keys 32-63 here), those entries are all the tile's row has: the
    ``dS`` invariants allow that number per entry, not once a row."""
    n, seq, d = 2, 64, 16
    q, v, do = (np.zeros((n, seq, d), np.float32) for _ in range(3))
    do[..., 0] = 1.0
    v[:, 0, 0] = -0.5  # dP = -0.5 at key 0 (P ~ 1), 0 elsewhere; D = -0.5
    add = -87.0 + 0.005 * np.arange(seq) + np.zeros((seq, 1))
    add[:, 0] = 0.0
    p = np.exp(add - np.log(np.exp(add).sum(1, keepdims=True)))  # float64: the set-up holds
    tiny = np.finfo(np.float32).tiny
    assert (p[:, 1:] > tiny).all() and (0.5 * p[:, 1:] < tiny).all()
    ctx = Context()
    _, saved = fused_forward(xp.asarray(q), xp.asarray(q), xp.asarray(v), ctx,
                             attn_mask=xp.asarray(add))
    fused_backward(saved, xp.asarray(do), ctx)
    assert not ctx.report.events, ctx.report.summary()


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
    out, saved = fused_forward(dq, dk, dv, Context())
    with pytest.raises(ValueError, match="d_out"):
        fused_backward(saved, out[:, :4], Context())
    with pytest.raises(ValueError, match="d_out"):
        fused_backward(saved, q, Context())


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", ["forward", "backward"])
def test_one_dominant_key_is_not_flagged(xp, dtype, case):
    """One key dominant by a logit gap of 24 ln 2 (the others' probabilities about ``2**-24``),
    ``V`` and ``dO`` all ones: summed into the running accumulator key by key (query by query
    for dV), every later addend was lost to ties to even, an error near ``L u``, over the
    statistical ``KAPPA sqrt(L) u`` plus the tiles' roundings: ``fused:O_acc`` (forward) and
    ``fused:dV_acc`` (backward, key 0 taking query 0's probability and ``2**-24`` of every
    other query's) flagged clean calls at L = 512 (2.4 of their thresholds) and
    ``check="correct"`` raised. Each tile's product is now summed on its own and added once,
    the rounding the thresholds model (test_fused.py's CPU test of the same data)."""
    import warnings

    from attention.fused_final import verify_grads, verify_output

    d, length = 16, 512
    if case == "forward":
        q = np.ones((1, length, d), dtype)
        k = np.zeros((1, length, d), dtype)
        k[0, 0, :] = 16.6355 / d
    else:
        q = np.zeros((1, length, d), dtype)
        k = np.zeros((1, 64, d), dtype)
        k[0, 1:, 0] = 1.0
        q[0, 0, 0] = -30.0
        q[0, 1:, 0] = math.log((2.0**24 - 1) / 63)
    v = np.ones(k.shape, dtype)
    do = np.ones(q.shape, dtype)
    for check in ("detect", "correct"):
        ctx = Context(check=check)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, saved = verify_output(*fused_forward(xp.asarray(q), xp.asarray(k),
                                                      xp.asarray(v), ctx, scale=1.0), ctx)
            verify_grads(saved, xp.asarray(do), fused_backward(saved, xp.asarray(do), ctx), ctx)
        assert not ctx.report.events, ctx.report.summary()
