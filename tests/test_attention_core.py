"""The functional attention core: the pass tables run, one settle per pass, counted structure,
cross-attention and masks against float64 math written here from the definitions. The layers
whose unfused sites a test watches run the unfused product (``core="unfused"``; the fused one:
tests/test_layer_core.py)."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from abftgemm.backend import to_host
from abftgemm.faults import Fault, Recorder
from attention import (ALL_SITES, CROSS_SITES, INVARIANT_SITES, SITES, Context,
                       MultiHeadAttention, attention_backward, attention_forward)
from attention import reference as ref
from attention.core import CORE_SITES
from attention.fused import FUSED_SITES
from attention.workspace import Workspace
from conftest import BACKENDS, CUDA_ON_CPU

#: float64 layers against float64 math in another order: sums of at most 3*d_model = 48 terms of
#: magnitude <= ~10 (O(1) data, unnormalized sums) round to <= 48 * 10 * 2^-53 ~ 5e-14 each, a few
#: such steps chained; 1e-10 leaves three orders of magnitude of margin and still catches any
#: wrong mask, transpose or missing term (those move results by O(0.01-1)).
TOL64 = 1e-10


def _data(xp, batch=2, seq_q=5, seq_k=7, d=8, heads=2, seed=0):
    layer = MultiHeadAttention(d, heads, dtype="float64", xp=xp, seed=seed, core="unfused")
    rng = np.random.default_rng(seed + 1)
    x, key, value, dy = (rng.standard_normal(s) for s in
                         ((batch, seq_q, d), (batch, seq_k, d), (batch, seq_k, d),
                          (batch, seq_q, d)))
    keys = rng.random((batch, seq_k)) < 0.7
    keys[:, 0] = True
    return layer, x, key, value, dy, keys, rng


def _expected(params, x, key, value, dy, heads, keys, add, causal):
    """Cross-attention forward and backward in float64, from the definitions."""
    p = {k: to_host(v).astype(np.float64) for k, v in params.items()}
    hd = x.shape[-1] // heads
    q, k, v = (t @ p["w" + n] + p["b" + n] for t, n in ((x, "q"), (key, "k"), (value, "v")))
    qh, kh, vh = (ref.split_heads(t, heads) for t in (q, k, v))
    s = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(hd)
    vis = np.ones(s.shape, bool) if keys is None else np.broadcast_to(keys[:, None, None, :],
                                                                         s.shape).copy()
    if causal:
        vis &= np.tril(np.ones(s.shape[-2:], bool))
    if add is not None:
        s = s + add
        vis &= np.isfinite(add)
    probs = ref.masked_softmax(s, vis)
    context = ref.merge_heads(probs @ vh)
    y = context @ p["wo"] + p["bo"]
    d_ctx = ref.split_heads(dy @ p["wo"].T, heads)
    dp = d_ctx @ vh.transpose(0, 1, 3, 2)
    dv = ref.merge_heads(probs.transpose(0, 1, 3, 2) @ d_ctx)
    d_masked = ref.softmax_backward(dp, probs, vis)  # the gradient of the masked scores
    ds = d_masked / np.sqrt(hd)
    dq, dk = ref.merge_heads(ds @ kh), ref.merge_heads(ds.transpose(0, 1, 3, 2) @ qh)
    grads = {"wo": np.einsum("bsi,bso->io", context, dy), "bo": dy.sum((0, 1))}
    for n, t, g in (("q", x, dq), ("k", key, dk), ("v", value, dv)):
        grads["w" + n], grads["b" + n] = np.einsum("bsi,bso->io", t, g), g.sum((0, 1))
    return y, (dq @ p["wq"].T, dk @ p["wk"].T, dv @ p["wv"].T), grads, d_masked


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_with_masks_matches_float64(xp, mask_kind, causal):
    layer, x, key, value, dy, keys, rng = _data(xp)
    seq_q, seq_k = x.shape[1], key.shape[1]
    attn_mask, add = None, None
    if mask_kind == "bool":  # torch's convention: True = not allowed
        attn_mask = rng.random((seq_q, seq_k)) < 0.3
        attn_mask[:, 0] = False
        add = np.where(attn_mask, -np.inf, 0.0)
    elif mask_kind == "float":
        attn_mask = add = rng.standard_normal((seq_q, seq_k))
    ctx = Context()
    a = {n: xp.asarray(t) for n, t in (("x", x), ("key", key), ("value", value), ("dy", dy))}
    y, saved = attention_forward(layer.params, a["x"], ctx, n_heads=2, causal=causal,
                                 key=a["key"], value=a["value"], key_visible=xp.asarray(keys),
                                 attn_mask=None if attn_mask is None else xp.asarray(attn_mask))
    dx, grads = attention_backward(saved, a["dy"], ctx)
    y_ref, dx_ref, g_ref, _ = _expected(layer.params, x, key, value, dy, 2, keys, add, causal)
    assert not ctx.report.detected, ctx.report.summary()
    assert np.abs(to_host(y) - y_ref).max() <= TOL64
    for got, want in zip(dx, dx_ref):
        assert np.abs(to_host(got) - want).max() <= TOL64
    for k, want in g_ref.items():
        assert np.abs(to_host(grads[k]) - want).max() <= TOL64, k
    checked = set(ALL_SITES) - {"d_x"} | set(INVARIANT_SITES)
    # NumPy float64: the fused core, except a causal mask over seq_q != seq_k
    assert saved["core"] == ("fused" if xp is np and not causal else "unfused")
    if saved["core"] == "fused":  # its own sites in place of the product's
        checked = checked - set(CORE_SITES) - set(INVARIANT_SITES) | set(FUSED_SITES)
    assert set(ctx.report.checked) >= checked


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("per_head", [False, True], ids=["2-D mask", "3-D mask"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_gradient_of_a_float_mask_matches_float64(xp, per_head, causal):
    """``mask_grad=True`` (a learned position bias): ``grads["attn_mask"]`` is the gradient of
    the float mask, summed over batch and heads for a 2-D one; the unfused core runs, a key
    padding mask and ``-inf`` entries (gradient 0) beside it. A fault in the backward softmax is
    repaired before the gradient is taken from it."""
    layer, x, key, value, dy, keys, rng = _data(xp)
    seq_q, seq_k = x.shape[1], key.shape[1]
    mask = rng.standard_normal((4, seq_q, seq_k) if per_head else (seq_q, seq_k))
    mask[..., 2] = -np.inf
    a = {n: xp.asarray(t) for n, t in (("x", x), ("key", key), ("value", value), ("dy", dy))}
    runs = []
    for hook in (None, Fault("additive", "element", seed=2, sites="softmax_backward",
                             magnitude=10.0)):
        ctx = Context(fault_hook=hook)
        _, saved = attention_forward(layer.params, a["x"], ctx, n_heads=2, causal=causal,
                                     key=a["key"], value=a["value"],
                                     key_visible=xp.asarray(keys), attn_mask=xp.asarray(mask),
                                     mask_grad=True)
        _, grads = attention_backward(saved, a["dy"], ctx)
        assert saved["core"] == "unfused"
        assert ctx.report.detected == (hook is not None)
        runs.append(to_host(grads["attn_mask"]))
    add = mask.reshape(2, 2, seq_q, seq_k) if per_head else mask
    d_masked = _expected(layer.params, x, key, value, dy, 2, keys, add, causal)[3]
    want = d_masked.reshape(mask.shape) if per_head else d_masked.sum((0, 1))
    for got in runs:
        assert got.shape == mask.shape and got.dtype == np.float64
        assert np.abs(got - want).max() <= TOL64
    assert np.all(runs[0][..., 2] == 0)


def test_aliased_gradient_buffers_and_a_foreign_w_qkv_are_refused():
    """grads_out arrays that are parameters, or one another, would be overwritten while the
    backward reads them; a w_qkv that is not the memory of wq, wk and wv would be read where
    they are meant: each refused, naming what. A read-only buffer too."""
    layer, x, *_, dy, _, _ = _data(np)
    params = layer.params
    _, saved = attention_forward(params, x[:, :5], Context(), n_heads=2)
    for grads_out, match in (({"wq": params["wq"]}, r"grads_out\['wq'\] shares memory with "
                                                     r"params\['wq'\]"),
                             (dict.fromkeys(("wq", "wk"), np.empty_like(params["wq"])),
                              r"grads_out\['wq'\] shares memory with grads_out\['wk'\]")):
        with pytest.raises(ValueError, match=match):
            attention_backward(saved, dy[:, :5], Context(), grads_out=grads_out)
    frozen = np.empty_like(params["wq"])
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"grads_out\['wq'\] is read-only"):
        attention_backward(saved, dy[:, :5], Context(), grads_out={"wq": frozen})
    w_qkv = np.concatenate([params[w] for w in ("wq", "wk", "wv")], axis=1)  # a copy
    with pytest.raises(ValueError, match="column blocks are wq, wk and wv"):
        attention_forward({**params, "w_qkv": w_qkv}, x[:, :5], Context(), n_heads=2)
    views = {**params, "w_qkv": w_qkv, **{w: w_qkv[:, i * 8:(i + 1) * 8]
                                           for i, w in enumerate(("wq", "wk", "wv"))}}
    attention_forward(views, x[:, :5], Context(), n_heads=2)  # its views: taken


@pytest.mark.parametrize("scale,match", [(1e-300, "scale must be"), (float("nan"), "scale must"),
                                         (None, "head_dim must be at least 1")])
def test_the_core_refuses_a_scale_or_head_dim_it_cannot_use(scale, match):
    from attention.core import core_forward

    d = 0 if scale is None else 4
    q = np.zeros((2, 3, d), np.float32)
    with pytest.raises(ValueError, match=match):
        core_forward(q, q, q, Context(), scale=scale)


def test_mask_grad_refuses_what_it_cannot_honour():
    layer, x, *_ = _data(np)
    params = layer.params
    with pytest.raises(ValueError, match="needs a float attn_mask"):
        attention_forward(params, x, Context(), n_heads=2, attn_mask=np.zeros((5, 5), bool),
                          mask_grad=True)
    with pytest.raises(ValueError, match="fused attention core does not apply.*mask_grad"):
        attention_forward(params, x, Context(), n_heads=2, attn_mask=np.zeros((5, 5)),
                          mask_grad=True, core="fused")


@pytest.mark.parametrize("xp", BACKENDS)
def test_every_gemm_step_runs_and_every_product_is_a_step(xp):
    """Self-attention runs the SITES, cross-attention adds CROSS_SITES; every product the core
    runs reaches the hook under a site name of the pass tables, and every GEMM step runs."""
    layer, x, key, value, dy, keys, _ = _data(xp)
    seen = set()
    for kv in ({}, {"key": xp.asarray(key), "value": xp.asarray(value)}):
        recorder = Recorder()
        y, cache = layer.forward(xp.asarray(x), fault_hook=recorder, **kv)
        layer.backward(xp.asarray(dy), cache, fault_hook=recorder)
        gemms = recorder.sites - set(INVARIANT_SITES)
        assert gemms <= set(ALL_SITES)
        seen |= gemms
    assert seen == set(ALL_SITES) == set(SITES) | set(CROSS_SITES)


@pytest.mark.parametrize("xp", BACKENDS)
def test_an_encoding_is_made_once_per_pass_and_handed_on(xp, monkeypatch):
    """In self-attention q_proj's encoding of X serves k_proj and v_proj, d_wq's of X^T serves
    d_wk and d_wv, and d_x's is composed from d_q, d_k and d_v's (on the GPU, whose plans keep
    no whole encoding they made, only the composed one); cross-attention's key and value are
    other tensors, encoded by their own sites, and d_key's and d_value's encodings are composed
    from d_k's and d_v's. Every case matches the unprotected layer."""
    from abftgemm.plan import ProtectedMatmul

    handed: dict[str, bool] = {}
    execute = ProtectedMatmul.execute

    def spy(self, a, b, **kw):
        handed[self.name] = kw.get("a_checksums") is not None
        return execute(self, a, b, **kw)

    monkeypatch.setattr(ProtectedMatmul, "execute", spy)
    layer, x, key, value, dy, _, _ = _data(xp)
    shared = {"k_proj", "v_proj", "d_wk", "d_wv"} if xp is np else set()
    composed = {"d_x", "d_key", "d_value"}
    for kv, expect in (({}, shared | {"d_x"}), ({"key": key, "value": value}, composed)):
        kv = {k: xp.asarray(t) for k, t in kv.items()}
        handed.clear()
        outs = {}
        for check in ("correct", "off"):
            layer.check = check
            y, cache = layer.forward(xp.asarray(x), **kv)
            outs[check] = (y, *layer.backward(xp.asarray(dy), cache))
        assert {s for s in ("k_proj", "v_proj", "d_wk", "d_wv") + tuple(composed)
                if handed.get(s)} == expect
        assert not handed["q_proj"] and not handed["d_wq"]
        assert not layer.last_report.detected, layer.last_report.summary()
        assert np.array_equal(to_host(outs["correct"][0]), to_host(outs["off"][0]))
        as_tuple = (lambda d: d if isinstance(d, tuple) else (d,))
        for got, want in zip(as_tuple(outs["correct"][1]), as_tuple(outs["off"][1])):
            # dS rounds once more when checked: equal up to float64 rounding
            assert np.allclose(to_host(got), to_host(want), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 4), (2, 0)], ids=["no batch", "no tokens"])
def test_empty_batches_and_sequences_run_both_passes(xp, shape):
    """An empty batch or sequence gives empty outputs and zero gradients, as plain math does."""
    layer = MultiHeadAttention(8, 2, causal=True, dtype="float32", xp=xp, core="unfused")
    x = xp.zeros(shape + (8,), np.float32)
    y, cache = layer.forward(x)
    dx, grads = layer.backward(xp.zeros_like(x), cache)
    assert y.shape == dx.shape == x.shape
    for k, g in grads.items():
        assert not to_host(g).any(), k
    assert not layer.last_report.detected, layer.last_report.summary()


@pytest.mark.parametrize("xp", BACKENDS)
def test_clean_step_syncs_twice_and_allocates_nothing_new(xp):
    layer = MultiHeadAttention(16, 4, causal=True, dtype="float32", xp=xp, core="unfused")
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((2, 8, 16)).astype(np.float32))
    dy = xp.asarray(rng.standard_normal((2, 8, 16)).astype(np.float32))

    def step():
        y, cache = layer.forward(x)
        return layer.backward(dy, cache)

    step()  # plans and buffers are made here
    before = layer.counters.syncs, layer.counters.allocations
    step()
    assert layer.counters.syncs - before[0] <= 2  # one settle per pass
    assert layer.counters.allocations == before[1]
    # Encodings handed on within a pass are read where they were written: the only copies are
    # the two the forward pass keeps for the backward one (V's and P^T's; on the GPU, whose
    # softmax makes no encodings, V's only). Host reads: none on the CPU (its verdicts are host
    # memory); on the GPU one per pass: every verdict of the pass (its products', the scores' and
    # dP's rows', the softmax checks') in one ledger page, fetched once at the settle.
    counters = layer.counters
    copies, reads = counters.copies, counters.host_reads
    y, cache = layer.forward(x)
    forward = counters.copies - copies, counters.host_reads - reads
    layer.backward(dy, cache)
    backward = counters.copies - copies - forward[0], counters.host_reads - reads - forward[1]
    gpu = xp is not np
    assert forward == (1 if gpu else 2, int(gpu))
    assert backward == (0, int(gpu))
    if xp is CUDA_ON_CPU:  # device memory: a clean backward allocates its results and nothing else
        from cuda_on_cpu import memory

        y, cache = layer.forward(x)
        made = memory.allocations_made()
        dx, grads = layer.backward(dy, cache)
        assert memory.allocations_made() - made == 1 + len(grads)
    if xp is np:  # independent check: what one more step leaves allocated beyond its results
        tracemalloc.start()
        snap = tracemalloc.take_snapshot()
        results = step()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap, "filename"))
        tracemalloc.stop()
        kept = to_host(results[0]).nbytes + sum(g.nbytes for g in results[1].values())
        # Besides dx and the gradients the step keeps nothing: allow 64 KiB of interpreter and
        # tracemalloc bookkeeping (the smallest reused buffer, the scores, is 2 KiB here, and a
        # leak of one set of buffers per step would be ~20 KiB per buffer family x 20 families).
        assert grown - kept <= 64 * 1024, grown - kept


@pytest.mark.cuda_on_cpu
@pytest.mark.skipif(CUDA_ON_CPU is None, reason="needs the cupy-on-cpu stand-in")
@pytest.mark.parametrize("core,fault", [("unfused", None), ("unfused", "q_proj"),
                                        ("unfused", "softmax"), ("fused", None)])
def test_the_counters_see_every_read_of_the_device(core, fault, monkeypatch):
    """``counters.host_reads`` counts every copy from the device, not only the ledger's one
    fetch a pass: the rare path's reads after a fault. A clean pass reads once, on either core:
    the opt-in fused CUDA core's checks (its kernels' records, the finiteness of its inputs, its
    final checks) land in the pass's ledger (attention/fused_deferred.py)."""
    from cuda_on_cpu import arrays

    transfers, injecting = [], []  # the fault toolkit's own reads are not the library's
    for name in ("get", "__bool__", "__int__", "__float__", "item"):
        real = getattr(arrays.ndarray, name)
        monkeypatch.setattr(arrays.ndarray, name,
                            lambda self, *a, _real=real, **k: (injecting or transfers.append(1))
                            and None or _real(self, *a, **k))
    layer = MultiHeadAttention(16, 4, causal=True, dtype="float32", xp=CUDA_ON_CPU, core=core)
    rng = np.random.default_rng(0)
    x, dy = (CUDA_ON_CPU.asarray(rng.standard_normal((2, 8, 16)).astype(np.float32))
             for _ in range(2))
    layer.backward(dy, layer.forward(x)[1])  # plans and buffers made
    inject = Fault("additive", "element", seed=2, sites=fault or (), magnitude=1e3)

    def hook(site, c):
        injecting.append(1)
        inject(site, c)
        injecting.clear()

    transfers.clear()
    reads = layer.counters.host_reads
    layer.backward(dy, layer.forward(x, fault_hook=hook if fault else None)[1])
    assert layer.counters.host_reads - reads == len(transfers)
    assert (len(transfers) == 2) == (fault is None)  # one a pass
    if fault is not None:
        assert fault in layer.last_report.sites


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("site", ["q_proj", "k_proj", "v_proj"])
def test_replay_repairs_at_the_source(xp, site):
    """A fault found at the pass's settle is replayed site by site: the saved Q, K and V are the
    fault-free ones."""
    layer = MultiHeadAttention(8, 2, causal=True, dtype="float64", xp=xp, core="unfused")
    x = xp.asarray(np.random.default_rng(3).standard_normal((2, 6, 8)))
    _, clean = layer.forward(x)
    y, cache = layer.forward(x, fault_hook=Fault("additive", "element", seed=1, sites=site,
                                                 magnitude=10.0))
    assert site in layer.last_report.sites
    for name in ("qh", "kh", "vh", "probs"):
        # float64 replay of the same products: the only difference is the checksum repair of one
        # element, rounded like its neighbours (2^-50 relative of O(1) values).
        np.testing.assert_allclose(to_host(cache[name]), to_host(clean[name]), atol=1e-12)


@pytest.mark.parametrize("site", ["context", "d_v", "d_q", "d_k"])
def test_a_fault_behind_softmax_made_encodings_is_repaired(monkeypatch, site):
    """Without a fault hook the CPU softmax kernels hand the column encodings of P, P^T, dS and
    dS^T (made on their write) to the products that read them. A fault injected into one of those
    products behind the hook's back (in its GEMM) is still found and repaired."""
    from abftgemm.plan import ProtectedMatmul

    layer = MultiHeadAttention(16, 4, causal=True, dtype="float32", core="unfused")
    rng = np.random.default_rng(3)
    x, dy = (rng.standard_normal((2, 8, 16)).astype(np.float32) for _ in range(2))
    y0, cache = layer.forward(x)
    dx0, g0 = layer.backward(dy, cache)
    handed, execute = [], ProtectedMatmul.execute

    def faulty_execute(plan, a, b, **kw):
        if plan.name != site or handed:
            return execute(plan, a, b, **kw)
        handed.append(kw.get("a_checksums") is not None)
        gemm = plan._work.gemm

        def corrupted(op, c, triangle=None):
            gemm(op, c, triangle)
            c[1, 2, 3] += 100.0

        monkeypatch.setattr(plan._work, "gemm", corrupted)
        try:
            return execute(plan, a, b, **kw)
        finally:
            monkeypatch.setattr(plan._work, "gemm", gemm)

    monkeypatch.setattr(ProtectedMatmul, "execute", faulty_execute)
    y, cache = layer.forward(x)
    dx, g = layer.backward(dy, cache)
    events = layer.last_report.events  # the forward's and the backward's
    assert handed == [True]  # the product took the softmax kernel's encoding
    assert any(e.site == site and e.action == "corrected" for e in events), events
    assert (y == y0).all() and (dx == dx0).all()
    assert all((g[k] == g0[k]).all() for k in g0)


def test_composed_encoding_is_the_stacked_matrix_encoding_on_both_code_paths():
    """d_x's handed-on encoding: composed from per-(batch item, head) column encodings, it equals
    the column encoding of the stacked (batch * seq, width) matrix computed from its definition
    (plain, (i+1)/m location-weighted, absolute), by the CPU's numba kernel and by the
    array-module code the GPU runs (here on NumPy through a stand-in module)."""
    from attention.functional import _stacked_encoding

    rng = np.random.default_rng(3)
    batch, heads, seq, hd = 3, 2, 5, 4
    blocks = [rng.standard_normal((batch * heads, seq, hd)) for _ in range(3)]

    def encoding(m):  # columns of an (rows, cols) matrix
        w = ((np.arange(m.shape[0]) + 1) / m.shape[0])[:, None]
        return np.stack([m.sum(0), (w * m).sum(0), np.abs(m).sum(0)])

    stacked = np.concatenate([ref.merge_heads(b.reshape(batch, heads, seq, hd))
                              .reshape(batch * seq, heads * hd) for b in blocks], axis=1)
    parts = [np.stack([encoding(item) for item in b], 1) for b in blocks]  # (3, items, width)
    want = encoding(stacked)

    class ArrayModule:  # the array-module branch, run on NumPy
        def __getattr__(self, name):
            return getattr(np, name)

    for xp in (np, ArrayModule()):
        ws = Workspace()
        for _ in range(2):  # the second call on the workspace's buffers and weights
            got = _stacked_encoding(xp, parts, batch, np.empty((3, 1, stacked.shape[1])), ws, "x")
            np.testing.assert_allclose(got[:, 0], want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("check", ["off", "correct"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_causal_products_multiply_only_their_triangles(monkeypatch, check, causal):
    """In a causal layer P and dS are lower triangular (their transposes upper), and only the
    lower triangle of the scores and of dP is read: the products are told so (and skip the
    blocks that cannot matter, tests/test_plan.py); in a non-causal layer every product runs
    whole. 130 keys: more than one row block, so the CPU skips in both modes."""
    from abftgemm._cpu import CpuBackend

    seen: dict[int, tuple] = {}
    gemm = CpuBackend.gemm

    def recording(self, a, b, out, bias, triangle=None, out_triangle=None, *, buffers=None):
        seen[out.ctypes.data] = (triangle, out_triangle)
        return gemm(self, a, b, out, bias, triangle, out_triangle, buffers=buffers)

    monkeypatch.setattr(CpuBackend, "gemm", recording)
    outputs = {}
    hook = lambda site, c: outputs.setdefault(site, c.ctypes.data)  # noqa: E731
    layer = MultiHeadAttention(16, 4, causal=causal, dtype="float32", check=check,
                               core="unfused")
    x = np.random.default_rng(0).standard_normal((1, 130, 16)).astype(np.float32)
    _, cache = layer.forward(x, fault_hook=hook)
    layer.backward(x, cache, fault_hook=hook)
    want = {"context": ("lower", None), "d_q": ("lower", None), "d_v": ("upper", None),
            "d_k": ("upper", None), "scores": (None, "lower"), "d_probs": (None, "lower")}
    got = {site: seen.get(key) for site, key in outputs.items() if site in ALL_SITES}
    assert set(got) == set(SITES)
    assert got == {s: want.get(s, (None, None)) if causal else (None, None) for s in SITES}


@pytest.mark.parametrize("site", ["scores", "d_probs"])
def test_a_fault_where_a_causal_layer_reads_nothing_changes_nothing(site, monkeypatch):
    """130 keys: the CPU computes the scores and dP only up to each row block's last column
    (blocks of 44 rows here), and the softmax kernels observe each row that far: a clean step
    flags nothing. A fault beyond, in memory the product never writes and the softmax never
    reads, changes nothing and is not reported; one at a visible entry is repaired."""
    from abftgemm.plan import ProtectedMatmul

    settled, settle = [], ProtectedMatmul._finish_settle

    def recording(plan, checksums):
        rare_paths = plan.counters.rare_paths
        report = settle(plan, checksums)
        if plan.observed is not None:
            settled.append((plan.name, plan.row_limits is not None,
                            plan.counters.rare_paths > rare_paths))
        return report

    monkeypatch.setattr(ProtectedMatmul, "_finish_settle", recording)
    layer, x, dy, clean = _causal_130_keys()
    for row, col, read in ((3, 120, False), (100, 50, True)):
        fault = Fault("additive", "element", sites=site, batch=0, row=row, col=col,
                      magnitude=1e3)
        events = _step_matches(layer, x, dy, clean, fault)
        assert fault.injected and any(e.site == site for e in events) == read, events
    settled.clear()  # after a repair completed a product, beyond the limits too
    layer.backward(dy, layer.forward(x)[1])
    assert settled == [("scores", True, False), ("d_probs", True, False)]


@pytest.mark.parametrize("col", [2, 20, 100],
                         ids=["visible", "past the diagonal", "past the row limit"])
def test_a_softmax_backward_fault_is_caught_whatever_dp_holds_where_it_is_never_written(col):
    """Under a fault hook the backward softmax checks dS after the hook has seen it. In a causal
    layer on the CPU, dP past each row's limit is memory the product never writes (NaN here, as
    a reused buffer may hold): the check does not read it, so a fault in dS, before the
    diagonal or past it (where dS must be 0), is judged and repaired. (Reading dP there once
    made 0 * NaN poison the row, which then went unjudged.)"""
    from abftgemm._cpu_triangles import row_limits

    limits = row_limits(130, 130)
    assert limits[3] < 130
    fault = Fault("additive", "element", sites="softmax_backward", batch=0, row=3, col=col,
                  magnitude=1e3)

    def hook(site, c):
        if site == "d_probs":
            for i, limit in enumerate(limits):
                c[:, i, limit:] = np.nan
        fault(site, c)

    layer, x, dy, clean = _causal_130_keys()
    events = _step_matches(layer, x, dy, clean, hook)
    assert fault.injected
    assert [(e.site, e.action) for e in events] == [("softmax_backward", "recomputed")]


def _causal_130_keys():
    """A float64 causal layer over 130 keys (more than one row block on the CPU), its inputs and
    its fault-free results ``(y, dx, grads)``."""
    layer = MultiHeadAttention(16, 4, causal=True, dtype="float64", core="unfused")
    rng = np.random.default_rng(8)
    x, dy = (rng.standard_normal((1, 130, 16)) for _ in range(2))
    y, cache = layer.forward(x)
    return layer, x, dy, (y, *layer.backward(dy, cache))


def _step_matches(layer, x, dy, clean, hook):
    """One forward and backward step under ``hook``: assert it delivers the fault-free results
    (to float64 rounding) and return the events of both passes."""
    y, cache = layer.forward(x, fault_hook=hook)
    dx, g = layer.backward(dy, cache, fault_hook=hook)
    events = layer.last_report.events  # the forward's and the backward's
    y0, dx0, g0 = clean
    for got, want in [(y, y0), (dx, dx0)] + [(g[k], g0[k]) for k in g0]:
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL64 * np.abs(want).max())
    return events


@pytest.mark.parametrize("core", ["fused", "unfused"])
def test_the_backward_writes_dq_dk_dv_where_the_input_gradient_reads_them(core, monkeypatch):
    """Self-attention's input gradient is one product of ``d_qkv = [dq dk dv]``: the merges of
    the heads' gradients write into its column blocks, so its ``stack`` step copies nothing (the
    weights' stack, of the caller's separate arrays, still does); the gradients are, bit for
    bit, those of a backward that stacks by copying."""
    from attention import functional

    in_place: dict[str, bool] = {}
    stack = functional._OPS["stack"]

    def spy(self, step):
        out = self.env.get(step.out)
        in_place[step.out] = out is not None and all(
            np.shares_memory(self.env[n], out) for n in step.ins)
        return stack(self, step)

    monkeypatch.setitem(functional._OPS, "stack", spy)
    layer, x, *_, dy, _, _ = _data(np, batch=3, seq_q=40, d=16)
    layer.core = core
    runs = []
    for copying in (False, True):
        if copying:
            monkeypatch.setattr(functional._Pass, "_in_stack", lambda *args: None)
        _, cache = layer.forward(x)
        runs.append(layer.backward(dy, cache))
        assert layer.last_core == core
        assert in_place == {"d_qkv": not copying, "w_qkv": False}
    (dx, grads), (dx_copied, grads_copied) = runs
    assert np.array_equal(dx, dx_copied)
    assert all(np.array_equal(grads[k], grads_copied[k]) for k in grads)
