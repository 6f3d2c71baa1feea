"""``attention.torch_functional.attention_core`` under ``torch.autocast``: like PyTorch's
``scaled_dot_product_attention`` it casts query, key and value to the autocast dtype, so inputs
of mixed dtypes (Llama's rotary positions make float32 queries and keys beside 16-bit values)
run in that dtype; outside autocast mixed dtypes stay an error. The protected
``MultiheadAttention`` runs in the autocast dtype as ``nn.MultiheadAttention`` does."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")

from attention.torch_functional import Protection, attention_core  # noqa: E402

B, H, L, D = 2, 3, 10, 16


def _inputs(dtypes):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, D, generator=gen).to(dt).requires_grad_() for dt in dtypes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mixed_dtypes_run_in_the_autocast_dtype_as_sdpa(dtype):
    q, k, v = _inputs((torch.float32, torch.float32, dtype))
    with torch.autocast("cpu", dtype=dtype):
        if not torch.is_autocast_enabled("cpu"):
            pytest.skip(f"this PyTorch has no CPU autocast to {dtype}")
        out, _ = attention_core(q, k, v, protection=Protection(), is_causal=True)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == want.dtype == dtype
    # both round the products and the output to dtype, in different orders: a few roundoffs
    # of the largest element
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    scale = want.abs().max().item()
    assert (out.float() - want.float()).abs().max().item() <= 4 * u * scale
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, dtype]
    assert all(torch.isfinite(g).all() for g in grads)


def test_mixed_dtypes_without_autocast_are_refused():
    q, k, v = _inputs((torch.float32, torch.float32, torch.float64))
    with pytest.raises(TypeError, match="one dtype"):
        attention_core(q, k, v, protection=Protection())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_multihead_attention_runs_in_the_autocast_dtype_as_torchs(dtype):
    from attention.torch import MultiheadAttention

    torch.manual_seed(0)
    stock = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    mine = MultiheadAttention.from_torch(stock)
    x = torch.randn(2, L, 32, requires_grad=True)
    runs = []
    for module in (stock, mine):
        with torch.autocast("cpu", dtype=dtype):
            if not torch.is_autocast_enabled("cpu"):
                pytest.skip(f"this PyTorch has no CPU autocast to {dtype}")
            y, w = module(x, x, x)
        assert y.dtype == w.dtype == dtype
        (dx,) = torch.autograd.grad(y.float().sum(), (x,))
        runs.append((y.float(), dx))
    # both round the projections, products and outputs to dtype, in different orders: a few
    # roundoffs of the largest element, compounded over the chain of products
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for got, want in zip(runs[1], runs[0]):
        assert (got - want).abs().max().item() <= 16 * u * want.abs().max().item()



def test_float64_stays_float64_under_autocast_as_in_torch():
    """Autocast never casts float64 tensors (PyTorch's ops leave them): the attention core, the
    protected ``MultiheadAttention`` and a protected linear product of float64 data under
    autocast run in float64, equal to PyTorch's to float64 rounding (they ran in bfloat16)."""
    from attention.torch import MultiheadAttention
    from attention.torch_linear import ProtectedLinearCore

    q, k, v = _inputs((torch.float64,) * 3)
    torch.manual_seed(0)
    stock = torch.nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    mine = MultiheadAttention.from_torch(stock)
    x = torch.randn(2, L, 32, dtype=torch.float64)
    w = torch.randn(24, 32, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if not torch.is_autocast_enabled("cpu"):
            pytest.skip("this PyTorch has no CPU autocast")
        pairs = [(attention_core(q, k, v, protection=Protection(), is_causal=True)[0],
                  torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
                 (mine(x, x, x)[0], stock(x, x, x)[0]),
                 (ProtectedLinearCore()(x, w, None, False), torch.nn.functional.linear(x, w))]
    for got, want in pairs:
        assert got.dtype == want.dtype == torch.float64
        assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item()


def test_layers_on_the_meta_device_compute_shapes_as_torchs():
    """On ``meta`` tensors (shape inference, models built under accelerate's
    ``init_empty_weights``) the protected linear layer and attention give the shapes PyTorch's
    give, forward and backward: not ``torch.is_autocast_enabled``'s "unknown device type for
    autocast" (autocast knows no meta device)."""
    from attention.torch import MultiheadAttention
    from attention.torch_linear import ProtectedLinearCore

    weight = torch.ones(3, 5, device="meta", requires_grad=True)
    bias = torch.ones(3, device="meta", requires_grad=True)
    x = torch.ones(2, 4, 5, device="meta", requires_grad=True)
    y = ProtectedLinearCore()(x, weight, bias, weight_in_out=False)
    assert y.device.type == "meta" and y.shape == (2, 4, 3)
    y.sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape
    assert bias.grad.shape == bias.shape
    mha = MultiheadAttention(8, 2, batch_first=True).to("meta")
    q = torch.ones(2, 4, 8, device="meta")
    assert mha(q, q, q)[0].shape == torch.nn.MultiheadAttention(
        8, 2, batch_first=True, device="meta")(q, q, q)[0].shape == (2, 4, 8)
