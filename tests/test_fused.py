"""The fused protected attention core (attention/fused.py): float64 reference math, every internal
site faulted, clean adversarial data, O(L) memory, bad input."""
from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from abftgemm import UncorrectableError
from abftgemm.backend import to_host
from abftgemm.checksums import unit_roundoff
from abftgemm.faults import Fault
from abftgemm.thresholds import KAPPA
from attention.context import Context
from attention.fused import BACKWARD_SITES, FORWARD_SITES, fused_backward, fused_forward
from attention.fused_final import FINAL_SITES, verify_grads, verify_output
from conftest import BACKENDS

KERNEL_SITES = ("fused:S", "fused:P", "fused:O_acc", "fused:rowsum", "fused:dP", "fused:dS",
                "fused:dQ_acc", "fused:dK_acc", "fused:dV_acc")
HOOK_SITES = KERNEL_SITES + ("fused:out", "fused:dV_out", "fused:dK_out")
KINDS = [("inf", {}), ("nan", {}), ("near-inf", {}), ("additive", {"magnitude": 1e3})]


def _reference(q, k, v, do, scale, causal, visible=None, add=None):
    """Float64 forward and gradients, and the magnitudes their rounding scales with; ``add`` an
    additive mask broadcastable to the scores (``-inf``: not allowed)."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    s = scale * q @ k.transpose(0, 2, 1)
    mask = np.ones(s.shape, bool)
    if causal:
        mask &= np.tril(np.ones(s.shape[1:], bool))
    if visible is not None:
        mask &= visible[:, None, :]
    if add is not None:
        mask &= np.broadcast_to(add > -np.inf, s.shape)
        s = s + np.where(np.isfinite(add), add, 0)
    z = np.where(mask, s, -np.inf)
    top = z.max(-1, keepdims=True)
    e = np.where(mask, np.exp(z - np.where(np.isfinite(top), top, 0)), 0)
    den = e.sum(-1, keepdims=True)
    p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    out = p @ v
    dp = do @ v.transpose(0, 2, 1)
    dd = (do * out).sum(-1, keepdims=True)
    ds = p * (dp - dd)
    grads = (scale * ds @ k, scale * ds.transpose(0, 2, 1) @ q, p.transpose(0, 2, 1) @ do)
    # Error of a score: the float32 product of length d and the scaling; of P relative: twice
    # the worst score error of its row plus the exponential's and the sum's rounding.
    u = unit_roundoff(np.float32)
    lk, d = k.shape[1], q.shape[2]
    z_err = scale * (KAPPA * math.sqrt(d) + 2) * u * (np.abs(q) @ np.abs(k).transpose(0, 2, 1))
    if add is not None:  # the mask's addition, rounded to float32
        z_err = z_err + u * np.abs(np.where(mask, s, 0))
    p_rel = 2 * np.where(mask, z_err, 0).max(-1, keepdims=True) + (KAPPA * math.sqrt(lk) + 8) * u
    acc = (KAPPA * math.sqrt(max(q.shape[1], lk)) + 2 * (lk // 64 + 2)) * u
    # dP's rounding scales with |dO| |V|^T (as the scores' with |Q| |K|^T), not with |dP|.
    mag_ds = p * (np.abs(do) @ np.abs(v).transpose(0, 2, 1) + np.abs(dd))
    mags = (p @ np.abs(v),
            scale * mag_ds @ np.abs(k), scale * mag_ds.transpose(0, 2, 1) @ np.abs(q),
            p.transpose(0, 2, 1) @ np.abs(do))
    worst = p_rel.max()  # the key-side gradients sum over queries
    rels = (p_rel + acc, 4 * p_rel + acc, 4 * worst + acc, worst + acc)
    return (out,) + grads, tuple(r * m + 1e-30 for r, m in zip(rels, mags))


def _data(rng, n, lq, lk, d, dtype=np.float32, spread=1.0):
    q = (spread * rng.standard_normal((n, lq, d))).astype(dtype)
    k = (spread * rng.standard_normal((n, lk, d))).astype(dtype)
    v = rng.standard_normal((n, lk, d)).astype(dtype)
    do = rng.standard_normal((n, lq, d)).astype(dtype)
    return q, k, v, do


def _run(q, k, v, do, ctx, **kw):
    """Forward and backward, each followed by its final check (attention/fused_final.py)."""
    out, saved = fused_forward(q, k, v, ctx, **kw)
    out, saved = verify_output(out, saved, ctx)
    return (out,) + verify_grads(saved, do, fused_backward(saved, do, ctx), ctx)


@given(n=st.integers(1, 3), lq=st.integers(1, 150), lk=st.integers(1, 150),
       d=st.sampled_from([8, 16, 24, 32, 64]), causal=st.booleans(), seed=st.integers(0, 2**31))
def test_matches_float64_reference(n, lq, lk, d, causal, seed):
    if causal:
        lk = lq
    q, k, v, do = _data(np.random.default_rng(seed), n, lq, lk, d)
    ctx = Context()
    got = _run(q, k, v, do, ctx, causal=causal)
    assert not ctx.report.events, ctx.report.summary()
    want, tol = _reference(q, k, v, do, 1 / math.sqrt(d), causal)
    for name, g, w, t in zip(("out", "dq", "dk", "dv"), got, want, tol):
        assert np.all(np.abs(g - w) <= t), (name, np.max(np.abs(g - w) / t))


def test_key_visible_and_fully_masked_rows():
    rng = np.random.default_rng(1)
    q, k, v, do = _data(rng, 2, 70, 90, 16)
    visible = rng.random((2, 90)) < 0.5
    visible[1] = False  # head 1 sees no key at all: output and gradients 0
    ctx = Context()
    got = _run(q, k, v, do, ctx, key_visible=visible)
    assert not ctx.report.events
    want, tol = _reference(q, k, v, do, 0.25, False, visible)
    for g, w, t in zip(got, want, tol):
        assert np.all(np.abs(g - w) <= t)
    assert all(not g[1].any() for g in got)


def additive_mask(rng, shape, spread=3.0, hidden=0.3):
    """A float64 additive mask: normal values times ``spread``, ``-inf`` with probability
    ``hidden``."""
    add = spread * rng.standard_normal(shape)
    add[rng.random(shape) < hidden] = -np.inf
    return add


def adversarial_calls(rng, calls, max_len, dims, dtype, dropouts):
    """``(call, q, k, v, do, kw)`` of ``calls`` clean calls on adversarial data: scores up to
    ~80, identical keys (flat rows), key padding with a head that sees no key, additive masks
    with a fully masked query row, causal and not, dropout ``p`` drawn from ``dropouts``."""
    for call in range(calls):
        n, lq, d = 2, int(rng.integers(1, max_len)), int(rng.choice(dims))
        causal = bool(call % 2)
        lk = lq if causal else int(rng.integers(1, max_len))
        spread = float(10.0 ** rng.uniform(0, 2)) if call % 3 else 1.0
        q, k, v, do = _data(rng, n, lq, lk, d, dtype, spread=math.sqrt(spread))
        kw = {"causal": causal}
        if call % 5 == 0:
            k[:] = k[:, :1]
        if call % 4 == 0:
            visible = rng.random((n, lk)) < 0.3
            visible[0] = False
            kw["key_visible"] = visible
        if call % 3 == 2:
            add = additive_mask(rng, (n, lq, lk), spread=10.0)
            add[:, lq // 2] = -np.inf
            kw["attn_mask"] = add
        if call % 4 == 1:
            kw.update(dropout=float(rng.choice(dropouts)), dropout_seed=call)
        yield call, q, k, v, do, kw


@pytest.mark.parametrize("xp", BACKENDS)
@given(data=st.data(), causal=st.booleans(), shared=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**31))
def test_additive_mask_matches_float64_reference(xp, data, causal, shared, dtype, seed):
    """Float masks added to the scaled scores, ``-inf`` allowed, one per head or shared (2-D),
    with causality; a fully masked query row gets output and gradients 0. The CUDA kernels
    (CuPy, or cupy-on-cpu, which runs every CUDA thread on the CPU) get smaller shapes."""
    small = xp is not np
    n = data.draw(st.integers(1, 2 if small else 3), label="n")
    lq = data.draw(st.integers(1, 70 if small else 150), label="lq")
    lk = lq if causal else data.draw(st.integers(1, 70 if small else 150), label="lk")
    d = data.draw(st.sampled_from([8, 16] if small else [8, 16, 64]), label="d")
    rng = np.random.default_rng(seed)
    q, k, v, do = _data(rng, n, lq, lk, d, dtype)
    add = additive_mask(rng, (lq, lk) if shared else (n, lq, lk))
    add[..., lq // 2, :] = -np.inf  # a query row that sees no key
    ctx = Context()
    got = _run(*(xp.asarray(t) for t in (q, k, v, do)), ctx, causal=causal,
               attn_mask=xp.asarray(add))
    got = [to_host(g) for g in got]
    assert not ctx.report.events, ctx.report.summary()
    want, tol = _reference(q, k, v, do, 1 / math.sqrt(d), causal, add=add)
    for name, g, w, t in zip(("out", "dq", "dk", "dv"), got, want, tol):
        if dtype == np.float64:
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=name)
        else:
            assert np.all(np.abs(g - w) <= t), (name, np.max(np.abs(g - w) / t))
    assert not got[0][:, lq // 2].any() and not got[1][:, lq // 2].any()


def test_additive_mask_with_key_visible_and_wide_values():
    """An additive mask with key padding, values up to 1e4 (rows dominated by the mask) and
    -1e300, which is -inf once rounded to float32 as the unfused softmax rounds it."""
    rng = np.random.default_rng(11)
    q, k, v, do = _data(rng, 2, 90, 80, 16)
    add = additive_mask(rng, (2, 90, 80), spread=1e4, hidden=0.2)
    add[0, :, 3] = -1e300
    visible = rng.random((2, 80)) < 0.8
    ctx = Context()
    got = _run(q, k, v, do, ctx, key_visible=visible, attn_mask=add)
    assert not ctx.report.events, ctx.report.summary()
    want, tol = _reference(q, k, v, do, 0.25, False, visible, np.where(add < -1e300 / 2, -np.inf,
                                                                        add))
    for g, w, t in zip(got, want, tol):
        assert np.all(np.abs(g - w) <= t), np.max(np.abs(g - w) / t)


def folded(add, keys, n, lq):
    """``add`` (None: 0; broadcastable to ``(n, lq, lk)``) plus the per-key mask ``keys``
    ``(batch, lk)`` on every query row of each item's ``n / batch`` heads: float64 ``(n, lq,
    lk)``, summed as PyTorch merges ``attn_mask`` and a float ``key_padding_mask``."""
    batch, lk = keys.shape
    out = np.zeros((n, lq, lk))
    if add is not None:
        out += add
    out.reshape(batch, -1, lq, lk)[...] += keys[:, None, None, :]
    return out


@pytest.mark.parametrize("xp", BACKENDS)
@given(data=st.data(), causal=st.booleans(), attn=st.sampled_from(["none", "shared", "per-head"]),
       visible=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2**31))
def test_per_key_mask_equals_its_folded_mask(xp, data, causal, attn, visible, dtype, seed):
    """A per-key mask ``key_add`` ``(batch, lk)``, shared by each batch item's heads (``-inf``
    allowed, a key hidden from every query of a head), beside ``attn_mask`` (none, 2-D or
    per head), ``key_visible`` and causality: outputs and gradients equal bit for bit those of
    one ``attn_mask`` folded from both in float64, the kernels adding ``attn_mask + key_add``
    summed first (CPU kernels, and the CUDA kernels on cupy-on-cpu)."""
    small = xp is not np
    batch = data.draw(st.integers(1, 2), label="batch")
    heads = data.draw(st.integers(1, 2 if small else 3), label="heads")
    lq = data.draw(st.integers(1, 40 if small else 150), label="lq")
    lk = lq if causal else data.draw(st.integers(1, 40 if small else 150), label="lk")
    d = data.draw(st.sampled_from([8, 16] if small else [8, 16, 64]), label="d")
    rng = np.random.default_rng(seed)
    n = batch * heads
    q, k, v, do = _data(rng, n, lq, lk, d, dtype)
    keys = additive_mask(rng, (batch, lk), spread=5.0)
    add = {"none": None, "shared": additive_mask(rng, (lq, lk)),
           "per-head": additive_mask(rng, (n, lq, lk))}[attn]
    kw = {"causal": causal}
    if visible:
        kw["key_visible"] = xp.asarray(rng.random((n, lk)) < 0.8)
    ins = [xp.asarray(t) for t in (q, k, v, do)]
    ctx, ctx_folded = Context(), Context()
    got = _run(*ins, ctx, attn_mask=None if add is None else xp.asarray(add),
               key_add=xp.asarray(keys), **kw)
    want = _run(*ins, ctx_folded, attn_mask=xp.asarray(folded(add, keys, n, lq)), **kw)
    assert not ctx.report.events and not ctx_folded.report.events, ctx.report.summary()
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(to_host(g), to_host(w), err_msg=name)


def test_bad_per_key_mask():
    q, k, v, _ = _data(np.random.default_rng(0), 4, 8, 6, 8)
    top = float(np.finfo(np.float32).max)
    for bad, match in ((np.zeros((3, 6)), "m dividing"), (np.zeros((2, 7)), "shape"),
                       (np.zeros((2, 6), bool), "float"), ([[0.0] * 6] * 2, "numpy array"),
                       (np.full((2, 6), np.nan), "NaN"), (np.full((2, 6), np.inf), "\\+inf"),
                       (np.full((2, 6), 1e300), "largest")):
        with pytest.raises((TypeError, ValueError), match=match):
            fused_forward(q, k, v, Context(), key_add=bad)
    # each within the float32 range, their sum (what the kernels add) beyond it
    add = np.zeros((8, 6))
    add[3, 2] = 0.75 * top
    keys = np.zeros((2, 6))
    keys[1, 2] = 0.75 * top
    fused_forward(q, k, v, Context(), attn_mask=add, key_add=keys[::-1].copy() * 0.3)
    with pytest.raises(ValueError, match="largest"):
        fused_forward(q, k, v, Context(), attn_mask=add, key_add=keys)


@pytest.mark.parametrize("masks", ["attn_mask", "attn_mask+key_add"])
@pytest.mark.parametrize("site", HOOK_SITES)
def test_fault_under_an_additive_mask_is_corrected(site, masks):
    rng = np.random.default_rng(12)
    q, k, v, do = _data(rng, 2, 130, 130, 32)
    kw = {"causal": True, "attn_mask": additive_mask(rng, (130, 130))}
    if masks == "attn_mask+key_add":
        kw["key_add"] = additive_mask(rng, (1, 130), hidden=0.1)
    clean = _run(q, k, v, do, Context(), **kw)
    fault = Fault("near-inf", "element", seed=3, sites=site)
    ctx = Context(fault_hook=fault)
    got = _run(q, k, v, do, ctx, **kw)
    assert fault.injected and site in ctx.report.sites, ctx.report.summary()
    assert all(e.action == "recomputed" for e in ctx.report.events)
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


def test_bad_additive_mask():
    q, k, v, _ = _data(np.random.default_rng(0), 2, 8, 6, 8)
    for bad, match in ((np.zeros((2, 6, 8)), "shape"), (np.zeros((3, 8, 6)), "shape"),
                       (np.zeros((8, 6), bool), "float"), ([[0.0] * 6] * 8, "numpy array"),
                       (np.full((8, 6), np.nan), "NaN"), (np.full((8, 6), np.inf), "\\+inf"),
                       (np.full((8, 6), 1e300), "largest")):
        with pytest.raises((TypeError, ValueError), match=match):
            fused_forward(q, k, v, Context(), attn_mask=bad)


@pytest.mark.parametrize("site", HOOK_SITES)
@pytest.mark.parametrize("kind,extra", KINDS, ids=[k for k, _ in KINDS])
def test_fault_at_internal_site_is_detected_and_corrected(site, kind, extra):
    q, k, v, do = _data(np.random.default_rng(2), 2, 130, 130, 32)
    assert_corrected(q, k, v, do, Fault(kind, "element", seed=3, sites=site, **extra), site)


def assert_corrected(q, k, v, do, fault, site):
    """``fault`` in a causal forward+backward is found at ``site``, every finding is repaired by
    recomputation, and the results equal the fault-free run's bit for bit."""
    clean = _run(q, k, v, do, Context(), causal=True)
    ctx = Context(fault_hook=fault)
    got = _run(q, k, v, do, ctx, causal=True)
    assert fault.injected and any(fault.injected[0].changed)
    assert site in ctx.report.sites, ctx.report.summary()
    assert all(e.action == "recomputed" for e in ctx.report.events)
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


@pytest.mark.parametrize("site", HOOK_SITES)
def test_check_off_shows_the_damage(site):
    q, k, v, do = _data(np.random.default_rng(2), 2, 130, 130, 32)
    clean = _run(q, k, v, do, Context(check="off"), causal=True)
    ctx = Context(check="off", fault_hook=Fault("additive", "element", seed=3, sites=site,
                                                magnitude=1e3))
    got = _run(q, k, v, do, ctx, causal=True)
    assert not ctx.report.events
    assert any(not np.array_equal(g, c) for g, c in zip(got, clean))


def test_detect_mode_reports_and_leaves_the_fault():
    q, k, v, do = _data(np.random.default_rng(4), 1, 64, 64, 16)
    clean = _run(q, k, v, do, Context())
    ctx = Context(check="detect", fault_hook=Fault("near-inf", "element", seed=0,
                                                   sites="fused:O_acc"))
    with pytest.warns(Warning, match="fused:O_acc"), pytest.warns(Warning, match="fused:out"), \
            pytest.warns(Warning, match="fused:dK_out"):
        got = _run(q, k, v, do, ctx)
    # the output left in place fails the final check too, and so does dK, whose rows of dS no
    # longer sum to 0 with D = rowsum(dO O) read from that output
    assert [(e.site, e.action) for e in ctx.report.events] == [("fused:O_acc", "reported"),
                                                               ("fused:out", "reported"),
                                                               ("fused:dK_out", "reported")]
    assert not np.array_equal(got[0], clean[0])


@pytest.mark.parametrize("site", ["fused:S", "fused:dS", "fused:dK_acc"])
def test_persistent_fault_raises(site):
    q, k, v, do = _data(np.random.default_rng(5), 1, 80, 80, 16)
    ctx = Context(fault_hook=Fault("inf", "element", seed=0, sites=site, times=None))
    with pytest.raises(UncorrectableError, match=site):
        _run(q, k, v, do, ctx)


def test_an_overflow_in_the_tiles_raises_saying_so():
    """An overflow inside the float32 tiles raises UncorrectableError, saying so (README): with
    V and dO of 1e20 (finite float32 data) the backward's ``dP = dO V^T`` passes float32's
    largest number, the ``dS`` check flags INF, and its recomputation is INF again. The error
    said only that a recomputed tile could not be verified, as for a persistent fault."""
    q, k, v, do = _data(np.random.default_rng(5), 1, 20, 20, 8)
    v, do = v * np.float32(1e20), do * np.float32(1e20)
    out, saved = fused_forward(q, k, v, Context())
    with pytest.raises(UncorrectableError, match="overflow of the tile arithmetic"):
        fused_backward(saved, do, Context())


def test_located_element_of_a_score_fault():
    q, k, v, do = _data(np.random.default_rng(6), 1, 100, 100, 16)
    fault = Fault("additive", "element", sites="fused:S", row=5, col=7, magnitude=100.0)
    ctx = Context(fault_hook=fault)
    fused_forward(q, k, v, ctx)
    (event,) = ctx.report.events
    assert (event.pattern, event.rows, event.cols) == ("0D", (5,), (7,))


def test_no_false_positive_on_adversarial_clean_data():
    """Logits near float32 overflow of exp (and far beyond), constant rows, rows that see one
    key or none, causal and not: 240 calls, no event."""
    rng = np.random.default_rng(7)
    for call in range(240):
        assert_clean_call(_run, rng, call, 140, [8, 16, 64], np.float32, lambda: math.sqrt(
            float(10.0 ** rng.uniform(0, 15)) if call % 3 else 1.0))


def assert_clean_call(run, rng, call, longest, head_dims, dtype, spread):
    """One adversarial clean call through ``run(q, k, v, do, ctx, **kw)`` (host arrays back):
    random sizes up to ``longest``, then ``spread()`` of the data; every 2nd causal, every 5th
    with identical keys (flat rows), every 4th with key padding and a batch item that sees no
    key. No event, finite results."""
    n, lq, d = 2, int(rng.integers(1, longest)), int(rng.choice(head_dims))
    causal = bool(call % 2)
    lk = lq if causal else int(rng.integers(1, longest))
    q, k, v, do = _data(rng, n, lq, lk, d, dtype, spread=spread())
    if call % 5 == 0:
        k[:] = k[:, :1]
    visible = None
    if call % 4 == 0:
        visible = rng.random((n, lk)) < 0.3
        visible[0] = False
    ctx = Context()
    got = run(q, k, v, do, ctx, causal=causal, key_visible=visible)
    assert not ctx.report.events, (call, ctx.report.summary())
    assert all(np.isfinite(g.astype(np.float32)).all() for g in got)


def _peak_bytes(seq: int, d: int = 64) -> int:
    q, k, v, do = _data(np.random.default_rng(8), 1, seq, seq, d)
    tracemalloc.start()
    try:
        _run(q, k, v, do, Context(), causal=True)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_no_quadratic_buffer():
    """The traced peak of a fwd+bwd grows linearly with the sequence (outputs, gradients and the
    O(L) encodings) and stays far below one float32 L x L buffer (16.8 MB at L = 2048). The
    numba kernels' own buffers are per tile."""
    _peak_bytes(64)  # compile and warm up
    small, large = _peak_bytes(1024), _peak_bytes(2048)
    assert large < 0.3 * 4 * 2048 * 2048, large
    assert large < 2.5 * small, (small, large)


def test_float64():
    q, k, v, do = _data(np.random.default_rng(9), 2, 70, 90, 16, np.float64)
    ctx = Context()
    got = _run(q, k, v, do, ctx)
    assert not ctx.report.events
    want, _ = _reference(q, k, v, do, 0.25, False)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)


def test_bad_input():
    q, k, v, _ = _data(np.random.default_rng(0), 1, 8, 8, 8)
    with pytest.raises(TypeError, match="float32 or float64"):
        fused_forward(q.astype(np.float16), k, v, Context())
    with pytest.raises(TypeError, match="float32 or float64"):
        fused_forward(q.astype(np.int32), k.astype(np.int32), v.astype(np.int32), Context())
    with pytest.raises(ValueError, match="causal"):
        fused_forward(q, k[:, :4].copy(), v[:, :4].copy(), Context(), causal=True)
    with pytest.raises(ValueError, match="C-contiguous"):
        fused_forward(q.transpose(0, 2, 1), k, v, Context())
    bad = q.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="INF or NaN"):
        fused_forward(bad, k, v, Context())
    with pytest.raises(ValueError, match="key_visible"):
        fused_forward(q, k, v, Context(), key_visible=np.ones((1, 8)))
    out, saved = fused_forward(q, k, v, Context())
    with pytest.raises(ValueError, match="d_out"):
        fused_backward(saved, out[:, :4], Context())


def test_unscanned_non_finite_inputs_fail_the_checks_or_stay_non_finite():
    """``check_finite=False`` (its callers scanned the data) reads no value: a NaN or INF ``q``
    or ``k`` then fails the scores' checks and a non-finite ``dO`` the tiles' checks
    (``UncorrectableError``), a non-finite ``v`` gives a non-finite output; scanned, each is a
    ``ValueError`` naming it."""
    rng = np.random.default_rng(3)
    q, k, v, do = _data(rng, 2, 200, 200, 32)
    for name in "qkv":
        for value in (np.nan, np.inf):
            data = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
            data[name][1, 150, 3] = value
            with pytest.raises(ValueError, match=f"{name} holds INF or NaN"):
                fused_forward(data["q"], data["k"], data["v"], Context())
            if name == "v":
                out, _ = fused_forward(data["q"], data["k"], data["v"], Context(),
                                       check_finite=False)
                assert not np.isfinite(out).all()
                continue
            with pytest.raises(UncorrectableError):
                fused_forward(data["q"], data["k"], data["v"], Context(), check_finite=False)
    _, saved = fused_forward(q, k, v, Context())
    bad = do.copy()
    bad[0, 3, 4] = np.nan
    with pytest.raises(ValueError, match="d_out holds INF or NaN"):
        fused_backward(saved, bad, Context())
    with pytest.raises(UncorrectableError):
        fused_backward(saved, bad, Context(), check_finite=False)


def test_site_lists():
    assert set(FORWARD_SITES) | set(BACKWARD_SITES) == set(KERNEL_SITES)
    assert set(FINAL_SITES) | set(KERNEL_SITES) == set(HOOK_SITES)


def test_head_dim_128():
    """d = 128: 128 x 128 x 128 tile products (above OpenBLAS's threading threshold, run on the
    calling thread under ``abftgemm.threads.one_blas_thread``); results and a corrected fault as
    at d = 64."""
    q, k, v, do = _data(np.random.default_rng(10), 1, 100, 100, 128)
    ctx = Context()
    got = _run(q, k, v, do, ctx, causal=True)
    assert not ctx.report.events
    want, tol = _reference(q, k, v, do, 128 ** -0.5, True)
    for g, w, t in zip(got, want, tol):
        assert np.all(np.abs(g - w) <= t), np.max(np.abs(g - w) / t)
    ctx = Context(fault_hook=Fault("near-inf", "element", seed=1, sites="fused:dK_acc"))
    for g, c in zip(_run(q, k, v, do, ctx, causal=True), got):
        assert np.array_equal(g, c)
    assert "fused:dK_acc" in ctx.report.sites


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("value", [-np.inf, -3.0])
def test_a_negative_probability_at_a_hidden_key_is_caught(phase, value):
    """A negative value written into ``P`` where the key is hidden (``z = -inf``, ``P = 0``):
    the invariant's row sums took it as a flushed entry and agreed with ``z``; forward, ``-inf``
    then made the row sum ``-inf`` and the row passed as one that sees no key, its output 0
    (silent). Every negative entry is a fault now: recomputed, the step as without it."""
    q, k, v, do = _data(np.random.default_rng(3), 2, 40, 40, 8)
    clean = _run(q, k, v, do, Context(), causal=True)
    hit = []

    def hook(site, x):
        if site == "fused:P" and not hit:
            hit.append(x[0, 5])
            x[0, 5] = value  # row 0 sees key 0 only: key 5 is hidden

    fwd, bwd = (Context(fault_hook=hook) if phase == p else Context()
                for p in ("forward", "backward"))
    out, saved = verify_output(*fused_forward(q, k, v, fwd, causal=True), fwd)
    grads = verify_grads(saved, do, fused_backward(saved, do, bwd), bwd)
    report = (fwd if phase == "forward" else bwd).report
    assert hit == [0.0] and "fused:P" in report.sites
    for g, c in zip((out, *grads), clean):
        assert np.array_equal(g, c)


def test_a_fault_in_the_sum_of_a_row_that_sees_no_key_changes_nothing():
    """A row that sees no key has ``l = 0``; a fault there (a mantissa bit making it a tiny
    positive number, below the row sum check's floor) made the saved ``lse_lo`` NaN, and the
    backward raised UncorrectableError on a forward it cannot recompute. A row whose running max
    is ``-inf`` sees no key whatever ``l`` says: output 0, the step as without the fault. (The
    row is query 0 of head 1, whose other rows see keys: a head whose keys key padding hides
    throughout computes no tile at all.)"""
    q, k, v, do = _data(np.random.default_rng(8), 2, 40, 40, 8)
    no_key = np.zeros((2, 40, 40))
    no_key[1, 0] = -np.inf
    clean = _run(q, k, v, do, Context(), attn_mask=no_key)
    hit = []

    def hook(site, x):
        if site == "fused:rowsum" and not hit and x.shape[0] and x[0, 0] == 0:
            hit.append(site)
            x[0, 0] = np.float32(5.877471754111438e-39)

    got = _run(q, k, v, do, Context(fault_hook=hook), attn_mask=no_key)
    assert hit
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("length", [128, 200])
def test_one_dominant_key_is_not_flagged(dtype, length):
    """One key dominant by a logit gap of 16.64 (the others' probabilities about ``2**-24``)
    and ``V`` all ones: the ``P V`` tile product loses every small addend (ties to even), an
    error near ``127 u`` per element, over the statistical ``KAPPA sqrt(L) u`` at short ``L``:
    ``fused:O_acc`` and ``fused:out`` flagged a clean call (1.36 of their thresholds) and
    ``check="correct"`` raised. The accumulators' threshold is at least the tile product's
    rigorous bound."""
    import warnings

    from attention.fused_final import verify_grads, verify_output

    d = 16
    q = np.ones((1, length, d), dtype)
    k = np.zeros((1, length, d), dtype)
    k[0, 0, :] = 16.6355 / d
    v = do = np.ones((1, length, d), dtype)
    for check in ("detect", "correct"):
        ctx = Context(check=check)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, saved = verify_output(*fused_forward(q, k, v, ctx, scale=1.0), ctx)
            verify_grads(saved, do, fused_backward(saved, do, ctx), ctx)
        assert not ctx.report.events, ctx.report.summary()


def test_one_sided_rounding_in_the_score_tiles_is_not_flagged():
    """``S = Q K^T`` of rows ``[1, 2**-12, ...]`` (head dim 128): every small product lost in
    one direction, ``d u`` over the statistical ``KAPPA sqrt(d) u`` (1.34 of it): ``fused:S``
    flagged a clean call and ``check="correct"`` raised. The tile products' threshold is at
    least their rigorous bound, as the accumulators' is."""
    import warnings

    d = 128
    row = np.full(d, 2.0 ** -12, np.float32)
    row[0] = 1.0
    q = k = np.tile(row, (1, 64, 1))
    v = do = np.ones((1, 64, d), np.float32)
    for check in ("detect", "correct"):
        ctx = Context(check=check)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, saved = verify_output(*fused_forward(q, k, v, ctx), ctx)
            verify_grads(saved, do, fused_backward(saved, do, ctx), ctx)
        assert not ctx.report.events, ctx.report.summary()
