"""The protected attention product (:mod:`attention.core`) as PyTorch custom operators.

``abftgemm::attention_core`` and ``abftgemm::attention_core_backward`` (``torch.library.custom_op``
with ``register_fake`` and ``register_autograd``), so ``torch.compile`` keeps the product one
opaque node. The backward's state travels in a token tensor and the owner of a call is named by
an ``op_id``, as for ``abftgemm::mha_forward`` (:mod:`attention._torch_op`, whose registry and
tokens this module shares). The backward reads ``query``, ``key`` and ``value`` from autograd's
saved tensors, never from the forward's views of them (a compiler may reuse their memory). The
operators' bodies (:func:`run_core_forward`, :func:`run_core_backward`) run the core on the
tensors' memory for the :class:`attention.torch_core.ProtectedCore` their ``op_id`` names.

:func:`apply_core` is what :class:`attention.torch_core.ProtectedCore` calls: outside
``torch.compile`` and tracing, on plain tensors, the same bodies run under a
``torch.autograd.Function`` (:class:`_EagerCore`, the backward's state kept on its context), which
skips the dispatch of two custom operators and the token.
"""
from typing import Any, Optional

import torch

from abftgemm._torch import device_scope, to_tensor
from abftgemm.report import Report
from torch.autograd.function import once_differentiable

from attention._torch_arrays import array, eager, threads
from attention._torch_op import _module, _state, _token
from attention.context import Context
from attention.core import core_backward, core_forward
from attention.workspace import Workspace


@torch.library.custom_op("abftgemm::attention_core", mutates_args=())
def attention_core(op_id: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: Optional[torch.Tensor], scale: float, is_causal: bool,
                   need_weights: bool, dropout_keep: Optional[torch.Tensor],
                   dropout: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, weights, token)`` of contiguous ``query`` ``(n, L, D)``, ``key`` and ``value``
    ``(n, S, D)``; ``attn_mask`` ``(L, S)`` or ``(n, L, S)``, bool (True = not allowed) or float
    (added); ``weights`` ``(n, L, S)``, or empty unless ``need_weights``; with ``dropout`` > 0,
    ``dropout_keep`` ``(n, L, S)`` is its mask (True = kept)."""
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


def apply_core(op_id: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: Optional[torch.Tensor], scale: float, is_causal: bool,
               need_weights: bool, dropout_keep: Optional[torch.Tensor],
               dropout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, weights)`` of :func:`attention_core`, differentiable in ``query``, ``key`` and
    ``value``: the custom operator where a compiler or tracer may see it, else
    :class:`_EagerCore` on the same bodies."""
    args = (op_id, query, key, value, attn_mask, scale, is_causal, need_weights, dropout_keep,
            dropout)
    if eager(query, key, value, attn_mask, dropout_keep):
        return _EagerCore.apply(*args)
    out, weights, _ = attention_core(*args)
    return out, weights


class _EagerCore(torch.autograd.Function):
    """:func:`attention_core` and its backward without custom operators' dispatch."""

    @staticmethod
    def forward(ctx: Any, op_id: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attn_mask: Optional[torch.Tensor], scale: float,
                is_causal: bool, need_weights: bool, dropout_keep: Optional[torch.Tensor],
                dropout: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, weights, state = run_core_forward(_module(op_id), query, key, value, attn_mask,
                                               scale, is_causal, need_weights, dropout_keep,
                                               dropout)
        ctx.mark_non_differentiable(weights)
        ctx.save_for_backward(query, key, value)
        ctx.state = state
        return out, weights

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor, d_weights: Any) -> tuple:
        query, key, value = ctx.saved_tensors
        dq, dk, dv = run_core_backward(ctx.state, d_out.contiguous(), query, key, value)
        return None, dq, dk, dv, None, None, None, None, None, None


# ------------------------------------------------------------------ the operators' bodies


class _CoreSaved:
    """What one forward leaves for its backward (carried by the operators' token)."""

    def __init__(self, core: Any, saved: dict[str, Any], report: Report,
                 workspace: Workspace):
        self.core, self.saved, self.report, self.workspace = core, saved, report, workspace


def run_core_forward(core: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, scale: float, is_causal: bool,
                     need_weights: bool, keep: torch.Tensor | None = None,
                     dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, _CoreSaved]:
    """The body of ``abftgemm::attention_core``."""
    workspace = core._workspace_for(q.device)
    context = Context(core.check, core.plan, core.fault_hook)
    with device_scope(q), threads(q):
        out, saved = core_forward(array(q), array(k), array(v), context, scale=scale,
                                  causal=is_causal,
                                  attn_mask=None if mask is None else array(mask),
                                  dropout=dropout,
                                  dropout_keep=None if keep is None else array(keep),
                                  workspace=workspace,
                                  core="unfused" if need_weights else core.core)
        dropped = saved["probs_dropped"]
        probs = saved["probs"] if dropped is None else dropped
        weights = to_tensor(probs).clone() if need_weights else q.new_empty(0)
        out = to_tensor(out)
    core.last_report, core.last_core = context.report, saved["core"]
    return out, weights, _CoreSaved(core, saved, context.report, workspace)


def run_core_backward(state: _CoreSaved, d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of ``abftgemm::attention_core_backward``: the inputs are read from the tensors
    given here (those autograd kept)."""
    core = state.core
    inputs = state.saved["inputs"]
    inputs.q, inputs.k, inputs.v = array(q), array(k), array(v)
    context = Context(core.check, core.plan, core.fault_hook, state.report)
    with device_scope(d_out), threads(d_out):
        grads = core_backward(state.saved, array(d_out), context, workspace=state.workspace)
        result = tuple(to_tensor(g) for g in grads)
    core.last_report = state.report
    return result
