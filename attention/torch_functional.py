"""Protected attention on PyTorch tensors as functions: every argument explicit, no module.

Layered as flash-attention's interface: the bodies on the tensors' memory
(:mod:`attention._torch_mha`, :mod:`attention._torch_core_op`), the custom operators that make
them differentiable and opaque to ``torch.compile`` (:mod:`attention._torch_op`,
:mod:`attention._torch_core_op`), these functions, and the modules on top
(:class:`attention.torch.MultiheadAttention`, :class:`attention.torch_core.ProtectedCore`), which
hold parameters and one :class:`Protection` and call them.

What a call runs under (check mode, checking plan, fault hook, plans and buffers per device) and
where its findings go (``Protection.last_report``: the last forward's, extended by its backward)
is the :class:`Protection` passed as ``protection``::

    protection = Protection(check="correct")
    out, _ = attention_core(q, k, v, protection=protection, is_causal=True)
    out.sum().backward()
    protection.last_report.summary()
"""
from __future__ import annotations

import math

import torch

from attention import _torch_core_op, _torch_op
from attention._torch_arrays import autocast, eager
from attention._torch_mha import check_masks
from attention._torch_state import Protection
from attention.fused_choice import CAUSAL_NOT_SQUARE, MASK_GRAD, WEIGHTS_ASKED, check_core, refused
from attention.fused_rules import check_causal
from attention.sinks import sink_logits, with_sink, without_sink

__all__ = ["Protection", "multi_head_attention", "attention_core"]


def multi_head_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         num_heads: int, in_proj_weight: torch.Tensor,
                         in_proj_bias: torch.Tensor | None, out_proj_weight: torch.Tensor,
                         out_proj_bias: torch.Tensor | None, *, protection: Protection,
                         key_padding_mask: torch.Tensor | None = None,
                         attn_mask: torch.Tensor | None = None, need_weights: bool = False,
                         average_attn_weights: bool = True, is_causal: bool = False,
                         dropout_p: float = 0.0, core: str = "auto"
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Multi-head attention with every GEMM of its forward and backward checksum-protected.

    The computation of ``torch.nn.functional.multi_head_attention_forward`` on batch-first
    tensors, with PyTorch's parameter layout (``x @ W.T + b``); differentiable in the inputs and
    parameters, and in float masks that require grad (the unfused core then runs). Under
    ``torch.autocast`` the inputs and parameters are cast to its dtype, as PyTorch's own
    attention runs its projections there.

    Parameters
    ----------
    query : tensor (N, L, E)
    key, value : tensor (N, S, E)
        Self-attention when ``query``, ``key`` and ``value`` are one tensor object.
    num_heads : int
        Divides ``E``.
    in_proj_weight : tensor (3 E, E)
        The query, key and value projections, stacked.
    in_proj_bias : tensor (3 E,) or None
    out_proj_weight : tensor (E, E)
    out_proj_bias : tensor (E,) or None
    protection : Protection
        What the call runs under; its ``last_report`` receives the findings.
    key_padding_mask : bool or float tensor (N, S), optional
        True (or the float added) for keys to ignore. A float mask reaches the fused core as it
        is, O(S) per batch item; one that requires grad is folded into a float64 (N *
        num_heads, L, S) mask and runs the unfused core, whose checked ``dS``, summed over heads
        and queries, is its gradient.
    attn_mask : bool or float tensor (L, S) or (N * num_heads, L, S), optional
        True = not allowed; a float mask is added to the scaled scores.
    need_weights : bool
        Also return the attention weights (after dropout; a loss on them raises
        ``NotImplementedError`` in backward: their gradient is not propagated).
    average_attn_weights : bool
        Average the weights over heads.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` only, when ``attn_mask`` is None (top-left aligned
        where ``L != S``, as ``scaled_dot_product_attention``'s ``is_causal``).
    dropout_p : float
        Attention dropout probability; the mask (or the fused core's seed) is drawn with
        PyTorch's generator (:func:`_dropout_draw`, :mod:`attention.dropout`).
    core : {"auto", "fused", "unfused"}
        The attention product between the projections (:func:`attention.attention_forward`'s
        ``core``): ``"auto"`` runs the fused core (:mod:`attention.fused`) where it applies
        (CPU, any float dtype, ``need_weights=False``, no mask
        that wants its gradient, no fault hook, every call checked), else the unfused sites;
        the others force one. ``protection.last_core`` names the one that ran.

    Returns
    -------
    out : tensor (N, L, E)
    weights : tensor (N, L, S) or (N, num_heads, L, S), or None unless ``need_weights``
    """
    _check_projection(query, key, value, num_heads, in_proj_weight, out_proj_weight)
    check_core(core)
    if not 0 <= dropout_p <= 1:
        raise ValueError(f"dropout_p must be a probability in [0, 1], got {dropout_p}")
    mask_grad = _needs_grad(key_padding_mask, attn_mask)
    if not torch.compiler.is_compiling():  # compiled, the operator refuses them: a plain error
        _refuse_before_draw(query, key, num_heads, key_padding_mask, attn_mask, need_weights,
                            bool(is_causal), core, mask_grad)
    self_attention = query is key and key is value
    query, key, value, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias = autocast(
        query, key, value, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype != in_proj_weight.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; the projection weights have "
                            f"{in_proj_weight.dtype}")
    keep = _dropout_draw((query.shape[0] * num_heads, query.shape[1], key.shape[1]), query,
                         float(dropout_p), need_weights, core)
    y, weights, _ = _torch_op.mha_forward(
        protection.id, query, key, value, in_proj_weight, in_proj_bias, out_proj_weight,
        out_proj_bias, key_padding_mask, attn_mask, num_heads, self_attention, bool(is_causal),
        need_weights, average_attn_weights, keep, float(dropout_p), core, mask_grad)
    return y, (weights if need_weights else None)


def _refuse_before_draw(query: torch.Tensor, key: torch.Tensor, heads: int,
                        key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                        need_weights: bool, is_causal: bool, core: str, mask_grad: bool) -> None:
    """Raise for the masks the operators refuse (:func:`attention._torch_mha.check_masks`) and
    for what the forced fused core refuses whatever the data (the reasons of
    :func:`attention.fused_choice.static_reason` and :func:`attention.attention_forward` that
    the arguments decide), before :func:`multi_head_attention` draws its dropout: a refused call
    leaves PyTorch's generator as it was, as torch's own attention does."""
    check_masks(key_padding_mask, attn_mask, heads, *query.shape[:2], key.shape[1])
    if core != "fused":
        return
    if need_weights:
        raise refused(WEIGHTS_ASKED)
    if mask_grad:
        raise refused(f"a float mask requires grad ({MASK_GRAD.format('the mask')})")
    if is_causal and attn_mask is None and query.shape[1] != key.shape[1]:
        raise refused(CAUSAL_NOT_SQUARE)


def _needs_grad(*masks: torch.Tensor | None) -> bool:
    """Whether autograd wants the gradient of a float mask (a learned position bias): the
    operators then run the unfused core, whose checked ``dS`` that gradient is."""
    return torch.is_grad_enabled() and any(
        m is not None and m.is_floating_point() and m.requires_grad for m in masks)


def attention_core(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                   protection: Protection, attn_mask: torch.Tensor | None = None,
                   scale: float | None = None, is_causal: bool = False,
                   need_weights: bool = False, dropout_p: float = 0.0,
                   core: str = "auto", sinks: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, weights)`` of ``softmax(scale query key^T + attn_mask) value`` with its products
    checksum-protected, differentiable in ``query``, ``key`` and ``value``, and in a float
    ``attn_mask`` that requires grad (a learned position bias: the unfused core then runs, and
    ``core="fused"`` raises ``ValueError``).

    Parameters
    ----------
    query : tensor (..., L, D)
    key, value : tensor (..., S, D)
        Same leading dimensions and dtype as ``query`` (under ``torch.autocast`` all three are
        cast to its dtype first, as ``scaled_dot_product_attention``'s are: Llama's rotary
        positions make float32 queries and keys beside 16-bit values).
    protection : Protection
        What the call runs under; its ``last_report`` receives the findings and its
        ``last_core`` names the implementation that ran.
    attn_mask : tensor, optional
        Broadcastable to ``(..., L, S)``: bool, True = NOT allowed, or float, added to the
        scaled scores. A boolean mask that hides the same keys from every query (key padding),
        or those and the keys after each query (``L == S``), runs as the core's key visibility,
        an ``O(L)`` mask, with the causal triangle as ``is_causal``; likewise a float one that
        adds the same to a key's score in every query row (``-inf`` above the diagonal, or not),
        as the core's per-key additive mask, unless it requires grad.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` only (``L == S``); with ``attn_mask`` too, both apply
        (``scaled_dot_product_attention`` refuses the pair).
    need_weights : bool
        Also return the probabilities ``(..., L, S)`` (a new tensor, after dropout, as
        PyTorch's attention functions return them; no gradient path: a loss on it raises
        ``NotImplementedError`` in backward).
    dropout_p : float
        Attention dropout probability (:mod:`attention.dropout`); the mask (or the fused core's
        seed) is drawn with PyTorch's generator (:func:`_dropout_draw`).
    core : {"auto", "fused", "unfused"}
        Which implementation of :mod:`attention.core` runs: ``"auto"`` the fused core where it
        applies (CPU, any float dtype, no mask that wants its
        gradient, no fault hook, every call checked, ``need_weights=False``), else the unfused
        one; the others force one (``"fused"`` raises ``ValueError`` with ``need_weights``).
    sinks : tensor, optional
        Attention sinks (gpt-oss's): one logit per head, broadcastable to the leading
        dimensions ``(...)``, joined to every query's scores (unscaled, unmasked) in the
        softmax, its probability multiplying no value; differentiable; ``-inf``: no sink. The
        product runs with one key, one query and one head dimension more
        (:mod:`attention.sinks`; its report and fault hook see that product).

    Returns
    -------
    out : tensor (..., L, D)
    weights : tensor (..., L, S) or None
        Without the sinks' probabilities.
    """
    query, key, value = autocast(query, key, value)
    lead, (seq_q, d), seq_k = query.shape[:-2], query.shape[-2:], key.shape[-2]
    if key.shape[:-2] != lead or value.shape != key.shape or key.shape[-1] != d:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} must be (..., L, D), (..., S, D), (..., S, D)")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    check_core(core)
    if core == "fused" and need_weights:  # as the layers refuse it (fused_choice.static_reason)
        raise refused(WEIGHTS_ASKED)
    compiling = torch.compiler.is_compiling()  # compiled, the operator refuses: a plain error
    if core == "fused" and _needs_grad(attn_mask) and not compiling:  # before the dropout's draw
        raise refused(f"a float attn_mask requires grad ({MASK_GRAD.format('attn_mask')})")
    if not 0 <= dropout_p <= 1:
        raise ValueError(f"dropout_p must be a probability in [0, 1], got {dropout_p}")
    n = 1
    for size in lead:
        n *= size
    # explicit lengths: -1 is ambiguous in an empty batch
    q, k, v = (t.reshape(n, t.shape[-2], d).contiguous() for t in (query, key, value))
    mask, is_causal = _core_mask(attn_mask, lead, n, seq_q, seq_k, bool(is_causal),
                                 grouped=sinks is None)
    scale = 1 / d ** 0.5 if scale is None else float(scale)
    if sinks is not None or not compiling:  # the core's error, with the caller's lengths,
        check_causal(is_causal, seq_q, seq_k)  # before the dropout is drawn
    if sinks is not None:
        q, k, v, mask = with_sink(q, k, v, mask, sink_logits(sinks, lead, n), scale)
    keep = _dropout_draw((n, q.shape[1], k.shape[1]), q, float(dropout_p), need_weights, core)
    out, weights = _torch_core_op.apply_core(protection, q, k, v, mask, scale, is_causal,
                                             need_weights, keep, float(dropout_p), core)
    if sinks is not None:
        out, weights = without_sink(out, weights, d)
    out = out.reshape(*lead, seq_q, d)
    return out, (weights.reshape(*lead, seq_q, seq_k) if need_weights else None)


def _dropout_draw(shape: tuple[int, int, int], query: torch.Tensor, p: float,
                  need_weights: bool, core: str) -> torch.Tensor | None:
    """The dropout the operators take (None for ``p == 0``), drawn with PyTorch's generator (so
    ``torch.manual_seed`` reproduces it): where the fused core may run (on the CPU unless
    ``core="unfused"``; on any device with ``core="fused"``, whose CUDA kernels take a seed and
    refuse a mask), the seed of its keep decisions, an int64 tensor ``(1,)``
    (``torch.randint`` on the default generator; :mod:`attention.dropout_hash`), which the
    unfused core, if it runs, materializes; else the mask ``(n, L, S)``, True = kept
    (``torch.rand(shape) >= p`` on the tensors' device). The draw does not depend on which core
    runs (``need_weights``, which a recomputation in backward may ask for where the forward did
    not): activation checkpointing's recomputation drops what the forward dropped."""
    if p == 0:
        return None
    if core == "fused" or (query.device.type == "cpu" and core != "unfused"):
        return torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)
    return torch.rand(shape, device=query.device) >= p


def _check_projection(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      heads: int, in_w: torch.Tensor, out_w: torch.Tensor) -> None:
    """A clear error for inputs and projection weights of mismatched shapes."""
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} must be (N, L, E), (N, S, E), (N, S, E)")
    e = query.shape[2]
    if out_w.dim() == 2 and out_w.shape[1] != e:  # the module's embedding dimension
        raise ValueError(f"query's embedding dimension is {e}, the weights' "
                         f"{out_w.shape[1]} (out_proj_weight {tuple(out_w.shape)}): the inputs "
                         f"must be (N, L, {out_w.shape[1]})")
    if key.shape[0] != query.shape[0] or key.shape[2] != e:
        raise ValueError(f"key {tuple(key.shape)} must be (N, S, E) with query's N and E "
                         f"{(query.shape[0], e)}")
    if heads <= 0 or e % heads:
        raise ValueError(f"num_heads ({heads}) must divide the embedding dimension ({e})")
    if tuple(in_w.shape) != (3 * e, e) or tuple(out_w.shape) != (e, e):
        raise ValueError(f"in_proj_weight {tuple(in_w.shape)} and out_proj_weight "
                         f"{tuple(out_w.shape)} must be {(3 * e, e)} and {(e, e)}")


def _core_mask(mask: torch.Tensor | None, lead: torch.Size, n: int, seq_q: int, seq_k: int,
               causal: bool, grouped: bool) -> tuple[torch.Tensor | None, bool]:
    """``(mask, causal)`` as the core takes them: ``mask`` ``(L, S)`` when shared by every batch
    item and head, with ``grouped`` ``(n / H, L, S)`` when shared by the ``H = lead[-1]`` heads
    of each batch item (a Hugging Face mask ``(N, 1, L, S)``; the CPU fused core reads it per
    group of heads, never copied per head; not for a float mask that requires grad), else ``(n,
    L, S)`` (attention sinks add a row and a column per head); a mask that hides the same keys
    from every query (key padding: Hugging Face's masks of padded batches; a float one adds the
    same value to a key's
    score in every query row), or those keys and the keys after each query (key padding of a
    causal model, ``L == S``), as ``(n, 1, S)`` with ``causal`` set (no ``L x S`` array: the
    core's key visibility, or its per-key additive mask for a float one; the fused core skips
    the tiles above the diagonal). Not while ``torch.compile`` or a tracer records the call
    (:func:`attention._torch_arrays.eager`): comparing the mask's values is data-dependent
    there, so the mask goes on whole; nor for a float mask that requires grad, whose gradient
    has the shape given."""
    if mask is None:
        return None, causal
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool or float, got {mask.dtype}")
    try:
        full = mask.expand(*lead, seq_q, seq_k)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"{(*lead, seq_q, seq_k)}") from None
    learned = mask.is_floating_point() and mask.requires_grad  # its gradient has its shape
    if eager(mask) and not learned:
        padding, padded_causal = _key_padding(mask, seq_q, seq_k, causal)
        if padding is not None:
            return padding.expand(*lead, 1, seq_k).reshape(n, 1, seq_k).contiguous(), \
                padded_causal
    if all(s == 1 for s in mask.shape[:-2]) and mask.shape[-2:] == (seq_q, seq_k):
        return mask.reshape(seq_q, seq_k).contiguous(), causal
    if grouped and not learned and mask.dim() >= 3 and mask.shape[-3] == 1 and len(lead) > 1:
        per_item = mask.expand(*lead[:-1], 1, seq_q, seq_k)
        return per_item.reshape(n // lead[-1], seq_q, seq_k).contiguous(), causal
    return full.reshape(n, seq_q, seq_k).contiguous(), causal


def _key_padding(mask: torch.Tensor, seq_q: int, seq_k: int, causal: bool
                 ) -> tuple[torch.Tensor | None, bool]:
    """``(hidden, causal)`` when ``mask`` (bool, True = not allowed, or float, added;
    broadcastable to ``(..., L, S)``) is key padding: ``hidden`` ``(..., 1, S)`` the last
    query's row (a causal mask hides nothing more from it), the same in every row, ``causal``
    whether the mask also hides the keys after each query (float: ``-inf`` there); ``(None,
    causal)`` otherwise. Compared in the mask's own shape (its broadcast axes are not
    expanded)."""
    if mask.dim() < 2 or mask.shape[-1] != seq_k or seq_q == 0:  # no query: no last row
        return None, causal
    hidden = mask[..., -1:, :]
    if mask.shape[-2] == 1 or torch.equal(mask, hidden.expand_as(mask)):
        return hidden, causal
    if seq_q != seq_k:
        return None, causal
    after = torch.ones(seq_q, seq_k, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        if torch.equal(mask | after if causal else mask, hidden | after):
            return hidden, True
        return None, causal
    minus_inf = torch.tensor(-math.inf, dtype=mask.dtype, device=mask.device)
    if torch.equal(torch.where(after, minus_inf, mask) if causal else mask,
                   torch.where(after, minus_inf, hidden)):
        return hidden, True
    return None, causal
