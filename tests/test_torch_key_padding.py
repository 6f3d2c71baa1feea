"""Boolean attention masks that are key padding (the same keys hidden from every query, with or
without the causal triangle: Hugging Face's masks of padded batches) reach the attention core as
``key_visible``, an ``O(L)`` mask, instead of an ``L x S`` one, and give the same results as
PyTorch's attention with the full mask. A float ``key_padding_mask`` of the multi-head module
reaches the layer as ``key_add``, ``(N, S)``, never folded into an ``(N * heads, L, S)`` array on
the fused core, and gives PyTorch's results."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")

from attention import _torch_core_op, _torch_mha  # noqa: E402
from attention.torch import MultiheadAttention  # noqa: E402
from attention.torch_functional import (Protection, attention_core,  # noqa: E402
                                        multi_head_attention)
from fresh_python import run_python  # noqa: E402

B, H, L, D = 3, 2, 20, 8


def _core_spy(monkeypatch, names):
    """The list each call to the core appends ``(shape of each keyword argument of names, or
    None; causal)`` to."""
    calls = []
    real = _torch_core_op.core_forward

    def spy(q, k, v, ctx, **kw):
        calls.append(tuple(None if kw.get(n) is None else kw[n].shape for n in names)
                     + (kw["causal"],))
        return real(q, k, v, ctx, **kw)

    monkeypatch.setattr(_torch_core_op, "core_forward", spy)
    return calls


@pytest.fixture
def core_calls(monkeypatch):
    """The masks each call hands the core: ``(attn_mask shape or None, key_visible shape or
    None, causal)``."""
    return _core_spy(monkeypatch, ("attn_mask", "key_visible"))


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


def test_other_boolean_masks_stay_whole_one_per_batch_item(core_calls):
    """A mask that is not key padding reaches the core whole: one ``(L, S)`` per batch item
    where its heads share it (``(B, 1, L, S)``, read per group of heads), one per head where
    they do not."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.rand(B, 1, L, L, generator=gen) > 0.6
    hidden[..., 0] = False
    out, grads, _ = _run(hidden, False)
    want_out, want_grads = _reference(hidden)
    assert core_calls == [((B, L, L), None, False)]
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the causal triangle with one more key hidden from one query (not from every later one)
    core_calls.clear()
    almost = _after() | _padding([20, 13, 5])
    almost[1, 0, 7, 2] = True
    out, _, _ = _run(almost, False)
    assert core_calls == [((B, L, L), None, False)]
    torch.testing.assert_close(out, _reference(almost)[0], rtol=1e-12, atol=1e-12)
    core_calls.clear()
    per_head = torch.rand(B, H, L, L, generator=gen) > 0.6
    per_head[..., 0] = False
    out, _, _ = _run(per_head, False)
    assert core_calls == [((B * H, L, L), None, False)]
    torch.testing.assert_close(out, _reference(per_head)[0], rtol=1e-12, atol=1e-12)


def test_compiled_calls_take_the_mask_whole_and_equal_eager(core_calls):
    # comparing the mask's values is data-dependent under torch.compile: the compiled graph
    # hands the mask on whole (one per batch item, which its shape tells), for padding and
    # other masks alike, with no graph break
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
        assert core_calls == [((B, L, L), None, False)]
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


# ------------------------------------------------------------------ float key_padding_mask

E, S = 16, 23


@pytest.fixture
def layer_masks(monkeypatch):
    """The masks each module call hands the layer: ``(attn_mask shape or None, key_add shape or
    None)``."""
    calls = []
    real = _torch_mha.attention_forward

    def spy(*args, **kw):
        mask, keys = kw.get("attn_mask"), kw.get("key_add")
        calls.append((None if mask is None else mask.shape, None if keys is None else keys.shape))
        return real(*args, **kw)

    monkeypatch.setattr(_torch_mha, "attention_forward", spy)
    return calls


def _float_masks(kind, dtype, seq_q, seq_k):
    """``(attn_mask, key_padding_mask)``: a float padding mask (``-inf`` at hidden keys, key 0
    never hidden) with no attention mask, a float ``(L, S)`` one or a boolean ``(N * H, L, S)``
    one."""
    gen = torch.Generator().manual_seed(7)
    pad = torch.randn(B, seq_k, generator=gen, dtype=dtype)
    pad[torch.rand(B, seq_k, generator=gen) < 0.3] = float("-inf")
    pad[:, 0] = 0.5
    attn = {"none": None,
            "float-2d": torch.randn(seq_q, seq_k, generator=gen, dtype=dtype),
            "bool-3d": torch.rand(B * H, seq_q, seq_k, generator=gen) < 0.3}[kind]
    if kind == "bool-3d":
        attn[..., 0] = False
    return attn, pad


def _module_step(module, q, k, v, entry, **kw):
    """Output and the gradients of the inputs and parameters of ``sum(y * g)``, through the
    module or ``multi_head_attention`` with its parameters."""
    params = dict(module.named_parameters())
    for t in (*params.values(), q, k, v):
        t.grad = None
    if entry == "module":
        y, _ = module(q, k, v, need_weights=False, **kw)
    else:
        y, _ = multi_head_attention(
            q, k, v, H, params["in_proj_weight"], params["in_proj_bias"],
            params["out_proj.weight"], params["out_proj.bias"], protection=module.protection,
            **kw)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    (y * g).sum().backward()
    return [y.detach()] + [t.grad for t in (q, k, v, *params.values()) if t.grad is not None]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["none", "float-2d", "bool-3d"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("entry", ["module", "functional"])
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
def test_float_key_padding_runs_per_key_on_the_fused_core_and_equals_torch(
        dtype, kind, cross, entry, layer_masks):
    torch.manual_seed(0)
    stock = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    mine = MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    mine.load_state_dict(stock.state_dict())
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, L, E, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, S, E, generator=gen, dtype=dtype, requires_grad=True)
            for _ in range(2)) if cross else (q, q)
    seq_k = k.shape[1]
    attn_mask, padding = _float_masks(kind, dtype, L, seq_k)
    got = _module_step(mine, q, k, v, entry, attn_mask=attn_mask, key_padding_mask=padding)
    assert mine.protection.last_core == "fused"
    assert not mine.protection.last_report.events
    assert layer_masks == [(None if attn_mask is None else tuple(attn_mask.shape), (B, seq_k))]
    want = _module_step(stock, q, k, v, "module", attn_mask=attn_mask,
                        key_padding_mask=padding)
    tol = 1e-11 if dtype == torch.float64 else 1e-4
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


_PEAK = """
import resource, tracemalloc
import torch
from attention.torch import MultiheadAttention

N, H, E, L = 1, 8, 64, {seq}
module = MultiheadAttention(E, H, batch_first=True)


def step(seq):
    x = torch.randn(N, seq, E, requires_grad=True)
    padding = torch.randn(N, seq)
    padding[:, -seq // 4:] = float("-inf")
    y, _ = module(x, x, x, key_padding_mask=padding, need_weights=False)
    y.sum().backward()
    assert module.last_core == "fused", module.last_core


step(256)  # compile and warm up
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
step(L)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024  # KiB on Linux
folded = N * H * L * L * 8
assert peak < 0.1 * folded and grown < 0.25 * folded, (peak, grown, folded)
"""


def test_a_float_key_padding_mask_makes_no_quadratic_buffer():
    """Forward and backward of the module at L = 2048 with a float key padding mask on the fused
    core, in a fresh interpreter: the traced (NumPy) peak and the growth of the peak resident
    memory (PyTorch's allocations are not traced) stay far below the float64 ``(N * heads, L,
    L)`` mask a fold makes (268 MB; the fold grew the resident peak by 335 MB and the traced
    peak was 70 MB, against 15 MB and 14 MB per key)."""
    run_python("-c", _PEAK.format(seq=2048), timeout=600)


# ------------------------------------------------------------------ float attn_mask


def _float_padding(lengths: list[int]) -> torch.Tensor:
    """(B, 1, 1, L) float: ``-inf`` at keys at or after each item's length (every length at least
    1: no row without a key), other keys a value of their own."""
    gen = torch.Generator().manual_seed(4)
    pad = torch.randn(B, 1, 1, L, generator=gen, dtype=torch.float64)
    return pad.masked_fill(torch.arange(L) >= torch.tensor(lengths)[:, None, None, None],
                           float("-inf"))


def _minus_inf_after(mask: torch.Tensor) -> torch.Tensor:
    return mask.masked_fill(_after(), float("-inf"))


FLOAT_KINDS = {  # name: (mask given, is_causal given, the full float mask it means)
    "float padding (B, 1, 1, S)": (lambda: _float_padding([20, 13, 1]), False,
                                   lambda: _float_padding([20, 13, 1])),
    "float padding expanded (B, 1, L, S)": (
        lambda: _float_padding([20, 13, 5]).expand(B, 1, L, L).contiguous(), False,
        lambda: _float_padding([20, 13, 5])),
    "float padding and -inf causal triangle": (
        lambda: _minus_inf_after(_float_padding([20, 13, 5]).expand(B, 1, L, L)), False,
        lambda: _minus_inf_after(_float_padding([20, 13, 5]).expand(B, 1, L, L))),
    "float padding with is_causal": (
        lambda: _float_padding([20, 13, 5]), True,
        lambda: _minus_inf_after(_float_padding([20, 13, 5]).expand(B, 1, L, L))),
}


def _float_reference(mask: torch.Tensor):
    q, k, v = _inputs()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, D, dtype=out.dtype)).sum(),
                                (q, k, v))
    return out, grads


@pytest.mark.parametrize("core", ["auto", "unfused"])
@pytest.mark.parametrize("kind", list(KINDS) + list(FLOAT_KINDS))
def test_key_padding_runs_per_key_and_equals_the_full_mask(kind, core, monkeypatch):
    """Key padding, with or without the causal triangle, reaches the core as ``key_visible``
    (boolean masks) or ``key_add`` (float masks, adding the same to a key's score in every
    query row), ``(n, S)``, not as an ``(n, L, S)`` array, and gives PyTorch's results with the
    mask whole."""
    boolean = kind in KINDS
    given, causal, meant = (KINDS if boolean else FLOAT_KINDS)[kind]
    calls = _core_spy(monkeypatch, ("attn_mask", "key_visible" if boolean else "key_add"))
    out, grads, protection = _run(given(), causal, core)
    assert calls == [(None, (B * H, L), causal or "causal" in kind)]
    assert protection.last_core == ("fused" if core == "auto" else "unfused")
    assert not protection.last_report.events
    want_out, want_grads = (_reference if boolean else _float_reference)(meant())
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_other_float_masks_stay_full(monkeypatch):
    """Masks that differ between query rows go on whole (one per batch item, shared by its
    heads), and a float mask whose gradient is wanted whole per head (the gradient has the
    mask's shape)."""
    core_key_add = _core_spy(monkeypatch, ("attn_mask", "key_add"))
    varying = _float_padding([20, 13, 5]).expand(B, 1, L, L).clone()
    varying[1, 0, 7, 2] = -3.0  # one query's score of one key only
    out, _, _ = _run(varying, False)
    assert core_key_add == [((B, L, L), None, False)]
    torch.testing.assert_close(out, _float_reference(varying)[0], rtol=1e-12, atol=1e-12)
    core_key_add.clear()
    learned = _float_padding([20, 13, 5]).requires_grad_()
    q, k, v = _inputs()
    out, _ = attention_core(q, k, v, protection=Protection(), attn_mask=learned)
    out.sum().backward()
    assert core_key_add == [((B * H, L, L), None, False)]
    assert learned.grad.shape == learned.shape
    qd, kd, vd = _inputs()
    mask = learned.detach().clone().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask).sum().backward()
    torch.testing.assert_close(learned.grad, mask.grad, rtol=1e-10, atol=1e-12)
