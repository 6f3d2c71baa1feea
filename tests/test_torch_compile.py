"""attention.torch under torch.compile (the core as one opaque custom operator) and copied or
saved after a forward (deepcopy, torch.save, AveragedModel)."""
from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from attention.torch import MultiheadAttention, protect  # noqa: E402


def encoder(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return protect(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and parameter gradients of one forward and backward."""
    model.zero_grad(set_to_none=True)
    y = model(x, is_causal=True, mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 rounding of the compiled elementwise parts (fused by inductor)."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.abs().max())))


def test_compiled_encoder_matches_eager_outputs_and_gradients():
    model, x = encoder(), torch.randn(3, 12, 32)
    y, grads = step(model, x)
    compiled = torch.compile(model, fullgraph=True)
    for _ in range(2):  # the second call runs the cached compiled graph
        yc, grads_c = step(compiled, x)
        assert close(yc, y)
        assert len(grads_c) == len(grads) and all(close(g, h) for g, h in zip(grads_c, grads))


def test_the_protected_core_is_one_opaque_node_of_the_graph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, x = encoder(), torch.randn(2, 8, 32)
    y, _ = step(model, x)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x, is_causal=True, mask=nn.Transformer
                                .generate_square_subsequent_mask(8)), y)
    (graph,) = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert sum("abftgemm.mha_forward" in t for t in targets) == 2  # one node per layer
    assert not any("numpy" in t for t in targets)


def test_a_compiled_call_with_a_bad_mask_raises_the_eager_error():
    """The masks checked before the dropout's draw are not checked while the compiler traces
    (a raise there stops it with ``Unsupported``): the operator refuses them, as eager."""
    module = MultiheadAttention(8, 2, batch_first=True, dropout=0.5)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        compiled(x, x, x, attn_mask=torch.zeros(5, 6, dtype=torch.bool))


def test_the_compiled_module_still_corrects_a_fault():
    model, x = encoder(), torch.randn(2, 8, 32)
    y, grads = step(model, x)
    attn = model.layers[0].self_attn
    attn.fault_hook = lambda site, c: c.reshape(-1).__setitem__(5, 1e30) \
        if site == "scores" else None
    yc, grads_c = step(torch.compile(model, fullgraph=True), x)
    assert attn.last_report.corrected and close(yc, y)
    assert all(close(g, h) for g, h in zip(grads_c, grads))


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_module_copied_after_a_forward_runs_and_is_independent(how):
    model, x = encoder(), torch.randn(2, 8, 32)
    y, grads = step(model, x)
    if how == "deepcopy":
        other = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        other = torch.load(buf, weights_only=False)
    y2, grads2 = step(other, x)
    assert torch.equal(y2, y) and all(torch.equal(g, h) for g, h in zip(grads2, grads))
    a, b = model.layers[0].self_attn, other.layers[0].self_attn
    assert isinstance(b, MultiheadAttention) and a.protection.id != b.protection.id
    with torch.no_grad():
        b.in_proj_weight.mul_(2)
    assert torch.equal(step(model, x)[0], y)  # the original keeps its own weights and caches


def test_averaged_model_of_a_trained_module():
    model, x = encoder(), torch.randn(2, 8, 32)
    step(model, x)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    ema.update_parameters(model)
    assert torch.equal(step(ema.module, x)[0], step(model, x)[0])


def test_backward_reads_the_saved_inputs_so_changing_them_in_place_is_caught():
    # the backward reads the forward's input through autograd's saved tensors (a compiled graph
    # would otherwise reuse its memory once the forward is done, as inductor did)
    module = MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    h = x * 1
    y, _ = module(h, h, h, need_weights=False)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_the_core_backward_reads_its_saved_output_so_changing_it_in_place_is_caught():
    """The fused core's backward reads its output O (``D = rowsum(dO * O)``, its final
    checks) through autograd's saved tensors: changing O in place after the forward is an
    error, not a wrong gradient."""
    from attention.torch_functional import Protection, attention_core

    q, k, v = (torch.randn(2, 6, 8, requires_grad=True) for _ in range(3))
    protection = Protection()
    out, _ = attention_core(q, k, v, protection=protection)
    assert protection.last_core == "fused"
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_the_unfused_core_keeps_no_output_so_changing_it_in_place_is_fine():
    """The unfused core's backward does not read its output: an in-place change of it after the
    forward trains as PyTorch's own attention does."""
    from attention.torch_functional import Protection, attention_core

    q, k, v = (torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, _ = attention_core(q, k, v, protection=Protection(), core="unfused")
    out.mul_(2)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    want = torch.autograd.grad(2 * ref.sum(), (q, k, v))
    assert all(torch.allclose(g, w, rtol=1e-10, atol=1e-12) for g, w in zip(got, want))


@pytest.mark.parametrize("core", ["auto", "unfused"])
def test_the_backward_reads_the_forwards_mask_whatever_happens_to_it(core):
    """A float64 ``attn_mask`` changed in place after the forward: the gradients are the
    forward's, as ``scaled_dot_product_attention``'s (the core held a view of the mask; the
    fused backward read the new values and raised a false fault)."""
    from attention.torch_functional import Protection, attention_core

    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.randn(6, 6, dtype=torch.float64)
    want = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask).sum(), (q, k, v))
    out, _ = attention_core(q, k, v, protection=Protection(), attn_mask=mask, core=core)
    mask.fill_(0.0)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.allclose(g, w, rtol=1e-10, atol=1e-12) for g, w in zip(got, want))


def _compiled_against_eager(f, bias=False):
    """``f``'s outputs and gradients in q, k, v, eager against inductor-compiled (twice: the
    cached graph too), with the eager run's dropout masks."""
    import torch._inductor.config as inductor

    def grads(fn):
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 8, 8, dtype=torch.float64, requires_grad=True)
                   for _ in range(3))
        extra = (torch.randn(8, 8, dtype=torch.float64),) if bias else ()
        torch.manual_seed(7)
        outs = fn(q, k, v, *extra)
        weights = torch.arange(outs[0].numel(), dtype=outs[0].dtype).view_as(outs[0]).cos()
        return (*outs, *torch.autograd.grad((outs[0] * weights).sum(), (q, k, v)))

    want = grads(f)
    with inductor.patch(fallback_random=True):
        compiled = torch.compile(f)
        for _ in range(2):
            got = grads(compiled)
            assert all(torch.allclose(g, w, rtol=1e-10, atol=1e-12) for g, w in zip(got, want))


def test_inductor_keeps_the_float64_mask_the_fused_backward_reads():
    """A float64 mask made inside a compiled function is a graph buffer that inductor reused
    once the forward was done (a false fault at fused:dV_out, or gradients off by 1e10 with
    check="off"): the core copies it."""
    from attention.torch_functional import Protection, attention_core

    protection = Protection()

    def f(q, k, v, bias):
        mask = bias * 2.0
        out, _ = attention_core(q, k, v, protection=protection, attn_mask=mask)
        return out, bias * out.sum()  # a later buffer of the mask's size

    _compiled_against_eager(f, bias=True)
    assert protection.last_core == "fused"


def test_inductor_keeps_the_dropout_mask_the_unfused_backward_reads():
    """The unfused core's dropout keep mask, drawn in the compiled graph, was reused for the
    next call's (dq off by 1.0): the core copies it."""
    from attention.torch_functional import Protection, attention_core

    first, second = Protection(), Protection()

    def f(q, k, v):
        out, _ = attention_core(q, k, v, protection=first, dropout_p=0.5, core="unfused")
        out, _ = attention_core(out, k, v, protection=second, dropout_p=0.5, core="unfused")
        return (out,)

    _compiled_against_eager(f)
