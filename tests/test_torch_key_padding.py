"""Boolean attention masks that are key padding (the same keys hidden from every query, with or
without the causal triangle: Hugging Face's masks of padded batches) reach the attention core as
``key_visible``, an ``O(L)`` mask, instead of an ``L x S`` one, and give the same results as
PyTorch's attention with the full mask."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")

from attention import _torch_core_op  # noqa: E402
from attention.torch_functional import Protection, attention_core  # noqa: E402

B, H, L, D = 3, 2, 20, 8


@pytest.fixture
def core_calls(monkeypatch):
    """The masks each call hands the core: ``(attn_mask shape or None, key_visible shape or
    None, causal)``."""
    calls = []
    real = _torch_core_op.core_forward

    def spy(q, k, v, ctx, **kw):
        mask, visible = kw.get("attn_mask"), kw.get("key_visible")
        calls.append((None if mask is None else mask.shape,
                      None if visible is None else visible.shape, kw["causal"]))
        return real(q, k, v, ctx, **kw)

    monkeypatch.setattr(_torch_core_op, "core_forward", spy)
    return calls


def _padding(lengths: list[int]) -> torch.Tensor:
    """(B, 1, 1, L) bool, True = NOT allowed: keys at or after each item's length."""
    return (torch.arange(L) >= torch.tensor(lengths)[:, None])[:, None, None, :]


def _after() -> torch.Tensor:
    return torch.ones(L, L, dtype=torch.bool).triu(1)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, D, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(3)]


def _run(mask, causal, core="auto"):
    q, k, v = _inputs()
    protection = Protection()
    out, _ = attention_core(q, k, v, protection=protection, attn_mask=mask, is_causal=causal,
                            core=core)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, D, dtype=out.dtype)).sum(),
                                (q, k, v))
    return out, grads, protection


def _reference(hidden):
    """PyTorch's attention with the full mask (True = NOT allowed); rows that see no key give 0
    and no gradient, as the core's."""
    q, k, v = _inputs()
    allowed = ~hidden.expand(B, H, L, L)
    sees = allowed.any(-1, keepdim=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~sees)
    out = out * sees
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, D, dtype=out.dtype)).sum(),
                                (q, k, v))
    return out, grads


KINDS = {  # name: (mask given, is_causal given, the full mask it means)
    "padding (B, 1, 1, S)": (lambda: _padding([20, 13, 0]), False,
                             lambda: _padding([20, 13, 0])),
    "padding expanded (B, 1, L, S)": (lambda: _padding([20, 13, 5]).expand(B, 1, L, L), False,
                                      lambda: _padding([20, 13, 5])),
    "padding and causal triangle": (lambda: _padding([20, 13, 5]) | _after(), False,
                                    lambda: _padding([20, 13, 5]) | _after()),
    "padding with is_causal": (lambda: _padding([20, 13, 5]), True,
                               lambda: _padding([20, 13, 5]) | _after()),
    "left padding and causal triangle": (
        lambda: (torch.arange(L) < torch.tensor([0, 4, 9])[:, None])[:, None, None, :] | _after(),
        False,
        lambda: (torch.arange(L) < torch.tensor([0, 4, 9])[:, None])[:, None, None, :] | _after()),
}


@pytest.mark.parametrize("core", ["auto", "unfused"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_key_padding_runs_as_key_visibility_and_equals_the_full_mask(kind, core, core_calls):
    given, causal, meant = KINDS[kind]
    out, grads, protection = _run(given(), causal, core)
    assert core_calls == [(None, (B * H, L), causal or "causal" in kind)]
    assert protection.last_core == ("fused" if core == "auto" else "unfused")
    assert not protection.last_report.events
    want_out, want_grads = _reference(meant())
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_other_boolean_masks_stay_full(core_calls):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.rand(B, 1, L, L, generator=gen) > 0.6
    hidden[..., 0] = False
    out, grads, _ = _run(hidden, False)
    want_out, want_grads = _reference(hidden)
    assert core_calls == [((B * H, L, L), None, False)]
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    # the causal triangle with one more key hidden from one query (not from every later one)
    core_calls.clear()
    almost = _after() | _padding([20, 13, 5])
    almost[1, 0, 7, 2] = True
    out, _, _ = _run(almost, False)
    assert core_calls == [((B * H, L, L), None, False)]
    torch.testing.assert_close(out, _reference(almost)[0], rtol=1e-12, atol=1e-12)


def test_compiled_calls_take_the_mask_whole_and_equal_eager(core_calls):
    # comparing the mask's values is data-dependent under torch.compile: the compiled graph
    # hands the mask on whole, for padding and other masks alike, with no graph break
    protection = Protection()

    def product(q, k, v, mask):
        return attention_core(q, k, v, protection=protection, attn_mask=mask)[0]

    compiled = torch.compile(product, backend="aot_eager", fullgraph=True)
    q, k, v = _inputs()
    gen = torch.Generator().manual_seed(2)
    other = torch.rand(B, 1, L, L, generator=gen) > 0.6
    for mask in (_padding([20, 13, 5]).expand(B, 1, L, L), other):
        core_calls.clear()
        got = compiled(q, k, v, mask)
        assert core_calls == [((B * H, L, L), None, False)]
        torch.testing.assert_close(got, product(q, k, v, mask), rtol=1e-12, atol=1e-12)
    explained = torch._dynamo.explain(product)(q, k, v, other)
    assert explained.graph_break_count == 0


@pytest.mark.parametrize("mask_shape", [(0, 4), (2, 0, 4)])
def test_a_boolean_mask_over_no_query_is_taken(mask_shape):
    """A boolean ``attn_mask`` over an empty query sequence: the output is empty, as PyTorch's
    ``scaled_dot_product_attention`` gives it (the mask's last query row is empty, and ``torch.
    equal`` of empty tensors is True, so the mask read as key padding of 0 rows and its
    expansion raised)."""
    q = torch.randn(2, 0, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.zeros(mask_shape, dtype=torch.bool)
    out, _ = attention_core(q, k, v, protection=Protection(), attn_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~mask)
    assert out.shape == expected.shape == (2, 0, 4)
    out.sum().backward()
    assert k.grad is not None and torch.count_nonzero(k.grad) == 0
