"""The protected attention product (:mod:`attention.core`) as PyTorch custom operators.

``abftgemm::attention_core`` and ``abftgemm::attention_core_backward`` (``torch.library.custom_op``
with ``register_fake`` and ``register_autograd``), so ``torch.compile`` keeps the product one
opaque node. As for ``abftgemm::mha_forward`` (:mod:`attention._torch_op`), every argument is
explicit: the :class:`attention._torch_state.Protection` a call runs under is named by its ``id``,
and the backward's state travels in a token tensor (:func:`attention._torch_state.token_of`). The
backward reads ``query``, ``key``, ``value`` and the output (the fused core's backward reads it;
outside a compiler, only where the fused core ran) from autograd's saved tensors, never from the
forward's views of them (a compiler may reuse their memory, and autograd refuses a backward after
an in-place change of them). The operators' bodies
(:func:`run_core_forward`, :func:`run_core_backward`) run the core on the tensors' memory.

:func:`apply_core` is what :func:`attention.torch_functional.attention_core` calls: outside
``torch.compile`` and tracing, on plain tensors, the same bodies run under a
``torch.autograd.Function`` (:class:`_EagerCore`, the backward's state kept on its context), which
skips the dispatch of two custom operators and the token.
"""
from typing import Any, Optional

import torch

from abftgemm.tensors import device_scope, to_tensor
from abftgemm.report import Report
from torch.autograd.function import once_differentiable

from attention._torch_arrays import (array, dropout_arrays, eager, first_order, mask_array,
                                     recomputing, refuse_weights_gradient, threads)
from attention._torch_state import (Protection, inputs_key, registered, saved_state,
                                    token_of)
from attention.core import core_backward, core_forward
from attention.workspace import Workspace


@torch.library.custom_op("abftgemm::attention_core", mutates_args=())
def attention_core(protection: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: Optional[torch.Tensor], scale: float, is_causal: bool,
                   need_weights: bool, dropout_keep: Optional[torch.Tensor],
                   dropout: float, core: str, mask_grad: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, weights, token)`` of contiguous ``query`` ``(n, L, D)``, ``key`` and ``value``
    ``(n, S, D)``; ``attn_mask`` ``(L, S)`` or ``(n, L, S)``, bool (True = not allowed) or float
    (added), or bool ``(n, 1, S)``: key padding, the same keys hidden from every query (run as
    the core's ``key_visible``, no ``L x S`` array); ``weights`` ``(n, L, S)``, or empty unless
    ``need_weights``; with ``dropout`` > 0, ``dropout_keep`` ``(n, L, S)`` is its mask (True =
    kept), or an int64 ``(1,)`` the seed of the fused core's keep decisions
    (:func:`attention._torch_arrays.dropout_arrays`); ``core`` one of
    :data:`attention.core.CORES`; ``mask_grad``: the backward also returns the gradient of the
    float ``attn_mask``; ``protection`` the ``id`` of the
    :class:`attention._torch_state.Protection` the call runs under."""
    out, weights, state = run_core_forward(registered(protection), query, key, value, attn_mask,
                                           scale, is_causal, need_weights, dropout_keep, dropout,
                                           core, mask_grad)
    return out, weights, token_of(state)


@attention_core.register_fake
def _(protection, query, key, value, attn_mask, scale, is_causal, need_weights, dropout_keep,
      dropout, core, mask_grad):
    n, seq_q, _ = query.shape
    shape = (n, seq_q, key.shape[1]) if need_weights else (0,)
    return (query.new_empty(query.shape), query.new_empty(shape),
            torch.empty(1, dtype=torch.int64, device="cpu"))


@torch.library.custom_op("abftgemm::attention_core_backward", mutates_args=())
def attention_core_backward(token: torch.Tensor, d_out: torch.Tensor, query: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                            attn_mask: Optional[torch.Tensor], mask_grad: bool,
                            d_weights: Optional[torch.Tensor]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_query, d_key, d_value, d_attn_mask)`` of one :func:`attention_core` call whose
    output was ``out``; ``d_attn_mask`` is empty unless ``mask_grad``. A non-zero ``d_weights``
    (a loss on the returned weights) raises ``NotImplementedError``."""
    refuse_weights_gradient(d_weights)
    return run_core_backward(saved_state(token), d_out, query, key, value, out, attn_mask)


@attention_core_backward.register_fake
def _(token, d_out, query, key, value, out, attn_mask, mask_grad, d_weights):
    d_mask = attn_mask.new_empty(attn_mask.shape) if mask_grad else query.new_empty(0)
    return (query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
            d_mask)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, query, key, value, attn_mask = inputs[:5]
    out, _, token = output
    ctx.mark_non_differentiable(token)
    ctx.mask_grad = inputs[-1]
    ctx.save_for_backward(token, query, key, value, out, attn_mask if ctx.mask_grad else None)


def _backward(ctx: Any, d_out: torch.Tensor, d_weights: Any, d_token: Any) -> tuple:
    token, query, key, value, out, attn_mask = ctx.saved_tensors
    dq, dk, dv, d_mask = attention_core_backward(token, d_out.contiguous(), query, key, value,
                                                 out, attn_mask, ctx.mask_grad, d_weights)
    return (None, dq, dk, dv, d_mask if ctx.mask_grad else None, None, None, None, None, None,
            None, None)


attention_core.register_autograd(_backward, setup_context=_setup_context)


def apply_core(protection: Protection, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attn_mask: Optional[torch.Tensor], scale: float,
               is_causal: bool, need_weights: bool, dropout_keep: Optional[torch.Tensor],
               dropout: float, core: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, weights)`` of :func:`attention_core`, differentiable in ``query``, ``key`` and
    ``value``, and in a float ``attn_mask`` that requires grad (a learned position bias; the
    unfused core then runs): the custom operator where a compiler or tracer may see it, else
    :class:`_EagerCore` on the same bodies."""
    mask_grad = torch.is_grad_enabled() and attn_mask is not None \
        and attn_mask.is_floating_point() and attn_mask.requires_grad
    args = (query, key, value, attn_mask, scale, is_causal, need_weights, dropout_keep, dropout,
            core, mask_grad)
    if eager(query, key, value, attn_mask, dropout_keep):
        return _EagerCore.apply(protection, *args)
    out, weights, _ = attention_core(protection.id, *args)
    return out, weights


class _EagerCore(torch.autograd.Function):
    """:func:`attention_core` and its backward without custom operators' dispatch."""

    @staticmethod
    def forward(ctx: Any, protection: Protection, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attn_mask: Optional[torch.Tensor], scale: float,
                is_causal: bool, need_weights: bool, dropout_keep: Optional[torch.Tensor],
                dropout: float, core: str, mask_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out, weights, state = run_core_forward(protection, query, key, value, attn_mask, scale,
                                               is_causal, need_weights, dropout_keep, dropout,
                                               core, mask_grad)
        # The fused core's backward reads the output; the unfused core's saves a stand-in of
        # its shape (no memory: a broadcast scalar), so that a checkpointed recomputation on the
        # other core saves tensors of the same number and shapes (as non-reentrant
        # checkpointing checks), and the unfused core's output may still change in place.
        kept = out if state.saved["core"] == "fused" else out.new_zeros(()).expand(out.shape)
        ctx.save_for_backward(query, key, value, kept, attn_mask if mask_grad else None)
        ctx.state = state
        return out, weights

    @staticmethod
    @first_order
    @once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor, d_weights: Any) -> tuple:
        refuse_weights_gradient(d_weights)
        query, key, value, out, attn_mask = ctx.saved_tensors
        dq, dk, dv, d_mask = run_core_backward(ctx.state, d_out.contiguous(), query, key, value,
                                               out, attn_mask)
        return (None, dq, dk, dv, d_mask if attn_mask is not None else None, None, None, None,
                None, None, None, None)


# ------------------------------------------------------------------ the operators' bodies


class _CoreSaved:
    """What one forward leaves for its backward (carried by the operators' token)."""

    def __init__(self, protection: Protection, saved: dict[str, Any], report: Report,
                 workspace: Workspace):
        self.protection, self.saved, self.report = protection, saved, report
        self.workspace = workspace


def run_core_forward(protection: Protection, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, scale: float, is_causal: bool,
                     need_weights: bool, keep: torch.Tensor | None, dropout: float,
                     core: str, mask_grad: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, _CoreSaved]:
    """The body of ``abftgemm::attention_core``: its findings become
    ``protection.last_report`` (a checkpointed forward recomputed in backward adds them to it)
    and are added to ``protection.total_report``, the implementation it ran
    ``protection.last_core``."""
    workspace = protection.workspace(q.device)
    # a checkpointed forward recomputed in backward adds its findings to the step's report
    found = Report()
    report = protection.last_report if recomputing() else found
    modes = protection.decisions(inputs_key(q, k, v), recomputing())
    context = protection.context(found, modes)
    keep_array, seed = dropout_arrays(keep)
    # a mask (n, 1, S) is per key (attention_core's key padding): key visibility, or float added
    per_key = mask is not None and mask.dim() == 3 and mask.shape[:2] == (q.shape[0], 1) \
        and not mask_grad
    boolean = per_key and mask.dtype == torch.bool
    visible = mask[:, 0].logical_not() if boolean else None
    key_add = mask[:, 0] if per_key and not boolean else None
    mask = None if per_key else mask
    with protection.errors_recorded(), device_scope(q), threads(q):
        out, saved = core_forward(array(q), array(k), array(v), context, scale=scale,
                                  causal=is_causal,
                                  attn_mask=None if mask is None else mask_array(mask),
                                  key_visible=None if visible is None else array(visible),
                                  key_add=None if key_add is None else mask_array(key_add),
                                  dropout=dropout, dropout_keep=keep_array,
                                  dropout_seed=seed,
                                  workspace=workspace,
                                  core="unfused" if need_weights else core,
                                  mask_grad=mask_grad)
        dropped = saved["probs_dropped"]
        probs = saved["probs"] if dropped is None else dropped
        weights = to_tensor(probs).clone() if need_weights else q.new_empty(0)
        out = to_tensor(out)
    protection.book(found, report)
    protection.last_core = saved["core"]
    return out, weights, _CoreSaved(protection, saved, report, workspace)


def run_core_backward(state: _CoreSaved, d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor | None, mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of ``abftgemm::attention_core_backward``: the inputs and the forward's output
    are read from the tensors given here (those autograd kept); ``mask`` is the float mask whose
    gradient the forward was asked for (``mask_grad``), else None and the fourth result empty.
    The findings extend the forward's report, which becomes ``protection.last_report`` again,
    and ``protection.total_report``."""
    inputs = state.saved["inputs"]
    inputs.q, inputs.k, inputs.v = array(q), array(k), array(v)
    # (not the unfused core's stand-in, which a checkpointed recomputation on it hands back)
    if state.saved["core"] == "fused" and (out.numel() < 2 or any(out.stride())):
        state.saved["fused"]["out"] = array(out)
    found = Report()
    context = state.protection.context(found)
    with state.protection.errors_recorded(), device_scope(d_out), threads(d_out):
        grads = core_backward(state.saved, array(d_out), context, workspace=state.workspace)
        result = tuple(to_tensor(g) for g in grads[:3])
        d_mask = to_tensor(grads[3]).to(mask.dtype) if mask is not None else q.new_empty(0)
    state.protection.book(found, state.report)
    return (*result, d_mask)
