"""Protecting a Hugging Face transformers ``PreTrainedModel`` in place (:func:`protect_pretrained`).

Models that call the attention function their config names (BERT, RoBERTa, GPT-2 and most
transformers 5 models) are switched to the implementation ``"abft"`` (:mod:`attention.hf`;
``"abft_eager_masks"`` for those written for eager's masks alone), and
every attention module among their submodules gets its own
:class:`attention.torch_core.ProtectedCore` (attribute ``abft_core``). GPT-Neo picks its attention
classes by name and never calls a registered function: there each ``GPTNeoSelfAttention`` becomes
a :class:`ProtectedGPTNeoSelfAttention` (its class is swapped; the module, its Parameters and
buffers stay the same objects), whose attention product runs on the protected core. The
attention projections (and with ``mlp=True`` the feed-forward layers) become protected linear
layers (:mod:`attention.hf_linear`).
"""
from __future__ import annotations

import copy
import inspect
import math
import sys
import threading
import warnings
from typing import Any, Iterator

import torch
import transformers
from torch import nn
from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

import abftgemm
from abftgemm.plan import check_option
from attention._torch_arrays import eager
from attention.hf import (NAMES, TransformersCore, core_of, name_for, not_allowed,
                          weights_wanted)
from attention.hf_linear import (check_projections, check_swappable, protect_projections,
                                 swap_class, unprotected_weights)
from attention.torch_core import ProtectedCore

__all__ = ["protect_pretrained", "ProtectedGPTNeoSelfAttention", "attention_cores"]


#: Per thread, ``{id(module): output_attentions}`` of the GPT-Neo attention forwards running in
#: it (one model may serve several threads at once: the flag is the call's, not the module's).
_WEIGHTS_ASKED = threading.local()


class ProtectedGPTNeoSelfAttention(GPTNeoSelfAttention):
    """GPT-Neo's self-attention with its attention product on the protected core (unscaled
    scores, the module's causal or local window mask, the model's additive mask, its attention
    dropout in training). Attention weights are made only where the forward collects them:
    GPT-Neo's own forward passes ``output_attentions`` down (where transformers' output collector
    is active, :func:`attention.hf.weights_wanted` decides as well); without them the product may
    run on the fused core."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                layer_past: Any = None, use_cache: bool = False, output_attentions: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GPTNeoSelfAttention's forward, noting (for this thread) whether this call returns
        attention weights."""
        asked = vars(_WEIGHTS_ASKED).setdefault("calls", {})
        outer = asked.get(id(self))
        asked[id(self)] = bool(output_attentions)
        try:
            return super().forward(hidden_states, attention_mask, layer_past, use_cache,
                                   output_attentions, **kwargs)
        finally:
            if outer is None:
                del asked[id(self)]
            else:
                asked[id(self)] = outer

    def _attn(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq_q, seq_k = query.size(-2), key.size(-2)
        dtype = value.dtype
        # As GPT-Neo's eager attention: the scores in float32.
        query, key, value = (t.to(torch.float32) for t in (query, key, value))
        causal = self.attention_type == "global" and attention_mask is None and seq_q == seq_k
        mask = None
        if not causal:
            hidden = self.bias[:, :, seq_k - seq_q:seq_k, :seq_k].logical_not()
            mask = hidden if attention_mask is None else \
                _merged(not_allowed(attention_mask), hidden)
        wanted = vars(_WEIGHTS_ASKED).get("calls", {}).get(id(self), True) and weights_wanted()
        out, weights = core_of(self)(query, key, value, mask, 1.0, causal, need_weights=wanted,
                                     dropout=self.attn_dropout.p if self.training else 0.0)
        return out.to(dtype), weights.to(dtype) if wanted else None


def _merged(given: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The model's mask (:func:`attention.hf.not_allowed`'s convention) with the module's causal
    or window mask ``hidden`` (True = not allowed): boolean where the model's mask only hides
    keys (every value 0 or ``-inf``: a padded batch's mask), so that the core can take key
    padding as key visibility (:func:`attention.torch_functional.attention_core`); else float.
    The values are read only outside ``torch.compile`` and tracing."""
    if given.dtype == torch.bool:
        return given | hidden
    if eager(given) and bool(((given == 0) | (given == -math.inf)).all()):
        return (given == -math.inf) | hidden
    return given.to(torch.float32).masked_fill(hidden, -math.inf)


def protect_pretrained(model: nn.Module, *, check: str = "correct", projections: bool = True,
                       mlp: bool = False) -> nn.Module:
    """Protect the attention products and projections of a transformers ``PreTrainedModel`` in
    place.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    check : {"correct", "detect", "off"}
        The check mode of every protected module.
    projections : bool
        Also protect the Q, K, V and output projections of every attention block
        (:func:`attention.hf_linear.protect_projections`).
    mlp : bool
        Also protect the feed-forward layers (needs ``projections``).

    Returns
    -------
    model

    Raises
    ------
    ValueError
        For a model that neither calls registered attention functions nor is GPT-Neo, whose
        attention caps its scores (Gemma 2's ``attn_logit_softcapping``) or selects its keys
        with an indexer (DeepSeek-V3.2's sparse attention), or whose projections
        cannot be found or swapped; the model is left as it was (:func:`check_pretrained`).

    Warns
    -----
    UserWarning
        Naming the attention modules that compute their attention themselves
        (:func:`unprotected_attention`) and the modules holding weights in the protected scope
        that are not protected (:func:`attention.hf_linear.unprotected_weights`).
    """
    check_pretrained(model, check=check, projections=projections, mlp=mlp)
    neo = [m for _, m in model.named_modules() if isinstance(m, GPTNeoSelfAttention)]
    for m in neo:
        if type(m) is GPTNeoSelfAttention:
            swap_class(m, ProtectedGPTNeoSelfAttention)
    if not neo:
        _own_config(model)
        _switch(model)
    modules = list(_attention_modules(model))
    for _, m in modules:
        m.abft_core = TransformersCore(check)
    if projections:
        protect_projections(model, [name for name, _ in modules], check=check, mlp=mlp)
        weights = unprotected_weights(model, [name for name, _ in modules], mlp)
        if weights:
            warnings.warn(f"protect: {len(weights)} modules of {type(model).__name__} in its "
                          f"protected {'layers' if mlp else 'attention blocks'} hold weights "
                          f"that run unprotected ({weights[0]!r} first, a "
                          f"{type(model.get_submodule(weights[0])).__name__}): only nn.Linear, "
                          "GPT-2's Conv1D and Falcon's FalconLinear are protected", UserWarning,
                          stacklevel=3)
    left = unprotected_attention(model, [name for name, _ in modules])
    if left:
        warnings.warn(f"protect: {len(left)} attention modules of {type(model).__name__} compute "
                      f"their attention themselves and run unprotected ({left[0]!r} first): "
                      "they call no registered attention function", UserWarning, stacklevel=3)
    return model


def unprotected_attention(model: nn.Module, protected: list[str]) -> list[str]:
    """Names of the modules of ``model`` that look like attention modules (a class name ending
    in ``Attention``, or a forward that calls ``scaled_dot_product_attention`` itself; with
    parameters) and hold, and are held by, no protected attention module ``protected``:
    attention computed by the model's own code (LongT5's local attention, GIT's text decoder,
    PEGASUS-X's block attention, AIMv2's attention pooling head), which
    :func:`protect_pretrained` cannot reach."""
    def related(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") or p.startswith(name + ".")
                   for p in protected)

    found = [name for name, m in model.named_modules()
             if (type(m).__name__.endswith("Attention")
                 or "scaled_dot_product_attention" in _forward_names(m))
             and not related(name) and next(m.parameters(), None) is not None
             and not isinstance(m, nn.MultiheadAttention)]  # attention.torch.protect swaps it
    return [n for n in found if not any(f.startswith(n + ".") for f in found)]  # innermost


def check_pretrained(model: nn.Module, *, check: str = "correct", projections: bool = True,
                     mlp: bool = False) -> None:
    """Raise ``ValueError`` where :func:`protect_pretrained` would refuse ``model`` (its Raises
    section), changing nothing: :func:`attention.torch.protect` checks every model it holds
    before it protects any."""
    if mlp and not projections:
        raise ValueError("protect: mlp=True needs projections=True")
    check_option("check", check, abftgemm.CHECK_MODES)
    capped = [name for name, m in model.named_modules()
              if getattr(m, "attn_logit_softcapping", None) is not None]
    if capped:  # Gemma 2's tanh cap of the scores: refused now, not at the first forward
        raise ValueError(f"protect: {type(model).__name__} caps its attention scores "
                         f"({capped[0]!r} first): the 'abft' attention does not support "
                         "'softcap'")
    sparse = [name for name, m in model.named_modules()
              if getattr(m, "indexer", None) is not None and hasattr(m, "config")]
    if sparse:  # DeepSeek-V3.2's sparse attention: its keys for 'abft' come as 'indices'
        raise ValueError(f"protect: {type(model).__name__} selects the keys of its attention "
                         f"with an indexer ({sparse[0]!r} first): the 'abft' attention does "
                         "not support 'indices'")
    neo = [(name, m) for name, m in model.named_modules() if isinstance(m, GPTNeoSelfAttention)]
    for name, m in neo:
        check_swappable(name, m)
    names = [name for name, _ in neo]
    if not neo:
        if not model._can_set_attn_implementation():
            raise ValueError(f"{type(model).__name__} does not call the attention function its "
                             "config names (transformers' AttentionInterface), so protect() "
                             "cannot protect it")
        # which modules the switch reaches: tried on a copy of the config, then undone
        previous = model.config._attn_implementation
        shared = _own_config(model)
        try:
            _switch(model)
            modules = list(_attention_modules(model))
            stale = [(name, _implementation(m)) for name, m in modules
                     if _implementation(m) not in (None, *NAMES)]
        finally:
            model.set_attn_implementation(previous)
            for m, config in shared:
                m.config = config
        if not modules:
            raise ValueError(f"protect: found no attention module in {type(model).__name__}")
        if stale:
            raise ValueError(
                f"protect: transformers {transformers.__version__} left {len(stale)} attention "
                f"modules of {type(model).__name__} ({stale[0][0]!r} first) on the attention "
                f"implementation {stale[0][1]!r}: their sub-model's config keeps its own, so "
                "they would run unprotected")
        names = [name for name, _ in modules]
    if projections:
        check_projections(model, names, mlp)


def _switch(model: nn.Module) -> None:
    """Switch ``model`` to its protected attention implementation (:func:`attention.hf.name_for`),
    and each transformers model inside it whose own differs to that one: a sub-model written for
    eager's masks alone inside a model that supports sdpa's (Gemma 4's audio tower, whose own
    attention reads eager's float mask) gets :data:`attention.hf.EAGER_MASKS`."""
    model.set_attn_implementation(name_for(model))
    for m in model.modules():
        if isinstance(m, transformers.PreTrainedModel) and _implementation(m) != name_for(m) \
                and m._can_set_attn_implementation():
            m.set_attn_implementation(name_for(m))


def _implementation(module: nn.Module) -> str | None:
    """The attention implementation an attention module's config names (None without one)."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def _own_config(model: Any) -> list[tuple[Any, Any]]:
    """Give ``model``'s modules a copy of their config (its sub-configs shared as before), so
    that ``set_attn_implementation`` changes this model alone: models built from one config
    object share it, and protecting one switched the other to ``"abft"`` (and setting the other
    back unprotected this one, silently). Returns ``(module, config)`` pairs to undo it."""
    memo: dict[int, Any] = {}
    copy.deepcopy(model.config, memo)
    undo = []
    for m in model.modules():
        config = vars(m).get("config")
        if config is not None and id(config) in memo:
            undo.append((m, config))
            m.config = memo[id(config)]
    return undo


def _attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules that compute an attention product: GPT-Neo's protected
    self-attention, and the modules with a ``config`` defined next to transformers'
    ``ALL_ATTENTION_FUNCTIONS`` that have an ``is_causal`` flag or whose forward names it (the
    modules that call it; LayoutLM's has no flag)."""
    for name, m in model.named_modules():
        if isinstance(m, ProtectedGPTNeoSelfAttention):
            yield name, m
        elif hasattr(m, "config") and hasattr(sys.modules.get(type(m).__module__),
                                              "ALL_ATTENTION_FUNCTIONS") and (
                hasattr(m, "is_causal") or "ALL_ATTENTION_FUNCTIONS" in _forward_names(m)):
            yield name, m


def _forward_names(module: nn.Module) -> tuple[str, ...]:
    """The global and attribute names the code of ``module``'s class ``forward`` uses (behind
    its decorators; none where it has no code object)."""
    return getattr(getattr(inspect.unwrap(type(module).forward), "__code__", None),
                   "co_names", ())


def attention_cores(model: nn.Module) -> dict[str, ProtectedCore]:
    """The :class:`ProtectedCore` of every protected attention module, by module name."""
    return {name: m.abft_core for name, m in model.named_modules()
            if isinstance(m.__dict__.get("abft_core"), ProtectedCore)}
