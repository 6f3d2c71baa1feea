"""``torch.nn.MultiheadAttention`` with every GEMM of its forward and backward checksum-protected.

:class:`MultiheadAttention` subclasses PyTorch's module: same constructor, parameters
(``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``), ``state_dict``,
forward signature and return values, so it loads the same weights and swaps into an existing
model (``nn.TransformerEncoderLayer(...).self_attn``). Its forward and backward run the functional
core (:func:`attention.attention_forward`, :func:`attention.attention_backward`) on the memory of
the tensors (no copies: CPU tensors as NumPy arrays, CUDA tensors as CuPy arrays) inside
one ``torch.autograd.Function``. :func:`protect` swaps every ``nn.MultiheadAttention`` of a model
in place, keeping its Parameter objects (an optimizer built before still holds them).

Supported: self- and cross-attention (``key is value`` or not), boolean and float ``attn_mask``
(``(L, S)`` or ``(N * num_heads, L, S)``, True = not allowed), boolean and float
``key_padding_mask`` (True = ignore), batch-first and sequence-first, unbatched inputs, ``bias``,
``need_weights`` with ``average_attn_weights``, ``is_causal``, dtypes float16, bfloat16, float32,
float64, CPU and CUDA tensors, attention ``dropout`` in training mode (the mask drawn with PyTorch's
generator, so ``torch.manual_seed`` reproduces a run; :mod:`attention.dropout`). Not supported (a
clear error names the argument): ``add_bias_kv``, ``add_zero_attn``, ``kdim``/``vdim`` other than
``embed_dim``, nested tensors.

Differences from PyTorch: the returned attention weights carry no gradient; a query row whose
keys are all masked gets probabilities 0 (output ``out_proj.bias``), where PyTorch may give NaN;
``is_causal=True`` without ``attn_mask`` applies the causal mask (PyTorch raises).

On the CPU, the module's GEMMs run under the library's thread policy (:mod:`abftgemm.threads`):
PyTorch's intra-op threads, which spin-wait on the other cores after each of PyTorch's own
operations, and other processes' running tasks count as busy cores, so NumPy's BLAS threads do
not fight them. PyTorch's own thread settings are left as they are.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
from torch import nn

import abftgemm
from abftgemm._torch import device_scope, to_array, to_tensor
from abftgemm.report import Report, register_library_package
from abftgemm.threads import blas_scope
from attention.context import Context
from attention.functional import attention_backward, attention_forward
from attention.plan import CheckingPlan
from attention.workspace import Workspace
from attention import _torch_op

register_library_package("attention")  # fault warnings point at the caller of the module

FaultHook = Callable[[str, Any], None]
__all__ = ["MultiheadAttention", "protect", "fault_hook"]


class MultiheadAttention(nn.MultiheadAttention):
    """Drop-in ``torch.nn.MultiheadAttention`` on ABFT-protected GEMMs, forward and backward.

    Parameters
    ----------
    embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, \
device, dtype
        As in ``torch.nn.MultiheadAttention`` (``dropout`` applies in training mode only);
        ``add_bias_kv`` and ``add_zero_attn`` False, ``kdim`` and ``vdim`` None or
        ``embed_dim``.
    check : {"correct", "detect", "off"}
        As in :func:`abftgemm.matmul`, for every site.
    plan : attention.CheckingPlan, optional
        How often each site is checked (default: every call).

    Attributes
    ----------
    fault_hook : callable ``(site, c)`` or None
        Called with every site's raw product (a NumPy or CuPy array sharing the GEMM output)
        before verification, forward and backward; the sites are ``attention.SITES`` (plus
        ``attention.CROSS_SITES`` in cross-attention), ``attention.INVARIANT_SITES`` and, with
        dropout in training, ``"dropout"``.
    last_report : abftgemm.Report
        Findings of the last forward, extended by its backward.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device: Any = None,
                 dtype: Any = None, *, check: str = "correct", plan: CheckingPlan | None = None):
        _refuse_unsupported(embed_dim, dropout, add_bias_kv, add_zero_attn, kdim, vdim)
        if check not in abftgemm.CHECK_MODES:
            raise ValueError(f"check must be one of {abftgemm.CHECK_MODES}, got {check!r}")
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias,
                         batch_first=batch_first, device=device, dtype=dtype)
        self.check = check
        self.plan = plan or CheckingPlan()
        self.fault_hook: FaultHook | None = None
        self.last_report = Report()
        self._workspaces: dict[torch.device, Workspace] = {}  # plans and buffers, per device
        self._views: tuple[tuple, dict[str, Any]] = ((), {})
        #: Names this module in the custom operators' calls (attention/_torch_op.py).
        self.op_id = _torch_op.register(self)
        # nn.TransformerEncoderLayer's inference fast path reads self_attn's weights and never
        # calls its forward (it would run unprotected); it is skipped for any module with hooks.
        self.register_forward_pre_hook(_keep_off_fused_paths)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, *, check: str = "correct",
                   plan: CheckingPlan | None = None) -> "MultiheadAttention":
        """A protected module holding ``module``'s own Parameters (shared, not copied)."""
        if not module._qkv_same_embed_dim:
            raise ValueError("kdim/vdim must equal embed_dim (separate q/k/v projection weights "
                             "are not supported)")
        new = cls(module.embed_dim, module.num_heads, module.dropout,
                  module.in_proj_bias is not None, module.bias_k is not None,
                  module.add_zero_attn, batch_first=module.batch_first, device="meta",
                  check=check, plan=plan)
        new.in_proj_weight, new.in_proj_bias = module.in_proj_weight, module.in_proj_bias
        new.out_proj = module.out_proj
        new.train(module.training)
        return new

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention output and weights, as ``torch.nn.MultiheadAttention.forward``.

        Parameters
        ----------
        query : tensor (L, E), (L, N, E), or (N, L, E) when ``batch_first``
        key, value : tensor (S, E), (S, N, E), or (N, S, E) when ``batch_first``
            The same tensor object as ``query`` for self-attention.
        key_padding_mask : bool or float tensor (N, S) or (S,), optional
            True (or the float added) for keys to ignore.
        need_weights : bool
            Also return the attention weights.
        attn_mask : bool or float tensor (L, S) or (N * num_heads, L, S), optional
            True = not allowed; a float mask is added to the scaled scores.
        average_attn_weights : bool
            Average the weights over heads.
        is_causal : bool
            Query ``i`` sees keys ``j <= i`` only when ``attn_mask`` is None; with
            ``attn_mask``, a hint that it is the causal mask (``attn_mask`` is applied).

        Returns
        -------
        attn_output : tensor, the layout of ``query``
        attn_output_weights : tensor (N, L, S), (N, num_heads, L, S), (L, S) or
            (num_heads, L, S) unbatched, or None when ``need_weights`` is False
        """
        batched, self_attention = _check_inputs(query, key, value)
        q, k, v = (_batch_first(t, batched, self.batch_first, name)
                   for name, t in (("query", query), ("key", key), ("value", value)))
        if self_attention:
            k = v = q
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)
        p = self.dropout if self.training else 0.0
        keep = None if p == 0 else \
            torch.rand((q.shape[0] * self.num_heads, q.shape[1], k.shape[1]),
                       device=q.device) >= p
        y, weights, _ = _torch_op.mha_forward(
            self.op_id, q, k, v, self.in_proj_weight, self.in_proj_bias, self.out_proj.weight,
            self.out_proj.bias, key_padding_mask, attn_mask, self.num_heads, self_attention,
            bool(is_causal), need_weights, average_attn_weights, keep, float(p))
        if not batched:
            y, weights = y.squeeze(0), weights.squeeze(0) if need_weights else weights
        elif not self.batch_first:
            y = y.transpose(0, 1)
        return y, (weights if need_weights else None)

    def __getstate__(self) -> dict[str, Any]:
        """The module without its caches (plans, buffers, parameter views), which hold
        array modules and memory no copy should share: ``copy.deepcopy``, ``torch.save`` and
        ``pickle`` work after a forward, and a copy builds its own caches on first use."""
        state = self.__dict__.copy()
        state["_workspaces"], state["_views"] = {}, ((), {})
        del state["op_id"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.op_id = _torch_op.register(self)

    def _workspace_for(self, device: torch.device) -> Workspace:
        """The plans and buffers of the calls on ``device`` (a module moved to another device,
        or replicated over several, keeps one workspace per device)."""
        ws = self._workspaces.get(device)
        if ws is None:
            ws = self._workspaces[device] = Workspace()
        return ws

    def _param_views(self, in_w: torch.Tensor, in_b: torch.Tensor | None, out_w: torch.Tensor,
                     out_b: torch.Tensor | None) -> dict[str, Any]:
        """:func:`_params` of these tensors, kept while none of them moved to other memory or
        changed layout (optimizer steps update them in place, which the views see)."""
        key = tuple(None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride())
                    for t in (in_w, in_b, out_w, out_b))
        if self._views[0] != key:
            self._views = key, _params(in_w, in_b, out_w, out_b)
        return self._views[1]


def protect(model: nn.Module, *, check: str = "correct", mlp: bool = False,
            projections: bool = True) -> nn.Module:
    """Swap every ``nn.MultiheadAttention`` inside ``model`` for a :class:`MultiheadAttention`
    holding the same Parameters, in place; returns ``model``.

    ``nn.TransformerEncoder``'s nested-tensor inference path is turned off
    (``use_nested_tensor = False``): it would hand the attention packed nested tensors.
    A Hugging Face transformers ``PreTrainedModel`` gets its attention products, and with
    ``projections`` (default) the Q, K, V and output projections of its attention blocks,
    protected instead; ``mlp=True`` protects its feed-forward layers as well
    (:func:`attention.hf_protect.protect_pretrained`). ``mlp`` and ``projections`` apply to
    transformers models only (:class:`MultiheadAttention` protects its own projections).
    """
    if _is_pretrained(model):
        from attention.hf_protect import protect_pretrained

        return protect_pretrained(model, check=check, mlp=mlp, projections=projections)
    if mlp or not projections:
        raise ValueError("protect: mlp and projections apply to transformers models only")
    for parent in model.modules():
        if isinstance(parent, nn.TransformerEncoder):
            parent.use_nested_tensor = False
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention) and not isinstance(child,
                                                                           MultiheadAttention):
                setattr(parent, name, MultiheadAttention.from_torch(child, check=check))
    return model


def fault_hook(model: nn.Module, fn: FaultHook) -> contextlib.AbstractContextManager[None]:
    """A context manager within which ``fn(site, c)`` sees every protected product (attention
    and projections) of a protected transformers model, ``site`` as ``"<module name>:<site>"``
    (for example ``"transformer.h.0.attn:scores"``, ``"transformer.h.0.attn.c_attn:forward"``);
    see :func:`attention.hf_protect.fault_hook`."""
    from attention.hf_protect import fault_hook as hook

    return hook(model, fn)


def _is_pretrained(model: nn.Module) -> bool:
    """True for a transformers ``PreTrainedModel`` (without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


# ---------------------------------------------------------------------------------- passes
# The bodies of the custom operators abftgemm::mha_forward and abftgemm::mha_backward
# (attention/_torch_op.py), on batch-first tensors.


class _Saved:
    """What one forward leaves for its backward (carried by the operators' token)."""

    def __init__(self, call: "_Call", saved: dict[str, Any], report: Report,
                 workspace: Workspace):
        self.call, self.saved, self.report, self.workspace = call, saved, report, workspace


def run_forward(module: MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, in_w: torch.Tensor, in_b: torch.Tensor | None,
                out_w: torch.Tensor, out_b: torch.Tensor | None,
                key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                self_attention: bool, is_causal: bool, need_weights: bool, average: bool,
                dropout_keep: torch.Tensor | None = None,
                dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, _Saved]:
    """``(y, weights or an empty tensor, saved state)`` of one forward, batch-first; with
    ``dropout``, ``dropout_keep`` is its mask ``(N * heads, L, S)``, True = kept."""
    call = _Call.of(module, query, key, value, key_padding_mask, attn_mask, is_causal,
                    self_attention)
    workspace = module._workspace_for(query.device)
    with device_scope(query), _threads(query):
        params = module._param_views(in_w, in_b, out_w, out_b)
        x = _array(query)
        cross = {} if self_attention else {"key": _array(key), "value": _array(value)}
        context = Context(module.check, module.plan, module.fault_hook)
        y, saved = attention_forward(params, x, context, n_heads=module.num_heads,
                                     causal=call.causal, key_visible=call.key_visible,
                                     attn_mask=call.attn_mask, dropout=dropout,
                                     dropout_keep=None if dropout_keep is None else
                                     _array(dropout_keep), workspace=workspace, **cross)
        y = to_tensor(y)
        # torch returns the weights after dropout
        dropped = saved["probs_dropped"]
        call.probs = saved["probs"] if dropped is None else dropped
        weights = call.weights(average) if need_weights else query.new_empty(0)
    module.last_report = context.report
    return y, weights, _Saved(call, saved, context.report, workspace)


def run_backward(state: _Saved, dy: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, in_w: torch.Tensor, in_b: torch.Tensor | None,
                 out_w: torch.Tensor, out_b: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``(d_query, d_key, d_value, d_in_w, d_in_b, d_out_w, d_out_b)``; ``d_key`` and ``d_value``
    empty in self-attention. The inputs and parameters are read from the tensors given here
    (those of the forward, which autograd kept)."""
    module = state.call.module
    inputs = state.saved["inputs"]
    inputs.x = _array(query)
    inputs.key, inputs.value = (inputs.x, inputs.x) if state.call.self_attention else \
        (_array(key), _array(value))
    inputs.params = _params(in_w, in_b, out_w, out_b)
    context = Context(module.check, module.plan, module.fault_hook, state.report)
    # The core writes the parameter gradients straight into torch's layout (transposed views
    # of these buffers: no copies, no concatenation).
    d_in_w, d_out_w = torch.empty_like(in_w), torch.empty_like(out_w)
    d_in_b = torch.empty(in_w.shape[0], dtype=in_w.dtype, device=in_w.device)
    d_out_b = torch.empty(out_w.shape[0], dtype=in_w.dtype, device=in_w.device)
    with device_scope(dy), _threads(dy):
        grads_out = {k: v for k, v in _params(d_in_w, d_in_b, d_out_w, d_out_b).items()
                     if k != "w_qkv"}
        dx, _ = attention_backward(state.saved, _array(dy), context,
                                   workspace=state.workspace, grads_out=grads_out)
        if state.call.self_attention:
            empty = dy.new_empty(0)
            d_inputs = (to_tensor(dx), empty, empty.clone())
        else:
            d_inputs = tuple(to_tensor(d) for d in dx)
    module.last_report = state.report
    return (*d_inputs, d_in_w, d_in_b, d_out_w, d_out_b)


def _threads(t: torch.Tensor) -> blas_scope | contextlib.nullcontext:
    """The library's thread policy for a pass on ``t``'s device: on the CPU, PyTorch's intra-op
    threads count as busy cores (:mod:`abftgemm.threads`)."""
    return blas_scope(torch.get_num_threads()) if t.is_cpu else contextlib.nullcontext()


def _array(t: torch.Tensor) -> Any:
    return to_array(t.detach(), "attention input")


def _params(in_w: torch.Tensor, in_b: torch.Tensor | None, out_w: torch.Tensor,
            out_b: torch.Tensor | None) -> dict[str, Any]:
    """The core's ``x @ w`` parameters as views of torch's ``x @ W.T`` ones (no copies)."""
    w, e = _array(in_w), in_w.shape[1]
    zeros = None
    if in_b is None or out_b is None:
        zeros = _array(torch.zeros(e, dtype=in_w.dtype, device=in_w.device))
    b = _array(in_b) if in_b is not None else None
    params = {"wo": _array(out_w).T, "bo": _array(out_b) if out_b is not None else zeros,
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
    def of(cls, module: MultiheadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
           is_causal: bool, self_attention: bool) -> "_Call":
        """Batch-first ``q``, ``k``, ``v`` (N, L|S, E) and the masks as the core takes them."""
        n, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
        key_visible, float_padding = _padding(key_padding_mask, n, seq_k)
        mask = _attn_mask(attn_mask, float_padding, module.num_heads, n, seq_q, seq_k, q.dtype)
        return cls(module=module, self_attention=self_attention, key_visible=key_visible,
                   attn_mask=mask, causal=bool(is_causal) and attn_mask is None,
                   shape=(n, seq_q, seq_k))

    def weights(self, average: bool) -> torch.Tensor:
        """The attention probabilities of this call, as torch returns them (no gradient)."""
        n, seq_q, seq_k = self.shape
        probs = to_tensor(self.probs).view(n, -1, seq_q, seq_k)
        # The probabilities are also saved for backward: hand out a new tensor, never a view.
        return probs.mean(dim=1) if average else probs.clone()


def _check_inputs(query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor) -> tuple[bool, bool]:
    """``(batched, self_attention)`` of valid forward inputs; a clear error otherwise."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise ValueError(f"{name} is a nested tensor, which is not supported; for "
                             "nn.TransformerEncoder set use_nested_tensor = False (protect() "
                             "does)")
    if query.dim() not in (2, 3):
        raise ValueError(f"query must be 2-D (unbatched) or 3-D, got shape "
                         f"{tuple(query.shape)}")
    return query.dim() == 3, query is key and key is value


def _batch_first(t: torch.Tensor, batched: bool, batch_first: bool, name: str) -> torch.Tensor:
    """(N, L, E) view of a query/key/value tensor in the module's layout."""
    if t.dim() != (3 if batched else 2):
        raise ValueError(f"{name} must be {'3' if batched else '2'}-D like query, got shape "
                         f"{tuple(t.shape)}")
    if not batched:
        return t.unsqueeze(0)
    return t if batch_first else t.transpose(0, 1)


def _padding(mask: torch.Tensor | None, n: int, seq_k: int) -> tuple[Any, torch.Tensor | None]:
    """(boolean key_visible array or None, float additive padding (N, S) or None)."""
    if mask is None:
        return None, None
    if tuple(mask.shape) != (n, seq_k):
        raise ValueError(f"key_padding_mask must have shape {(n, seq_k)} (batch, seq_k), got "
                         f"{tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return _array(mask.logical_not()), None
    if not mask.is_floating_point():
        raise TypeError(f"key_padding_mask must be bool or float, got {mask.dtype}")
    return None, mask


def _attn_mask(mask: torch.Tensor | None, float_padding: torch.Tensor | None, heads: int,
               n: int, seq_q: int, seq_k: int, dtype: torch.dtype) -> Any:
    """``attn_mask`` as the core takes it (boolean or float array, 2-D or 3-D); a float key
    padding mask is folded in as a float (N * heads, L, S) mask, the way torch merges them."""
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool or float, got {mask.dtype}")
    if float_padding is None:
        return None if mask is None else _array(mask)
    add = torch.zeros((n * heads, seq_q, seq_k), dtype=torch.float64, device=float_padding.device)
    if mask is not None:
        if mask.dim() == 3 and mask.shape[0] != n * heads:
            raise ValueError(f"a 3-D attn_mask must have shape {(n * heads, seq_q, seq_k)}, got "
                             f"{tuple(mask.shape)}")
        add += (mask.to(torch.float64).masked_fill(mask, -math.inf) if mask.dtype == torch.bool
                else mask.to(torch.float64)).detach()
    add.view(n, heads, seq_q, seq_k).add_(float_padding.detach().to(torch.float64)[:, None, None])
    return _array(add)


def _refuse_unsupported(embed_dim: int, dropout: float, add_bias_kv: bool, add_zero_attn: bool,
                        kdim: int | None, vdim: int | None) -> None:
    if not 0 <= dropout <= 1:
        raise ValueError(f"dropout must be a probability in [0, 1], got {dropout}")
    if add_bias_kv:
        raise ValueError("add_bias_kv=True is not supported")
    if add_zero_attn:
        raise ValueError("add_zero_attn=True is not supported")
    for name, dim in (("kdim", kdim), ("vdim", vdim)):
        if dim is not None and dim != embed_dim:
            raise ValueError(f"{name}={dim} is not supported: {name} must equal embed_dim "
                             f"({embed_dim})")


def _keep_off_fused_paths(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook that does nothing; its presence is what counts (see ``__init__``)."""
