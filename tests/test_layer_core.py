"""The layer's and the PyTorch module's choice of the attention product between the projections:
the fused core (attention/fused.py) where it applies, equal to the unfused sites within rounding,
forward and backward, faults at the projections and inside the fused core corrected, and which
product ran said by ``last_core``."""
from __future__ import annotations

import numpy as np
import pytest

from abftgemm.faults import Fault
from attention import CheckingPlan, MultiHeadAttention
from attention.dropout_hash import keep_mask

TOL = {"float32": dict(rtol=2e-4, atol=2e-5), "float64": dict(rtol=1e-10, atol=1e-12)}


def _inputs(rng, batch, seq_q, seq_k, d, dtype, cross):
    x, dy = (rng.standard_normal((batch, seq_q, d)).astype(dtype) for _ in range(2))
    kv = {}
    if cross:
        kv = {n: rng.standard_normal((batch, seq_k, d)).astype(dtype) for n in ("key", "value")}
    return x, dy, kv


def _step(layer, x, dy, **kw):
    """``(y, dx..., grads...)`` of one forward and backward, flattened, and the core that ran;
    ``layer.step_sites``: the sites the two reports name."""
    hook = kw.pop("fault_hook", None)
    y, cache = layer.forward(x, fault_hook=hook, **kw)
    ran, sites = layer.last_core, set(layer.last_report.sites)
    dx, grads = layer.backward(dy, cache, fault_hook=hook)
    layer.step_sites = sites | set(layer.last_report.sites)
    dx = dx if isinstance(dx, tuple) else (dx,)
    return ran, (y, *dx, *(grads[k] for k in sorted(grads)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal,cross,masks", [(False, False, "none"), (True, False, "none"),
                                                (False, True, "float"), (True, False, "bool"),
                                                (False, False, "keys+float")])
def test_fused_layer_equals_the_unfused_layer(dtype, causal, cross, masks):
    rng = np.random.default_rng(0)
    batch, seq_q, d, heads = 2, 70, 32, 4
    seq_k = 50 if cross else seq_q
    x, dy, kv = _inputs(rng, batch, seq_q, seq_k, d, dtype, cross)
    kw = dict(kv)
    if "keys" in masks:
        keys = rng.random((batch, seq_k)) < 0.8
        keys[1] = False  # a batch item that sees no key: its context 0
        kw["mask"] = keys
    if "float" in masks:
        add = 2 * rng.standard_normal((batch * heads, seq_q, seq_k))
        add[rng.random(add.shape) < 0.2] = -np.inf
        add[:, 3] = -np.inf  # a fully masked query row
        kw["attn_mask"] = add
    if masks == "bool":
        kw["attn_mask"] = rng.random((seq_q, seq_k)) < 0.3
    results = {}
    for core in ("auto", "unfused"):
        layer = MultiHeadAttention(d, heads, causal=causal, dtype=dtype, core=core)
        ran, results[core] = _step(layer, x, dy, **kw)
        assert ran == ("fused" if core == "auto" else "unfused")
        assert not layer.last_report.events, layer.last_report.summary()
    for got, want in zip(results["auto"], results["unfused"]):
        np.testing.assert_allclose(got, want, **TOL[dtype])


@pytest.mark.parametrize("core", ["auto", "unfused"])
def test_a_mask_per_batch_item_equals_it_repeated_per_head(core):
    """The layer's ``attn_mask`` ``(batch, L, S)``, one per batch item that its heads share,
    gives bit for bit what the same masks repeated per head ``(batch * heads, L, S)`` give."""
    rng = np.random.default_rng(5)
    batch, seq, d, heads = 2, 40, 32, 4
    x, dy, _ = _inputs(rng, batch, seq, seq, d, "float32", False)
    add = 2 * rng.standard_normal((batch, seq, seq))
    add[rng.random(add.shape) < 0.2] = -np.inf
    results = []
    for mask in (add, np.repeat(add, heads, axis=0)):
        layer = MultiHeadAttention(d, heads, causal=True, core=core, seed=3)
        ran, result = _step(layer, x, dy, attn_mask=mask)
        assert ran == ("fused" if core == "auto" else "unfused")
        assert not layer.last_report.events
        results.append(result)
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_layer_runs_the_fused_core(dtype):
    """16-bit data run the fused core (tiles in float32), its final checks included, within the
    16-bit rounding of the unfused layer."""
    rng = np.random.default_rng(3)
    x, dy, _ = _inputs(rng, 2, 40, 40, 32, "float32", False)
    results = {}
    for core in ("auto", "unfused"):
        layer = MultiHeadAttention(32, 4, causal=True, dtype=dtype, core=core)
        ran, results[core] = _step(layer, x.astype(layer.dtype), dy.astype(layer.dtype))
        assert ran == ("fused" if core == "auto" else "unfused")
        assert not layer.last_report.events, layer.last_report.summary()
        if core == "auto":
            assert {"fused:out", "fused:dV_out", "fused:dK_out"} <= layer.step_sites | set(
                layer.last_report.checked)
    for got, want in zip(results["auto"], results["unfused"]):
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=5e-2,
                                   atol=5e-2)


@pytest.mark.parametrize("site", ["fused:out", "fused:dV_out", "fused:dK_out"])
def test_fault_after_the_fused_kernels_in_the_layer_is_corrected(site):
    rng = np.random.default_rng(4)
    x, dy, _ = _inputs(rng, 2, 40, 40, 32, "float16", False)
    layer = MultiHeadAttention(32, 4, dtype="float16", core="fused")
    _, clean = _step(layer, x, dy)
    fault = Fault("additive", "element", seed=2, sites=site, magnitude=10.0)
    _, got = _step(layer, x, dy, fault_hook=fault)
    assert fault.injected and site in layer.step_sites
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)


def test_auto_falls_back_where_the_fused_core_does_not_apply():
    rng = np.random.default_rng(1)
    x, dy, _ = _inputs(rng, 1, 20, 20, 16, "float32", False)
    layer = MultiHeadAttention(16, 2)
    keep = rng.random((2, 20, 20)) >= 0.2
    cases = [({"need_weights": True}, {}), ({"dropout": 0.2, "dropout_keep": keep}, {}),
             ({"fault_hook": lambda site, c: None}, {}),
             ({}, {"plan": CheckingPlan().with_frequencies({"context": 0.5})})]
    for kw, make in cases:
        layer = MultiHeadAttention(16, 2, **make)
        _, cache = layer.forward(x.astype(layer.dtype), **kw)
        assert layer.last_core == cache["core"] == "unfused", (kw, make)
    bad = x.copy()
    bad[0, 2, 3] = np.inf  # non-finite Q, K and V: the unfused sites pass them through
    layer = MultiHeadAttention(16, 2)
    _, cache = layer.forward(bad)
    assert layer.last_core == "unfused"
    _, cache = layer.forward(x)
    assert layer.last_core == "fused" and cache["probs"] is None
    y, cache = layer.forward(x, need_weights=True)
    assert cache["probs"].shape == (2, 20, 20)


def test_forcing_the_fused_core_where_it_does_not_apply_raises():
    x = np.zeros((1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="dropout_keep"):
        MultiHeadAttention(8, 2, core="fused").forward(x, dropout=0.5,
                                                       dropout_keep=np.ones((2, 4, 4), bool))
    with pytest.raises(ValueError, match="weights"):
        MultiHeadAttention(8, 2, core="fused").forward(x, need_weights=True)
    with pytest.raises(ValueError, match="core must be one of"):
        MultiHeadAttention(8, 2, core="flash")


@pytest.mark.parametrize("site", ["q_proj", "v_proj", "out_proj", "fused:S", "fused:P",
                                  "fused:O_acc", "fused:dS", "fused:dK_acc", "d_context", "d_x",
                                  "d_wq"])
def test_faults_corrected_with_the_fused_core(site):
    """``core="fused"`` with a fault hook: the hook sees the projections' sites and the fused
    core's; every fault is corrected."""
    rng = np.random.default_rng(2)
    x, dy, _ = _inputs(rng, 2, 70, 70, 32, "float32", False)
    layer = MultiHeadAttention(32, 4, causal=True, core="fused")
    _, clean = _step(layer, x, dy)
    fault = Fault("near-inf", "element", seed=3, sites=site)
    ran, got = _step(layer, x, dy, fault_hook=fault)
    assert ran == "fused" and fault.injected
    assert site in layer.step_sites
    for g, c in zip(got, clean):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-6)


def test_the_layers_dv_check_with_dropout_predicts_from_the_forwards_kept_sums(monkeypatch):
    """The layer's passes hand the forward's kept sums to the backward's final check: with
    dropout, ``dV``'s column sums are judged against them (the passes kept them not, and only
    the row check ran)."""
    from attention import fused_final

    calls = []
    judge = fused_final._grad_ratios
    monkeypatch.setattr(fused_final, "_grad_ratios",
                        lambda saved, d_out, dv, sums: calls.append(saved["dropout"]) or
                        judge(saved, d_out, dv, sums))
    rng = np.random.default_rng(4)
    x, dy, _ = _inputs(rng, 2, 70, 70, 32, "float32", False)
    layer = MultiHeadAttention(32, 4, causal=True, core="fused", seed=1)
    ran, _ = _step(layer, x, dy, dropout=0.2, dropout_seed=5)
    assert ran == "fused" and len(calls) == 1 and calls[0][0] == 0.2
    assert layer.last_report.checked["fused:dV_out"] == 1 and not layer.last_report.events


@pytest.mark.parametrize("core", ["auto", "fused"])
@pytest.mark.parametrize("check", ["correct", "detect"])
def test_a_genuine_float16_overflow_passes_through_as_on_the_unfused_core(core, check):
    """float16 gradients past the dtype's range (one key: ``dV`` sums 256 queries' gradients of
    400): the fused core's final check cannot tell that from a fault (it raised
    ``UncorrectableError``, or in detect mode reported a fault). The backward runs again on the
    unfused core, which reports the overflow as passed through, as without the fused core; the
    gradients are the unfused layer's, bit for bit. The bare core likewise."""
    import warnings

    from attention.context import Context
    from attention.core import core_backward, core_forward

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 256, 8)).astype(np.float16)
    kv = rng.standard_normal((1, 1, 8)).astype(np.float16)
    dy = np.full((1, 256, 8), 400.0, np.float16)
    runs = []
    for which in ("unfused", core):
        layer = MultiHeadAttention(8, 1, dtype="float16", core=which)
        _, cache = layer.forward(x, key=kv, value=kv)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dx, grads = layer.backward(dy, cache, check=check)
        report = layer.last_report
        assert not report.detected and ("d_v", "overflow", "passed-through") in {
            (e.site, e.pattern, e.action) for e in report.events}
        runs.append((dx, grads))
    assert np.isinf(runs[0][1]["wv"]).any()
    for a, b in zip(runs[0][0], runs[1][0]):  # the input gradients (query, key, value)
        assert np.array_equal(a, b, equal_nan=True)
    for name in runs[0][1]:
        assert np.array_equal(runs[0][1][name], runs[1][1][name], equal_nan=True), name
    q, k, v, do = x[:, :, :], kv, kv, dy
    for which in ("unfused", core):
        ctx = Context(check=check)
        out, saved = core_forward(q, k, v, ctx, core=which)
        assert saved["core"] == ("unfused" if which == "unfused" else "fused")
        grads = core_backward(saved, do, ctx)
        assert not ctx.report.detected and np.isinf(grads[2]).any()


@pytest.mark.parametrize("site,where", [("q_proj", dict(batch=0, row=0, col=3)),
                                        ("d_context", dict(row=2, col=0))])
def test_a_transient_fault_repaired_by_a_replay_is_reported(site, where):
    """A huge finite value (the top exponent bit flipped once) in a projection the fused core
    reads before the pass settles: the core's checks fail downstream and the pass is replayed,
    each step checked as it runs, where the transient fault is gone. The step equals the clean
    one, and the report says what was found and replayed (it said nothing)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 8)).astype(np.float32)
    dy = rng.standard_normal((2, 6, 8)).astype(np.float32)
    layer = MultiHeadAttention(8, 2, dtype="float32", core="fused")
    y0, cache = layer.forward(x)
    dx0, _ = layer.backward(dy, cache)
    fault = Fault("bitflip", "element", sites=site, bit=30, **where)
    y, cache = layer.forward(x, fault_hook=fault if site == "q_proj" else None)
    dx, _ = layer.backward(dy, cache, fault_hook=fault if site == "d_context" else None)
    assert abs(fault.injected[0].new[0]) > 1e30
    assert np.array_equal(y, y0) and np.allclose(dx, dx0, rtol=1e-5, atol=1e-6)
    events = layer.last_report.events
    assert events and all(e.action == "recomputed" and "replayed" in e.verified for e in events)


@pytest.mark.parametrize("site,seen_at", [("fused:dropout", ("fused:O_acc", "fused:dV_acc")),
                                          ("fused:P", ("fused:P",)), ("fused:dS", ("fused:dS",)),
                                          ("fused:dV_acc", ("fused:dV_acc",))])
def test_faults_corrected_with_dropout_on_the_fused_core(site, seen_at):
    """Dropout (seeded) on the fused core with a fault hook: the dropped tile's fault shows at
    the accumulators that read it; every fault is corrected, the step as without the fault."""
    rng = np.random.default_rng(3)
    x, dy, _ = _inputs(rng, 2, 70, 70, 32, "float32", False)
    layer = MultiHeadAttention(32, 4, causal=True, core="fused")
    kw = {"dropout": 0.3, "dropout_seed": 12}
    _, clean = _step(layer, x, dy, **kw)
    fault = Fault("near-inf", "element", seed=3, sites=site)
    ran, got = _step(layer, x, dy, fault_hook=fault, **kw)
    assert ran == "fused" and fault.injected
    assert layer.step_sites & set(seen_at), layer.step_sites
    for g, c in zip(got, clean):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-6)


def test_non_finite_gradient_passes_through_after_the_fused_forward():
    rng = np.random.default_rng(4)
    x, dy, _ = _inputs(rng, 1, 24, 24, 16, "float32", False)
    dy[0, 5, 2] = np.nan
    want = _step(MultiHeadAttention(16, 2, core="unfused"), x, dy)[1]
    ran, got = _step(MultiHeadAttention(16, 2), x, dy)
    assert ran == "fused"
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_non_finite_gradient_after_a_fused_forward_with_dropout_keeps_its_decisions():
    """The unfused backward that takes a non-finite gradient drops what the fused forward
    dropped (the seed's keep decisions, materialized)."""
    rng = np.random.default_rng(5)
    x, dy, _ = _inputs(rng, 1, 24, 24, 16, "float32", False)
    dy[0, 5, 2] = np.nan
    keep = keep_mask(21, 0.4, (2, 24, 24))
    want = _step(MultiHeadAttention(16, 2, core="unfused"), x, dy, dropout=0.4,
                 dropout_keep=keep)[1]
    ran, got = _step(MultiHeadAttention(16, 2), x, dy, dropout=0.4, dropout_seed=21)
    assert ran == "fused"
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_torch_module_runs_the_fused_core_and_says_so():
    torch = pytest.importorskip("torch")
    from attention.torch import MultiheadAttention

    torch.manual_seed(0)
    stock = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 40, 32)
    mask = torch.randn(40, 40)
    results = {}
    for core in ("auto", "unfused"):
        mine = MultiheadAttention.from_torch(stock, core=core)
        xi = x.clone().requires_grad_(True)
        y, weights = mine(xi, xi, xi, need_weights=False, attn_mask=mask)
        assert weights is None
        assert mine.last_core == ("fused" if core == "auto" else "unfused")
        y.square().sum().backward()
        results[core] = (y.detach(), xi.grad, mine.in_proj_weight.grad.clone())
        mine.zero_grad()
    for got, want in zip(results["auto"], results["unfused"]):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    want = stock(x, x, x, need_weights=False, attn_mask=mask)[0]
    torch.testing.assert_close(results["auto"][0], want, rtol=1e-4, atol=1e-5)
    mine = MultiheadAttention.from_torch(stock)
    mine(x, x, x, need_weights=True)
    assert mine.last_core == "unfused"
