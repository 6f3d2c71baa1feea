"""Attention sinks (gpt-oss's learned logit per head, joined to every query's softmax): the
product, its weights and the gradients of query, key, value and the sinks equal float64 math on
both cores, in every form a mask reaches the core (key visibility stays ``O(L)``); a fault in
the product that makes the sinks' gradient is corrected; bad sinks raise and change nothing."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")

from abftgemm.faults import Fault  # noqa: E402
from attention import _torch_core_op  # noqa: E402
from attention.torch_functional import Protection, attention_core  # noqa: E402

B, H, L, D = 2, 3, 37, 16
MASKS = ("none", "causal", "padding", "padded-causal", "bool", "float", "one-query")


def _case(kind, dtype=torch.float64):
    """``(q, k, v, sinks, mask, causal)``: ``mask`` in the caller's convention (True = not
    allowed, float added); ``one-query`` is a decoding step (one query, a float mask)."""
    gen = torch.Generator().manual_seed(3)
    seq_q = 1 if kind == "one-query" else L
    q = torch.randn(B, H, seq_q, D, generator=gen, dtype=dtype)
    k, v = (torch.randn(B, H, L, D, generator=gen, dtype=dtype) for _ in range(2))
    sinks = 2 * torch.randn(H, generator=gen, dtype=dtype)
    hidden = torch.zeros(B, 1, 1, L, dtype=torch.bool)
    hidden[1, ..., 29:] = True  # item 1 padded
    after = torch.ones(L, L, dtype=torch.bool).triu(1)
    mask = {"none": None, "causal": None, "padding": hidden.expand(B, 1, L, L),
            "padded-causal": hidden | after,
            "bool": torch.rand(B, H, L, L, generator=gen) < 0.3,
            "float": torch.randn(B, 1, L, L, generator=gen, dtype=dtype),
            "one-query": torch.randn(B, 1, 1, L, generator=gen, dtype=dtype)}[kind]
    return [t.requires_grad_() for t in (q, k, v, sinks)] + [mask, kind == "causal"]


def _reference(q, k, v, sinks, mask, causal):
    """gpt-oss's eager attention in float64: the sink's logit joins each row of the scores in
    the softmax, and its probability is dropped."""
    z = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
    if causal:
        z = z.masked_fill(torch.ones(z.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    if mask is not None:
        z = z.masked_fill(mask, -math.inf) if mask.dtype == torch.bool else z + mask.double()
    sink = sinks.double().reshape(1, -1, 1, 1).expand(*z.shape[:-1], 1)
    p = torch.softmax(torch.cat([z, sink], dim=-1), dim=-1)[..., :-1]
    return p @ v.double(), p


def _grads(out, inputs):
    weight = torch.linspace(-1, 1, D, dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), inputs)


@pytest.mark.parametrize("core", ["fused", "unfused"])
@pytest.mark.parametrize("kind", MASKS)
def test_equals_float64_math_with_its_gradients(kind, core):
    q, k, v, sinks, mask, causal = _case(kind)
    protection = Protection()
    out, weights = attention_core(q, k, v, protection=protection, attn_mask=mask,
                                  is_causal=causal, need_weights=core == "unfused", core=core,
                                  sinks=sinks)
    want, probs = _reference(q, k, v, sinks, mask, causal)
    assert protection.last_core == core
    assert protection.last_report.checked and not protection.last_report.events
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    if core == "unfused":
        assert weights.shape == probs.shape
        torch.testing.assert_close(weights, probs, rtol=0, atol=1e-13)
    got = _grads(out, (q, k, v, sinks))
    assert sinks.grad is None and got[3].abs().max() > 1e-3  # the sinks' gradient matters here
    for g, w in zip(got, _grads(want, (q, k, v, sinks))):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


@pytest.mark.parametrize("core", ["fused", "unfused"])
@pytest.mark.parametrize("kind", MASKS)
def test_a_head_without_a_sink(kind, core):
    """A ``-inf`` sink is no sink: the head's product is plain attention, its sink's gradient
    0, every gradient finite, no finding (the sink key is hidden, not an INF in ``k``)."""
    q, k, v, sinks, mask, causal = _case(kind)
    with torch.no_grad():
        sinks[0] = -math.inf
    protection = Protection()
    out, _ = attention_core(q, k, v, protection=protection, attn_mask=mask, is_causal=causal,
                            core=core, sinks=sinks)
    want, _ = _reference(q, k, v, sinks, mask, causal)
    assert protection.last_core == core and not protection.last_report.events
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    got = _grads(out, (q, k, v, sinks))
    assert got[3][0] == 0
    for g, w in zip(got, _grads(want, (q, k, v, sinks))):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


def test_a_sink_below_the_dtypes_range_is_no_sink_and_above_it_raises():
    """float16: ``s / scale`` of -20000 overflows to ``-inf`` (the sink weighs nothing, as in
    float64); of +20000, or a NaN or ``+inf`` sink, raises."""
    q, k, v = (t.detach().half() for t in _case("none")[:3])
    sinks = torch.tensor([-20000.0, 0.5, 1.0], dtype=torch.float16)
    out, _ = attention_core(q, k, v, protection=Protection(), sinks=sinks)
    want, _ = _reference(q, k, v, sinks, None, False)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-3)
    for bad in (20000.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="sinks must be finite or -inf"):
            attention_core(q, k, v, protection=Protection(),
                           sinks=torch.tensor([bad, 0.5, 1.0], dtype=torch.float16))


def test_float32_on_the_fused_core_within_its_rounding():
    q, k, v, sinks, mask, causal = _case("padded-causal", torch.float32)
    protection = Protection()
    out, _ = attention_core(q, k, v, protection=protection, attn_mask=mask, sinks=sinks)
    want, _ = _reference(q, k, v, sinks, mask, causal)
    assert protection.last_core == "fused" and not protection.last_report.events
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    for g, w in zip(_grads(out, (q, k, v, sinks)), _grads(want, (q, k, v, sinks))):
        torch.testing.assert_close(g.double(), w.double(), rtol=0,
                                   atol=1e-4 * w.abs().max().item())


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_padding_reaches_the_core_per_key(kind, monkeypatch):
    """A padded causal batch's mask stays O(L) with the sink: ``(n, 1, S + 1)``, causal (a float
    one, ``-inf`` where the boolean hides, the same; and equal to float64 math)."""
    seen = []
    apply = _torch_core_op.apply_core

    def spy(protection, q, k, v, mask, *rest):
        seen.append((None if mask is None else tuple(mask.shape), rest[1]))
        return apply(protection, q, k, v, mask, *rest)

    monkeypatch.setattr(_torch_core_op, "apply_core", spy)
    q, k, v, sinks, mask, _ = _case("padded-causal")
    if kind == "float":
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(mask, -math.inf)
    out, _ = attention_core(q, k, v, protection=Protection(), attn_mask=mask, sinks=sinks)
    assert seen == [((B * H, 1, L + 1), True)]
    torch.testing.assert_close(out, _reference(q, k, v, sinks, mask, False)[0], rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize("site", ["scores", "d_k"])
def test_a_fault_in_the_product_is_corrected(site):
    """``d_k`` holds the sinks' gradient (the sink key's last entry): a NaN there, or in the
    scores, is repaired, and the step equals the fault-free one."""
    q, k, v, sinks, mask, _ = _case("padding")
    clean = Protection()
    out = attention_core(q, k, v, protection=clean, attn_mask=mask, core="unfused",
                         sinks=sinks)[0]
    want = (out, *_grads(out, (q, k, v, sinks)))
    faulty = Protection(fault_hook=Fault("nan", "row", seed=1, sites=site, row=0))
    out = attention_core(q, k, v, protection=faulty, attn_mask=mask, core="unfused",
                         sinks=sinks)[0]
    got = (out, *_grads(out, (q, k, v, sinks)))
    assert faulty.fault_hook.injected and site in faulty.last_report.sites
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_bad_sinks_raise():
    q, k, v = _case("none")[:3]
    for sinks, error, match in [(torch.zeros(H + 1), ValueError, "does not broadcast"),
                                (torch.zeros(H, dtype=torch.int64), TypeError, "float")]:
        with pytest.raises(error, match=match):
            attention_core(q, k, v, protection=Protection(), sinks=sinks)
    with pytest.raises(ValueError, match="non-zero scale"):
        attention_core(q, k, v, protection=Protection(), scale=0.0, sinks=torch.zeros(H))
    with pytest.raises(ValueError, match=r"seq_q == seq_k \(got 37 and 36\)"):
        attention_core(q, k[..., 1:, :], v[..., 1:, :], protection=Protection(), is_causal=True,
                       sinks=torch.zeros(H))


@pytest.mark.parametrize("kind", ["float", "none"])
@pytest.mark.parametrize("no_sink", [False, True])
def test_compiled_calls_give_the_eager_gradient(kind, no_sink):
    """Compiled whole (``fullgraph``), where no value may be read: every head's sink column is
    in the mask, hidden where the sink is ``-inf``."""
    q, k, v, sinks, mask, causal = _case(kind)
    if no_sink:
        with torch.no_grad():
            sinks[1] = -math.inf
    protection = Protection()

    def run(q, k, v, sinks):
        return attention_core(q, k, v, protection=protection, attn_mask=mask, is_causal=causal,
                              sinks=sinks)[0]

    eager = _grads(run(q, k, v, sinks), (q, k, v, sinks))
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    for g, w in zip(_grads(compiled(q, k, v, sinks), (q, k, v, sinks)), eager):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-14)
