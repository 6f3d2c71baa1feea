"""A float attention mask that requires grad (a learned position bias: T5's, a trained ALiBi)
gets its gradient through ``attention_core``, as PyTorch's attention gives it: the unfused core
runs and hands back its checked ``dS``, summed over whatever the mask broadcasts over. Eager and
compiled calls agree; ``core="fused"``, which forms no ``dS``, refuses it."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")

from attention.torch_functional import Protection, attention_core  # noqa: E402

B, H, L, D = 2, 3, 9, 8
SHAPES = {"shared": (L, L), "per-item": (B, 1, L, L), "per-head": (B, H, L, L)}


def _inputs(shape):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    bias = torch.randn(shape, generator=gen, dtype=torch.float64)
    bias[..., 1] = -math.inf  # a hidden key: gradient 0
    return q, k, v, bias.requires_grad_()


def _grads(run, q, k, v, bias):
    out = run(q, k, v, bias)
    weight = torch.linspace(-1, 1, D, dtype=out.dtype)
    return (out.detach(), *torch.autograd.grad((out * weight).sum(), (q, k, v, bias)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_the_bias_gradient_equals_pytorchs(shape, causal):
    q, k, v, bias = _inputs(SHAPES[shape])
    protection = Protection()
    got = _grads(lambda *t: attention_core(*t[:3], protection=protection, attn_mask=t[3],
                                           is_causal=causal)[0], q, k, v, bias)
    after = torch.full((L, L), -math.inf, dtype=torch.float64).triu(1)
    want = _grads(lambda *t: torch.nn.functional.scaled_dot_product_attention(
        *t[:3], attn_mask=t[3] + after if causal else t[3]), q, k, v, bias)
    assert protection.last_core == "unfused"
    assert protection.last_report.checked and not protection.last_report.detected
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    assert torch.all(got[4][..., 1] == 0)


def test_compiled_calls_give_the_eager_gradient():
    q, k, v, bias = _inputs(SHAPES["per-item"])
    protection = Protection()

    def run(q, k, v, bias):
        return attention_core(q, k, v, protection=protection, attn_mask=bias)[0]

    eager = _grads(run, q, k, v, bias)
    compiled = _grads(torch.compile(run, backend="aot_eager", fullgraph=True), q, k, v, bias)
    for g, w in zip(compiled, eager):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_fused_core_refuses_a_bias_that_wants_its_gradient():
    q, k, v, bias = _inputs(SHAPES["shared"])
    with pytest.raises(ValueError, match="cannot return the gradient of attn_mask"):
        attention_core(q, k, v, protection=Protection(), attn_mask=bias, core="fused")
    with torch.no_grad():  # no gradient wanted: the fused core takes the mask
        protection = Protection()
        attention_core(q, k, v, protection=protection, attn_mask=bias, core="fused")
    assert protection.last_core == "fused"
