"""The protected attention product (:mod:`attention.core`) as PyTorch custom operators.

``abftgemm::attention_core`` and ``abftgemm::attention_core_backward`` (``torch.library.custom_op``
with ``register_fake`` and ``register_autograd``), so ``torch.compile`` keeps the product one
opaque node. The backward's state travels in a token tensor and the owner of a call is named by
an ``op_id``, as for ``abftgemm::mha_forward`` (:mod:`attention._torch_op`, whose registry and
tokens this module shares). The backward reads ``query``, ``key`` and ``value`` from autograd's
saved tensors, never from the forward's views of them (a compiler may reuse their memory).
"""
from typing import Any, Optional

import torch

from attention._torch_op import _module, _state, _token


@torch.library.custom_op("abftgemm::attention_core", mutates_args=())
def attention_core(op_id: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: Optional[torch.Tensor], scale: float, is_causal: bool,
                   need_weights: bool, dropout_keep: Optional[torch.Tensor],
                   dropout: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, weights, token)`` of contiguous ``query`` ``(n, L, D)``, ``key`` and ``value``
    ``(n, S, D)``; ``attn_mask`` ``(L, S)`` or ``(n, L, S)``, bool (True = not allowed) or float
    (added); ``weights`` ``(n, L, S)``, or empty unless ``need_weights``; with ``dropout`` > 0,
    ``dropout_keep`` ``(n, L, S)`` is its mask (True = kept)."""
    from attention.torch_core import run_core_forward

    out, weights, state = run_core_forward(_module(op_id), query, key, value, attn_mask, scale,
                                           is_causal, need_weights, dropout_keep, dropout)
    return out, weights, _token(state)


@attention_core.register_fake
def _(op_id, query, key, value, attn_mask, scale, is_causal, need_weights, dropout_keep,
      dropout):
    n, seq_q, _ = query.shape
    shape = (n, seq_q, key.shape[1]) if need_weights else (0,)
    return (query.new_empty(query.shape), query.new_empty(shape),
            torch.empty(1, dtype=torch.int64, device="cpu"))


@torch.library.custom_op("abftgemm::attention_core_backward", mutates_args=())
def attention_core_backward(token: torch.Tensor, d_out: torch.Tensor, query: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_query, d_key, d_value)`` of one :func:`attention_core` call."""
    from attention.torch_core import run_core_backward

    return run_core_backward(_state(token), d_out, query, key, value)


@attention_core_backward.register_fake
def _(token, d_out, query, key, value):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, query, key, value = inputs[:4]
    _, weights, token = output
    ctx.mark_non_differentiable(weights, token)
    ctx.save_for_backward(token, query, key, value)


def _backward(ctx: Any, d_out: torch.Tensor, d_weights: Any, d_token: Any) -> tuple:
    token, query, key, value = ctx.saved_tensors
    dq, dk, dv = attention_core_backward(token, d_out.contiguous(), query, key, value)
    return None, dq, dk, dv, None, None, None, None, None, None


attention_core.register_autograd(_backward, setup_context=_setup_context)
