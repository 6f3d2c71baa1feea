"""Multi-head attention as PyTorch custom operators, so ``torch.compile`` keeps it opaque.

``abftgemm::mha_forward`` and ``abftgemm::mha_backward`` (``torch.library.custom_op``, each with
a ``register_fake`` shape function) run the functional core on the tensors' memory;
``register_autograd`` ties them together. Dynamo and AOTAutograd see two opaque nodes and never
trace into NumPy.

Every argument is explicit: tensors, plain values, and the
:class:`attention._torch_state.Protection` the call runs under, named by its ``id``. What the
backward needs that is not a tensor (the core's saved arrays and checksums, the forward's report)
travels in the forward's token (:func:`attention._torch_state.token_of`).
"""
from typing import Any, Optional

import torch

from attention._torch_arrays import first_order
from attention._torch_state import registered, saved_state, token_of


# ------------------------------------------------------------------------------- forward


@torch.library.custom_op("abftgemm::mha_forward", mutates_args=())
def mha_forward(protection: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                in_w: torch.Tensor, in_b: Optional[torch.Tensor], out_w: torch.Tensor,
                out_b: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                attn_mask: Optional[torch.Tensor], num_heads: int, self_attention: bool,
                is_causal: bool, need_weights: bool, average_attn_weights: bool,
                dropout_keep: Optional[torch.Tensor], dropout: float, core: str,
                mask_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, weights, token)`` of batch-first ``query``, ``key``, ``value`` ``(N, L|S, E)``;
    ``weights`` is empty unless ``need_weights`` (then ``(N, L, S)``, or ``(N, H, L, S)``
    without averaging). With ``dropout`` > 0, ``dropout_keep`` is its mask ``(N * H, L, S)``
    (True = kept) or an int64 ``(1,)``, the seed of the fused core's keep decisions
    (:func:`attention._torch_arrays.dropout_arrays`), drawn by the caller with PyTorch's
    generator. ``core`` is
    :func:`attention.attention_forward`'s; ``mask_grad``: the backward also returns the
    gradients of the float masks (the unfused core runs). ``protection`` is the ``id`` of the
    :class:`attention._torch_state.Protection` the call runs under."""
    from attention._torch_mha import run_forward

    y, weights, state = run_forward(registered(protection), num_heads, query, key, value, in_w,
                                    in_b, out_w, out_b, key_padding_mask, attn_mask,
                                    self_attention, is_causal, need_weights,
                                    average_attn_weights, dropout_keep, dropout, core, mask_grad)
    return y, weights, token_of(state)


@mha_forward.register_fake
def _(protection, query, key, value, in_w, in_b, out_w, out_b, key_padding_mask, attn_mask,
      num_heads, self_attention, is_causal, need_weights, average_attn_weights, dropout_keep,
      dropout, core, mask_grad):
    n, seq_q, _ = query.shape
    seq_k = key.shape[1]
    shape = ((n, seq_q, seq_k) if average_attn_weights else (n, num_heads, seq_q, seq_k)) \
        if need_weights else (0,)
    return (query.new_empty(query.shape), query.new_empty(shape),
            torch.empty(1, dtype=torch.int64, device="cpu"))


# ------------------------------------------------------------------------------- backward


@torch.library.custom_op("abftgemm::mha_backward", mutates_args=())
def mha_backward(token: torch.Tensor, dy: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, in_w: torch.Tensor, in_b: Optional[torch.Tensor],
                 out_w: torch.Tensor, out_b: Optional[torch.Tensor], self_attention: bool,
                 key_padding_mask: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
                 mask_grad: bool, d_weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor, torch.Tensor]:
    """``(d_query, d_key, d_value, d_in_w, d_in_b, d_out_w, d_out_b, d_key_padding_mask,
    d_attn_mask)``; ``d_key`` and ``d_value`` are empty in self-attention (``d_query`` is the
    whole input gradient), the masks' gradients empty unless ``mask_grad`` and the mask is
    float. A non-zero ``d_weights`` (a loss on the returned weights) raises
    ``NotImplementedError``.

    The backward reads the forward's inputs and parameters from these arguments, not from the
    forward's views of them: so autograd (and a compiler, which would otherwise reuse their
    memory once the forward is done) keeps them as they were. The masks it reads (a float64
    ``attn_mask``, the dropout keep mask) the forward copied
    (:func:`attention._torch_arrays.mask_array`)."""
    from attention._torch_arrays import refuse_weights_gradient
    from attention._torch_mha import run_backward

    refuse_weights_gradient(d_weights)
    return run_backward(saved_state(token), dy, query, key, value, in_w, in_b, out_w, out_b,
                        key_padding_mask, attn_mask)


@mha_backward.register_fake
def _(token, dy, query, key, value, in_w, in_b, out_w, out_b, self_attention, key_padding_mask,
      attn_mask, mask_grad, d_weights):
    n, _, e = dy.shape
    kv = (0,) if self_attention else tuple(key.shape)
    masks = tuple(m.new_empty(m.shape) if mask_grad and m is not None and m.is_floating_point()
                  else dy.new_empty(0) for m in (key_padding_mask, attn_mask))
    return (dy.new_empty(dy.shape), dy.new_empty(kv), dy.new_empty(kv), in_w.new_empty(in_w.shape),
            in_w.new_empty(in_w.shape[0]), out_w.new_empty(out_w.shape),
            out_w.new_empty(out_w.shape[0]), *masks)


# ------------------------------------------------------------------------------- autograd


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    (_, query, key, value, in_w, in_b, out_w, out_b, key_padding_mask, attn_mask, _,
     self_attention, _, _, _, _, _, _, mask_grad) = inputs
    token = output[2]
    ctx.mark_non_differentiable(token)
    masks = (key_padding_mask, attn_mask) if mask_grad else (None, None)
    ctx.save_for_backward(token, query, key, value, in_w, in_b, out_w, out_b, *masks)
    ctx.self_attention, ctx.mask_grad = self_attention, mask_grad
    ctx.bias = in_b is not None, out_b is not None


def _backward(ctx: Any, dy: torch.Tensor, d_weights: Any, d_token: Any) -> tuple:
    token, *tensors, key_padding_mask, attn_mask = ctx.saved_tensors
    dq, dk, dv, d_in_w, d_in_b, d_out_w, d_out_b, d_kpm, d_mask = mha_backward(
        token, dy.contiguous(), *tensors, ctx.self_attention, key_padding_mask, attn_mask,
        ctx.mask_grad, d_weights)
    if ctx.self_attention:
        dk = dv = None
    d_kpm, d_mask = (g if m is not None and m.is_floating_point() else None
                     for g, m in ((d_kpm, key_padding_mask), (d_mask, attn_mask)))
    return (None, dq, dk, dv, d_in_w, d_in_b if ctx.bias[0] else None, d_out_w,
            d_out_b if ctx.bias[1] else None, d_kpm, d_mask, None, None, None, None, None, None,
            None, None, None)


mha_forward.register_autograd(first_order(_backward), setup_context=_setup_context)
