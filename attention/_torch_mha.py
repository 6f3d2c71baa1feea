"""The bodies of the custom operators ``abftgemm::mha_forward`` and ``abftgemm::mha_backward``
(:mod:`attention._torch_op`): one forward or backward of multi-head attention on batch-first
tensors, through the functional core on their memory (no copies), and the masks in the core's
layout. Everything a call runs under arrives as an argument: the
:class:`attention._torch_state.Protection` (check mode, plan, fault hook, workspaces, report) and
the number of heads; nothing here knows a module.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from abftgemm.tensors import device_scope, to_tensor
from abftgemm.report import Report
from attention._torch_arrays import array, dropout_arrays, mask_array, recomputing, threads
from attention._torch_state import Protection, inputs_key
from attention.functional import attention_backward, attention_forward
from attention.workspace import Workspace


class _Saved:
    """What one forward leaves for its backward (carried by the operators' token)."""

    def __init__(self, protection: Protection, call: "_Call", saved: dict[str, Any],
                 report: Report, workspace: Workspace):
        self.protection, self.call, self.saved = protection, call, saved
        self.report, self.workspace = report, workspace


def run_forward(protection: Protection, heads: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, in_w: torch.Tensor, in_b: torch.Tensor | None,
                out_w: torch.Tensor, out_b: torch.Tensor | None,
                key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                self_attention: bool, is_causal: bool, need_weights: bool, average: bool,
                dropout_keep: torch.Tensor | None = None,
                dropout: float = 0.0, core: str = "auto", mask_grad: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, _Saved]:
    """``(y, weights or an empty tensor, saved state)`` of one forward, batch-first; with
    ``dropout``, ``dropout_keep`` is its mask ``(N * heads, L, S)``, True = kept, or the seed of
    the fused core's keep decisions (:func:`attention._torch_arrays.dropout_arrays`); ``core`` as
    :func:`attention.attention_forward` takes it; ``mask_grad``: the backward also makes the
    gradients of the float masks. The call's findings become ``protection.last_report`` (a
    checkpointed forward recomputed in backward adds them to it) and are added to
    ``protection.total_report``, the core that ran ``protection.last_core``."""
    call = _Call.of(heads, query, key, value, key_padding_mask, attn_mask, is_causal,
                    self_attention, mask_grad)
    workspace = protection.workspace(query.device)
    # a checkpointed forward recomputed in backward adds its findings to the step's report
    found = Report()
    report = protection.last_report if recomputing() else found
    with protection.errors_recorded(), device_scope(query), threads(query):
        params = _param_views(protection, in_w, in_b, out_w, out_b)
        x = array(query)
        cross = {} if self_attention else {"key": array(key), "value": array(value)}
        modes = protection.decisions(inputs_key(query, key, value), recomputing())
        context = protection.context(found, modes)
        keep, seed = dropout_arrays(dropout_keep)
        y, saved = attention_forward(params, x, context, n_heads=heads,
                                     causal=call.causal, key_visible=call.key_visible,
                                     attn_mask=call.attn_mask, key_add=call.key_add,
                                     dropout=dropout,
                                     dropout_keep=keep, dropout_seed=seed, workspace=workspace,
                                     need_weights=need_weights, core=core,
                                     mask_grad=mask_grad and call.attn_mask is not None
                                     and call.attn_mask.dtype != bool, **cross)
        y = to_tensor(y)
        # torch returns the weights after dropout
        dropped = saved["probs_dropped"]
        call.probs = saved["probs"] if dropped is None else dropped
        weights = call.weights(average) if need_weights else query.new_empty(0)
    protection.book(found, report)
    protection.last_core = saved["core"]
    return y, weights, _Saved(protection, call, saved, report, workspace)


def run_backward(state: _Saved, dy: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, in_w: torch.Tensor, in_b: torch.Tensor | None,
                 out_w: torch.Tensor, out_b: torch.Tensor | None,
                 key_padding_mask: torch.Tensor | None = None,
                 attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``(d_query, d_key, d_value, d_in_w, d_in_b, d_out_w, d_out_b, d_key_padding_mask,
    d_attn_mask)``; ``d_key`` and ``d_value`` empty in self-attention, a mask's gradient empty
    unless the forward made it (``mask_grad``) and that mask is float. The inputs and parameters
    are read from the tensors given here (those of the forward, which autograd kept). The
    findings extend the forward's report, which becomes ``protection.last_report`` again, and
    ``protection.total_report``."""
    inputs = state.saved["inputs"]
    inputs.x = array(query)
    inputs.key, inputs.value = (inputs.x, inputs.x) if state.call.self_attention else \
        (array(key), array(value))
    inputs.params = params_of(in_w, in_b, out_w, out_b)
    found = Report()
    context = state.protection.context(found)
    # The core writes the parameter gradients straight into torch's layout (transposed views
    # of these buffers: no copies, no concatenation).
    d_in_w, d_out_w = torch.empty_like(in_w), torch.empty_like(out_w)
    d_in_b = torch.empty(in_w.shape[0], dtype=in_w.dtype, device=in_w.device)
    d_out_b = torch.empty(out_w.shape[0], dtype=in_w.dtype, device=in_w.device)
    with state.protection.errors_recorded(), device_scope(dy), threads(dy):
        grads_out = {k: v for k, v in params_of(d_in_w, d_in_b, d_out_w, d_out_b).items()
                     if k != "w_qkv"}
        dx, grads = attention_backward(state.saved, array(dy), context,
                                       workspace=state.workspace, grads_out=grads_out)
        if state.call.self_attention:
            empty = dy.new_empty(0)
            d_inputs = (to_tensor(dx), empty, empty.clone())
        else:
            d_inputs = tuple(to_tensor(d) for d in dx)
        d_masks = state.call.mask_grads(grads.get("attn_mask"), key_padding_mask, attn_mask, dy)
    state.protection.book(found, state.report)
    return (*d_inputs, d_in_w, d_in_b, d_out_w, d_out_b, *d_masks)


def _param_views(protection: Protection, in_w: torch.Tensor, in_b: torch.Tensor | None,
                 out_w: torch.Tensor, out_b: torch.Tensor | None) -> dict[str, Any]:
    """:func:`params_of` of these tensors, kept by ``protection`` while none of them moved to
    other memory or changed layout (optimizer steps update them in place, which the views
    see)."""
    key = tuple(None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride())
                for t in (in_w, in_b, out_w, out_b))
    return protection.memo(key, lambda: params_of(in_w, in_b, out_w, out_b))


def params_of(in_w: torch.Tensor, in_b: torch.Tensor | None, out_w: torch.Tensor,
            out_b: torch.Tensor | None) -> dict[str, Any]:
    """The core's ``x @ w`` parameters as views of torch's ``x @ W.T`` ones (no copies)."""
    w, e = array(in_w), in_w.shape[1]
    zeros = None
    if in_b is None or out_b is None:
        zeros = array(torch.zeros(e, dtype=in_w.dtype, device=in_w.device))
    b = array(in_b) if in_b is not None else None
    params = {"wo": array(out_w).T, "bo": array(out_b) if out_b is not None else zeros,
              "w_qkv": w.T}
    for i, name in enumerate("qkv"):
        params["w" + name] = w[i * e:(i + 1) * e].T
        params["b" + name] = b[i * e:(i + 1) * e] if b is not None else zeros
    return params


# ---------------------------------------------------------------------------------- inputs


class _Call:
    """One forward call's inputs in the core's layout: batch-first tensors, masks as arrays."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)
        self.probs: Any = None

    @classmethod
    def of(cls, heads: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
           is_causal: bool, self_attention: bool, mask_grad: bool = False) -> "_Call":
        """Batch-first ``q``, ``k``, ``v`` (N, L|S, E) and the masks as the core takes them: a
        boolean key padding mask as ``key_visible``, a float one as ``key_add`` (N, S), O(S) per
        batch item, which the fused core adds to every query row and the unfused core folds in
        itself, unless ``mask_grad``: then it is folded into ``attn_mask`` here, a float (N *
        heads, L, S) array (:func:`_attn_mask`), whose gradient the unfused core returns and
        :meth:`mask_grads` sums to the padding's."""
        n, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
        check_masks(key_padding_mask, attn_mask, heads, n, seq_q, seq_k)
        key_visible, float_padding = _padding(key_padding_mask)
        folded = float_padding if mask_grad else None
        mask = _attn_mask(attn_mask, folded, heads, n, seq_q, seq_k)
        key_add = None if float_padding is None or mask_grad else mask_array(float_padding)
        return cls(self_attention=self_attention, key_visible=key_visible, key_add=key_add,
                   attn_mask=mask, causal=bool(is_causal) and attn_mask is None,
                   shape=(n, seq_q, seq_k), heads=heads, folded=folded is not None)

    def mask_grads(self, grad: Any | None, key_padding_mask: torch.Tensor | None,
                   attn_mask: torch.Tensor | None, like: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d_key_padding_mask, d_attn_mask)`` from the gradient ``grad`` of the mask the core
        took (:func:`_attn_mask`: a float key padding mask folded into ``(N * heads, L, S)``),
        each in its mask's shape and dtype; empty where that mask is absent or boolean, or
        where no gradient was made."""
        empty = like.new_empty(0)
        if grad is None:
            return empty, empty.clone()
        g = to_tensor(grad)
        n, seq_q, seq_k = self.shape
        d_padding = g.view(n, self.heads, seq_q, seq_k).sum((1, 2)) if self.folded else None
        d_mask = None
        if attn_mask is not None and attn_mask.is_floating_point():
            d_mask = g.sum(0) if self.folded and attn_mask.dim() == 2 else g
        return tuple(empty.clone() if d is None else d.to(m.dtype)
                     for d, m in ((d_padding, key_padding_mask), (d_mask, attn_mask)))

    def weights(self, average: bool) -> torch.Tensor:
        """The attention probabilities of this call, as torch returns them (no gradient)."""
        n, seq_q, seq_k = self.shape
        probs = to_tensor(self.probs).view(n, self.heads, seq_q, seq_k)
        # The probabilities are also saved for backward: hand out a new tensor, never a view.
        return probs.mean(dim=1) if average else probs.clone()


def check_masks(key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                heads: int, n: int, seq_q: int, seq_k: int) -> None:
    """Raise ``TypeError`` for a mask neither bool nor float, ``ValueError`` for one of a shape
    the forward does not take (``key_padding_mask`` ``(N, S)``, ``attn_mask`` ``(L, S)`` or ``(N
    * heads, L, S)``). :func:`attention.torch_functional.multi_head_attention` checks them before
    it draws its dropout, so that a refused call leaves PyTorch's generator as it was."""
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"{name} must be bool or float, got {mask.dtype}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (n, seq_k):
        raise ValueError(f"key_padding_mask must have shape {(n, seq_k)} (batch, seq_k), got "
                         f"{tuple(key_padding_mask.shape)}")
    if attn_mask is not None and tuple(attn_mask.shape) != (seq_q, seq_k) \
            and tuple(attn_mask.shape) != (n * heads, seq_q, seq_k):
        raise ValueError(f"attn_mask must have shape {(seq_q, seq_k)} or "
                         f"{(n * heads, seq_q, seq_k)}, got {tuple(attn_mask.shape)}")


def _padding(mask: torch.Tensor | None) -> tuple[Any, torch.Tensor | None]:
    """(boolean key_visible array or None, float additive padding (N, S) or None) of a
    :func:`check_masks`-checked key padding mask."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return array(mask.logical_not()), None
    return None, mask


def _attn_mask(mask: torch.Tensor | None, float_padding: torch.Tensor | None, heads: int,
               n: int, seq_q: int, seq_k: int) -> Any:
    """``attn_mask`` as the core takes it (boolean or float array, 2-D or 3-D); a float key
    padding mask given here (one whose gradient is wanted) is folded in as a float64 (N * heads,
    L, S) mask, the way torch merges them (``mask`` checked by :func:`check_masks`)."""
    if float_padding is None:
        return None if mask is None else mask_array(mask)
    add = torch.zeros((n * heads, seq_q, seq_k), dtype=torch.float64, device=float_padding.device)
    if mask is not None:
        add += (mask.to(torch.float64).masked_fill(mask, -math.inf) if mask.dtype == torch.bool
                else mask.to(torch.float64)).detach()
    add.view(n, heads, seq_q, seq_k).add_(float_padding.detach().to(torch.float64)[:, None, None])
    return array(add)
