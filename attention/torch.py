"""``torch.nn.MultiheadAttention`` with every GEMM of its forward and backward checksum-protected.

:class:`MultiheadAttention` subclasses PyTorch's module: same constructor, parameters
(``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``), ``state_dict``,
forward signature and return values, so it loads the same weights and swaps into an existing
model (``nn.TransformerEncoderLayer(...).self_attn``). Its forward and backward run the functional
core (:func:`attention.attention_forward`, :func:`attention.attention_backward`) on the memory of
the tensors (no copies: CPU tensors as NumPy arrays, CUDA tensors as CuPy arrays), through
:func:`attention.torch_functional.multi_head_attention` under the module's
:class:`~attention.torch_functional.Protection`. :func:`protect` swaps every
``nn.MultiheadAttention`` of a model in place, keeping its Parameter objects (an optimizer built
before still holds them).

Supported: self- and cross-attention (``key is value`` or not), boolean and float ``attn_mask``
(``(L, S)`` or ``(N * num_heads, L, S)``, True = not allowed), boolean and float
``key_padding_mask`` (True = ignore), batch-first and sequence-first, unbatched inputs, ``bias``,
``need_weights`` with ``average_attn_weights``, ``is_causal``, dtypes float16, bfloat16, float32,
float64, CPU and CUDA tensors, attention ``dropout`` in training mode (the mask, or on the CPU
and with ``core="fused"`` the seed of the fused core's keep decisions, drawn with PyTorch's
generator, so
``torch.manual_seed`` reproduces a run; :mod:`attention.dropout`, :mod:`attention.dropout_hash`).
Not supported (a clear error names the argument): ``add_bias_kv``, ``add_zero_attn``,
``kdim``/``vdim`` other than ``embed_dim``, nested tensors.

Differences from PyTorch: a loss on the returned attention weights raises
``NotImplementedError`` (their gradient is not propagated); a query row whose keys are all
masked gets probabilities 0 (output ``out_proj.bias``), where PyTorch may give NaN;
``is_causal=True`` without ``attn_mask`` applies the causal mask (PyTorch raises).

On the CPU, the module's GEMMs run under the library's thread policy (:mod:`abftgemm.threads`):
PyTorch's intra-op threads, which spin-wait on the other cores after each of PyTorch's own
operations, and other processes' running tasks count as busy cores, so NumPy's BLAS threads do
not fight them. PyTorch's own thread settings are left as they are.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from abftgemm.report import register_library_package
from attention._torch_state import Protection, ProtectionAttribute
from attention.fused_choice import check_core
from attention.plan import CheckingPlan
from attention.torch_core import ProtectedCore
from attention.torch_functional import multi_head_attention
from attention.torch_linear import ProtectedLinearCore

register_library_package("attention")  # fault warnings point at the caller of the module

FaultHook = Callable[[str, Any], None]
__all__ = ["MultiheadAttention", "protect", "fault_hook", "protected_cores"]


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
    core : {"auto", "fused", "unfused"}
        The attention product between the projections (:func:`attention.attention_forward`'s
        ``core``): ``"auto"`` runs the fused core (:mod:`attention.fused`) where it applies
        (CPU, any float dtype, dropout included, ``need_weights=False``, no mask that wants
        its gradient, no fault hook, every call checked), else the unfused sites;
        the others force one.

    Attributes
    ----------
    protection : attention.torch_functional.Protection
        What its calls run under; ``check``, ``plan``, ``fault_hook``, ``last_report``,
        ``total_report`` and ``last_core`` are its attributes, read and set through the module.
    fault_hook : callable ``(site, c)`` or None
        Called with every site's raw product (a NumPy or CuPy array sharing the GEMM output)
        before verification, forward and backward; the sites are ``attention.SITES`` (plus
        ``attention.CROSS_SITES`` in cross-attention), ``attention.INVARIANT_SITES`` and, with
        dropout in training, ``"dropout"``.
    last_report : abftgemm.Report
        The findings of the last pass: the last forward's, extended by its backward. A module
        called twice in a step (a shared layer, an encoder reused) ends the step with its first
        call's report here, since autograd runs that call's backward last.
    total_report : abftgemm.Report
        Every finding of every call (each forward, backward and checkpointed recomputation)
        since it was last replaced: set ``module.total_report = abftgemm.Report()`` where a
        step begins and read it after the backward to see all of the step's findings (a
        call that raises ``UncorrectableError`` adds the error's report).
    last_core : str or None
        ``"fused"`` or ``"unfused"``: the attention product the last forward ran (the
        protection's).
    """

    check = ProtectionAttribute()
    plan = ProtectionAttribute()
    fault_hook = ProtectionAttribute()
    last_report = ProtectionAttribute()
    total_report = ProtectionAttribute()
    last_core = ProtectionAttribute()

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device: Any = None,
                 dtype: Any = None, *, check: str = "correct", plan: CheckingPlan | None = None,
                 core: str = "auto"):
        _refuse_unsupported(embed_dim, dropout, add_bias_kv, add_zero_attn, kdim, vdim)
        check_core(core)
        protection = Protection(check, plan)
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias,
                         batch_first=batch_first, device=device, dtype=dtype)
        self.protection, self.core = protection, core
        # nn.TransformerEncoderLayer's inference fast path reads self_attn's weights and never
        # calls its forward (it would run unprotected); it is skipped for any module with hooks.
        self.register_forward_pre_hook(_keep_off_fused_paths)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, *, check: str = "correct",
                   plan: CheckingPlan | None = None, core: str = "auto") -> "MultiheadAttention":
        """A protected module holding ``module``'s own Parameters (shared, not copied), its
        hooks (forward, backward and state-dict hooks: the same dictionaries, so their handles
        still remove them; ``module`` thereby gets the protected module's no-op pre-hook that
        keeps PyTorch's fused inference paths off) and the attributes set on it that a module of
        its class lacks."""
        if not module._qkv_same_embed_dim:
            raise ValueError("kdim/vdim must equal embed_dim (separate q/k/v projection weights "
                             "are not supported)")
        if not isinstance(module.in_proj_weight, nn.Parameter):
            raise ValueError("protect: this nn.MultiheadAttention's in_proj_weight is computed "
                             "(a parametrization or pruning); protect the module first, then "
                             "parametrize or prune the protected one")
        if "forward" in vars(module):
            raise ValueError("protect: this nn.MultiheadAttention has a forward set on the module "
                             "itself (an accelerate hook?), which the protected module would "
                             "not run")
        new = cls(module.embed_dim, module.num_heads, module.dropout,
                  module.in_proj_bias is not None, module.bias_k is not None,
                  module.add_zero_attn, batch_first=module.batch_first, device="meta",
                  check=check, plan=plan, core=core)
        new.in_proj_weight, new.in_proj_bias = module.in_proj_weight, module.in_proj_bias
        new.out_proj = module.out_proj
        new.train(module.training)
        mine = vars(new)
        for name, value in vars(module).items():
            if "hook" in name or name not in mine:
                mine[name] = value
        if _keep_off_fused_paths not in new._forward_pre_hooks.values():
            new.register_forward_pre_hook(_keep_off_fused_paths)
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
            True (or the float added) for keys to ignore. A float mask reaches the fused core as
            it is, O(S) per batch item; one that requires grad is folded into a float64 (N *
            num_heads, L, S) mask and runs the unfused core, whose checked ``dS``, summed over
            heads and queries, is its gradient.
        need_weights : bool
            Also return the attention weights.
        attn_mask : bool or float tensor (L, S) or (N * num_heads, L, S), optional
            True = not allowed; a float mask is added to the scaled scores.
        average_attn_weights : bool
            Average the weights over heads.
        is_causal : bool
            Query ``i`` sees keys ``j <= i`` only when ``attn_mask`` is None (top-left aligned
            where ``L != S``, as ``scaled_dot_product_attention``'s ``is_causal``); with
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
            if key_padding_mask.dim() != 1:
                raise ValueError(f"key_padding_mask of an unbatched query must be 1-D (seq_k,), "
                                 f"got shape {tuple(key_padding_mask.shape)}")
            key_padding_mask = key_padding_mask.unsqueeze(0)
        y, weights = multi_head_attention(
            q, k, v, self.num_heads, self.in_proj_weight, self.in_proj_bias,
            self.out_proj.weight, self.out_proj.bias, protection=self.protection,
            key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=need_weights,
            average_attn_weights=average_attn_weights, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0, core=self.core)
        if not batched:
            y, weights = y.squeeze(0), weights.squeeze(0) if need_weights else weights
        elif not self.batch_first:
            y = y.transpose(0, 1)
        return y, weights


def protect(model: nn.Module, *, check: str = "correct", mlp: bool = False,
            projections: bool = True) -> nn.Module:
    """Protect every attention inside ``model``, in place; returns ``model``.

    Every ``nn.MultiheadAttention`` becomes a :class:`MultiheadAttention` holding the same
    Parameters and hooks (one protected module for each, wherever and under however many names
    it appears); ``model`` itself, if it is one, cannot be swapped in place: the protected module
    is returned. ``nn.TransformerEncoder``'s nested-tensor inference path is turned off
    (``use_nested_tensor = False``): it would hand the attention packed nested tensors. A
    Hugging Face transformers ``PreTrainedModel`` gets its attention products, and with
    ``projections`` (default) the Q, K, V and output projections of its attention blocks,
    protected; ``mlp=True`` protects its feed-forward layers as well
    (:func:`attention.hf_protect.protect_pretrained`). So does every transformers model inside
    ``model`` (a PEFT ``PeftModel``'s, a training wrapper's). ``mlp`` and ``projections`` apply
    to transformers models only (:class:`MultiheadAttention` protects its own projections).

    Raises
    ------
    ValueError
        When ``model`` holds neither an ``nn.MultiheadAttention`` nor a transformers model
        (nothing would be protected), or for ``mlp``/``projections`` without a transformers
        model.
    """
    pretrained = [model] if _is_pretrained(model) else _pretrained_inside(model)
    if (mlp or not projections) and not pretrained:
        raise ValueError("protect: mlp and projections apply to transformers models only")
    if isinstance(model, nn.MultiheadAttention):
        return model if isinstance(model, MultiheadAttention) else \
            MultiheadAttention.from_torch(model, check=check)
    swaps = _multihead_swaps(model, check)  # made before anything changes: they may raise
    if pretrained:
        from attention.hf_protect import check_pretrained, protect_pretrained

        for m in pretrained:  # every model checked before any is protected
            check_pretrained(m, check=check, mlp=mlp, projections=projections)
        for m in pretrained:
            protect_pretrained(m, check=check, mlp=mlp, projections=projections)
    for parent, name, protected in swaps:
        setattr(parent, name, protected)
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder):
            m.use_nested_tensor = False
    if not pretrained and not any(isinstance(m, nn.MultiheadAttention) for m in model.modules()):
        raise ValueError(f"protect: {type(model).__name__} holds no nn.MultiheadAttention and "
                         "no transformers model, so nothing would be protected")
    return model


def _multihead_swaps(model: nn.Module, check: str
                     ) -> list[tuple[nn.Module, str, "MultiheadAttention"]]:
    """``(parent, name, protected)`` for every ``nn.MultiheadAttention`` child of every module
    inside ``model``: one protected module per original (an original under two names gets the
    same one under both)."""
    protected: dict[int, MultiheadAttention] = {}
    swaps = []
    for parent in model.modules():
        for name, child in parent._modules.items():
            if isinstance(child, nn.MultiheadAttention) and not isinstance(child,
                                                                           MultiheadAttention):
                if id(child) not in protected:
                    protected[id(child)] = MultiheadAttention.from_torch(child, check=check)
                swaps.append((parent, name, protected[id(child)]))
    return swaps


def _pretrained_inside(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers ``PreTrainedModel`` modules inside ``model`` (none of their
    own submodules)."""
    found: list[nn.Module] = []
    for child in model.children():
        found += [child] if _is_pretrained(child) else _pretrained_inside(child)
    return found


def protected_cores(model: nn.Module) -> dict[str, Any]:
    """What each protected module of ``model`` runs under, by module name: the
    :class:`Protection` of every :class:`MultiheadAttention`, the
    :class:`attention.torch_core.ProtectedCore` of every protected transformers attention
    module and the ``ProtectedLinearCore`` of every protected projection; each has ``check``,
    ``fault_hook`` and ``last_report``."""
    owners = {}
    for name, module in model.named_modules():
        if isinstance(module, MultiheadAttention):
            owners[name] = module.protection
        for attr, kind in (("abft_core", ProtectedCore), ("abft_linear", ProtectedLinearCore)):
            if isinstance(module.__dict__.get(attr), kind):
                owners[name] = module.__dict__[attr]
    return owners


@contextlib.contextmanager
def fault_hook(model: nn.Module, fn: FaultHook) -> Iterator[None]:
    """Within the block, ``fn(site, c)`` sees every protected product of ``model``
    (:func:`protected_cores`: attention and projections), ``site`` as ``"<module name>:<site>"``
    (for example ``"transformer.h.0.attn:scores"``,
    ``"transformer.h.0.attn.c_attn:d_input"``, ``"layers.0.self_attn:q_proj"``; the site alone
    when ``model`` is itself the protected module); the previous hooks are restored after it."""
    owners = protected_cores(model)
    if not owners:
        raise ValueError("fault_hook: the model has no protected module (call "
                         "attention.torch.protect(model) first)")
    before = {name: owner.fault_hook for name, owner in owners.items()}
    try:
        for name, owner in owners.items():
            owner.fault_hook = _named(fn, name)
        yield
    finally:
        for name, owner in owners.items():
            owner.fault_hook = before[name]


def _named(fn: FaultHook, prefix: str) -> FaultHook:
    return lambda site, c: fn(f"{prefix}:{site}" if prefix else site, c)


def _is_pretrained(model: nn.Module) -> bool:
    """True for a transformers ``PreTrainedModel`` (without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


# ---------------------------------------------------------------------------------- inputs


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
