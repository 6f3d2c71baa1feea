"""The eager path of the protected PyTorch products (attention._torch_arrays.eager,
attention._torch_linear_op.apply_linear, attention._torch_core_op.apply_core) against their custom
operators."""
import pytest

torch = pytest.importorskip("torch")

from attention import _torch_arrays, _torch_core_op, _torch_linear_op  # noqa: E402
from attention.torch_core import ProtectedCore  # noqa: E402
from attention.torch_linear import ProtectedLinearCore  # noqa: E402


def _run_linear(core, x, w, b):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = core(x, w, b, weight_in_out=False)
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [y.detach(), x.grad, w.grad, b.grad]


def _run_core(core, q, k, v, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, weights = core(q, k, v, is_causal=causal, need_weights=True)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return [out.detach(), weights, q.grad, k.grad, v.grad]


def test_eager_path_equals_the_custom_operators(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((2, 5, 12), (7, 12), (7,)))
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen) for _ in range(3))
    linear, core = ProtectedLinearCore(), ProtectedCore()
    eager = [_run_linear(linear, x, w, b)] + [_run_core(core, q, k, v, c) for c in (False, True)]
    assert linear.last_report.checked and core.last_report.checked
    monkeypatch.setattr(_torch_linear_op, "eager", lambda *t: False)
    monkeypatch.setattr(_torch_core_op, "eager", lambda *t: False)
    ops = [_run_linear(linear, x, w, b)] + [_run_core(core, q, k, v, c) for c in (False, True)]
    for mine, theirs in zip(eager, ops):
        for a, b_ in zip(mine, theirs):
            assert torch.equal(a, b_)


def test_eager_only_on_plain_tensors():
    t = torch.ones(2)
    assert _torch_arrays.eager(t, torch.nn.Parameter(t), None)
    assert not _torch_arrays.eager(t, torch.ones(2, device="meta"))


@pytest.mark.parametrize("loss", ["quadratic", "linear"])
def test_eager_backward_refuses_create_graph(loss):
    """``create_graph=True`` through the eager paths raises at once, naming it, for the linear
    layer, the attention core and the multi-head module: with a loss linear in the output, the
    gradient came back without a graph, and a gradient penalty trained on the first-order
    gradient alone (the module raised PyTorch's "no autograd formula" error, and only when the
    first gradient was differentiated)."""
    from attention.torch import MultiheadAttention
    from attention.torch_functional import Protection, attention_core

    x = torch.randn(4, 6, requires_grad=True)
    w, b = torch.randn(3, 6, requires_grad=True), torch.randn(3, requires_grad=True)
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    e = torch.randn(2, 3, 8, requires_grad=True)
    outputs = (ProtectedLinearCore()(x, w, b, weight_in_out=False),
               attention_core(q, q, q, protection=Protection())[0],
               MultiheadAttention(8, 2, batch_first=True)(e, e, e)[0])
    for y, wrt in zip(outputs, (x, q, e)):
        value = y.pow(2).sum() if loss == "quadratic" else y.sum()
        with pytest.raises(RuntimeError, match="second-order gradients"):
            torch.autograd.grad(value, wrt, create_graph=True)


def test_empty_shapes_run_as_torchs():
    """What PyTorch's functions take with a zero-sized dimension: an empty batch of the
    attention core (it raised a reshape error), and a linear layer without input features
    (the product of nothing: zeros, or the bias; gradients of zero size); a 1-D weight is
    refused by name (it failed to unpack)."""
    from attention.torch_functional import Protection, attention_core

    q = torch.randn(0, 2, 4, 8, requires_grad=True)
    out, _ = attention_core(q, q, q, protection=Protection())
    assert out.shape == (0, 2, 4, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape
    x = torch.randn(3, 0, requires_grad=True)
    w, b = torch.randn(5, 0, requires_grad=True), torch.randn(5, requires_grad=True)
    linear = ProtectedLinearCore()
    for bias in (None, b):
        y = linear(x, w, bias, weight_in_out=False)
        assert torch.equal(y, torch.nn.functional.linear(x, w, bias))
        y.sum().backward()
    assert x.grad.shape == (3, 0) and w.grad.shape == (5, 0)
    assert torch.equal(b.grad, torch.full((5,), 3.0))
    with pytest.raises(ValueError, match="2-D weight"):
        linear(torch.randn(3, 4), torch.randn(4), None, weight_in_out=False)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_calls_on_either_core_share_a_protection(reentrant):
    """One Protection for two calls of a checkpointed function, the first on the unfused core
    (weights asked for), the second on the fused one, and a fault hook set for the backward
    alone (its recomputation runs unfused): the gradients equal the uncheckpointed ones
    (non-reentrant checkpointing raised CheckpointError where a recomputation saved other
    tensors than its forward)."""
    from torch.utils.checkpoint import checkpoint

    from attention.torch_functional import Protection, attention_core

    protection = Protection()
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))

    def two(q, k, v):
        a, _ = attention_core(q, k, v, protection=protection, need_weights=True)
        return attention_core(a, k, v, protection=protection)[0]

    def grads(fn, checkpointed, hook_in_backward=False):
        for t in (q, k, v):
            t.grad = None
        y = checkpoint(fn, q, k, v, use_reentrant=reentrant) if checkpointed else fn(q, k, v)
        protection.fault_hook = (lambda site, c: None) if hook_in_backward else None
        y.sum().backward()
        protection.fault_hook = None
        return [t.grad.clone() for t in (q, k, v)]

    for fn, hooked in ((two, False), (lambda q, k, v: attention_core(
            q, k, v, protection=protection)[0], True)):
        for got, want in zip(grads(fn, True, hooked), grads(fn, False)):
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
