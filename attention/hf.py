"""The attention implementation ``"abft"`` for Hugging Face transformers models.

Importing this module registers :func:`abft_attention_forward` with transformers'
``AttentionInterface`` and sdpa's boolean mask builder with its ``AttentionMaskInterface``, both
under the name ``"abft"``, and the same function with eager's mask builder (4-D float masks,
left out only where they hide nothing: :func:`eager_masks_attention_forward`) under
``"abft_eager_masks"``: for models written for eager's masks alone
(transformers' ``_supports_sdpa = False``), whose own code may read the mask (a router's
padding, an attention module that adds it to its scores) or need the causal triangle in it (a
decoder whose modules say ``is_causal=False``). :func:`attention.torch.protect` picks the name by
that flag (:func:`name_for`). A model built with ``attn_implementation="abft"`` (or switched with
``model.set_attn_implementation("abft")``) then runs the attention product of every layer (the
scores ``Q K^T``, the mask, the softmax and ``P V``, forward and backward) on checksum-protected
GEMMs and checked softmax steps (:mod:`attention.core`). Each attention module's check mode, fault
hook and last report live in a :class:`attention.torch_core.ProtectedCore` in its attribute
``abft_core`` (made with ``check="correct"`` on first use; :func:`attention.torch.protect` makes
them for a whole model).

Masks: none (with the module's ``is_causal``, or the ``is_causal`` keyword; a module without
the flag is not causal, as eager), 4-D boolean
(True = attend, as transformers' sdpa masks) or 4-D float masks added to the scores (eager's
masks and custom ones); values at or below half the dtype's lowest finite value are taken as
"not allowed". A mask that is key padding (the same keys hidden from every query, with or
without the causal triangle: the masks of padded batches) reaches the core as key visibility
(boolean) or a per-key additive mask (eager's float masks), an ``O(L)`` mask
(:func:`attention.torch_functional.attention_core`). Grouped-query attention
(fewer key/value heads) repeats the key and value heads. Sliding windows (Mistral's, Gemma 3's)
are in the masks transformers builds (sdpa's builder, registered here); it leaves the mask out
only where the window hides nothing, so a ``sliding_window`` without a mask is refused when the
keys outnumber the window.

Differences from ``"eager"``: a loss on the returned attention weights raises
``NotImplementedError`` (their gradient is not propagated); a query row whose keys are all
masked gets probabilities 0 (eager: uniform over the masked keys); the dropout mask
is drawn with PyTorch's generator but not from the same stream as eager's (on the CPU the seed
of the fused core's keep decisions, :mod:`attention.dropout_hash`, so that the product runs on the
fused core). T5's position bias is added to the scores, and trained
through the core's checked ``dS``. Attention sinks (gpt-oss's ``s_aux``: a learned logit per
head in every query's softmax) join the product as one more key (:mod:`attention.sinks`), and
are trained through the core's checked ``dK``. Refused with a clear error: head masks, Gemma
2's ``softcap``, and ``sinks`` passed under that name.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.utils import output_capturing

from attention._torch_arrays import recomputing
from attention.torch_core import ProtectedCore

NAME = "abft"
#: The implementation with eager's masks, for models that do not support sdpa's (module
#: docstring).
EAGER_MASKS = "abft_eager_masks"
NAMES = (NAME, EAGER_MASKS)
#: Keyword arguments transformers may pass that the protected product cannot honour: head masks,
#: Gemma 2's tanh cap of the scores, sinks not given as ``s_aux``, the keys a sparse attention
#: selects
#: (DeepSeek-V3.2's indexer and its kin pass them to every implementation but eager's and
#: sdpa's) and packed sequences' boundaries (FlashAttention's varlen arguments).
_REFUSED = ("head_mask", "softcap", "sinks", "indices", "block_indices",
            "cu_seq_lens_q", "cu_seq_lens_k")

__all__ = ["NAME", "EAGER_MASKS", "NAMES", "abft_attention_forward", "core_of",
           "eager_masks_attention_forward", "name_for", "weights_wanted"]


def name_for(model: Any) -> str:
    """The protected attention implementation for ``model``: :data:`NAME` (sdpa's masks: O(L)
    key padding, no mask for a causal or unmasked product) where its class supports sdpa,
    :data:`EAGER_MASKS` where it was written for eager's masks only."""
    return NAME if getattr(model, "_supports_sdpa", False) else EAGER_MASKS


class TransformersCore(ProtectedCore):
    """The :class:`ProtectedCore` of a transformers attention module. Its class lives in this
    module so that unpickling a protected model (``torch.load`` of the whole model, a worker
    that ``torch.multiprocessing`` spawns with it) imports this module, which registers the
    ``"abft"`` attention the model's config names (a fresh process failed with transformers'
    "not a valid attention implementation")."""


def core_of(module: torch.nn.Module) -> ProtectedCore:
    """The :class:`ProtectedCore` of an attention module (made with the defaults if missing)."""
    core = module.__dict__.get("abft_core")
    if core is None:
        core = module.abft_core = TransformersCore()
    return core


def abft_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           scaling: float | None = None, dropout: float = 0.0,
                           is_causal: bool | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The protected attention product with transformers' attention-function signature.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module (its ``is_causal``, ``abft_core``).
    query : tensor (batch, heads, L, D)
    key, value : tensor (batch, kv_heads, S, D) and (batch, kv_heads, S, Dv)
        ``heads`` a multiple of ``kv_heads``; ``Dv`` may differ from ``D`` (multi-head latent
        attention: the narrower is padded with zeros).
    attention_mask : tensor (batch or 1, heads or 1, L, S), optional
        Boolean (True = attend) or float (added to the scaled scores).
    scaling : float, optional
        Factor of the scores (default ``1 / sqrt(D)``).
    dropout : float
        Attention dropout probability (transformers passes 0 outside training).
    is_causal : bool, optional
        Overrides ``module.is_causal`` (False where the module has no such flag); applies only
        without a mask and for ``L > 1``.
    **kwargs
        ``position_bias`` (T5's, ``(batch or 1, heads, L, S)``) is added to the scores, with its
        gradient when it requires one (the unfused core then runs: that gradient is its
        checked ``dS``); ``s_aux`` (attention sinks, ``(heads,)``) joins the softmax
        (:func:`attention.torch_functional.attention_core`'s ``sinks``). Others transformers
        passes (position ids, cache flags,
        ``output_attentions``) are ignored; those in ``_REFUSED`` raise ``ValueError`` when
        set, as does a ``sliding_window`` smaller than the number of keys without a mask (the
        window is the mask's part).

    Returns
    -------
    attn_output : tensor (batch, L, heads, Dv)
    attn_weights : tensor (batch, heads, L, S), or None
        A loss on it raises ``NotImplementedError`` in backward (no gradient path).
        None when the model's forward collects no attention weights (no ``output_attentions``):
        the product may then run on the fused core (:mod:`attention.fused`), which makes none.
    """
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            raise ValueError(f"the 'abft' attention does not support {name!r}")
    window = kwargs.get("sliding_window")
    if window is not None and attention_mask is None and key.shape[2] > window:
        raise ValueError(f"the 'abft' attention takes a sliding window ({window}) from the "
                         f"attention mask, and got none for {key.shape[2]} keys")
    width, v_width = query.shape[-1], value.shape[-1]
    if v_width != width:  # multi-head latent attention (DeepSeek-V3): the narrower head dims
        # padded with zeros, which add nothing to the scores and give zero output columns
        scaling = width ** -0.5 if scaling is None else scaling
        query, key = (torch.nn.functional.pad(t, (0, max(v_width - width, 0)))
                      for t in (query, key))
        value = torch.nn.functional.pad(value, (0, max(width - v_width, 0)))
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads:
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key heads")
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    seq_q, seq_k = query.shape[2], key.shape[2]
    # a module without the flag is not causal, as eager computes it (sdpa's default, causal, made
    # Mllama's text cross-attention causal where it had no mask)
    causal = getattr(module, "is_causal", False) if is_causal is None else bool(is_causal)
    causal = causal and attention_mask is None and seq_q > 1
    mask = not_allowed(attention_mask)
    if causal and seq_q != seq_k:  # sdpa's is_causal: query i sees keys 0..i (transformers
        # leaves the mask out so only where that is right: a prefill into an empty static cache)
        mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=query.device).triu(1)
        causal = False
    bias = kwargs.get("position_bias")
    if bias is not None:  # T5's relative position bias, trained: its gradient is the core's dS
        mask = bias if mask is None else bias + (
            mask if mask.is_floating_point() else
            torch.zeros(mask.shape, dtype=bias.dtype, device=bias.device).masked_fill(
                mask, -math.inf))
    wanted = weights_wanted()
    out, weights = core_of(module)(query, key, value, mask, scaling, causal, need_weights=wanted,
                                   dropout=dropout, sinks=kwargs.get("s_aux"))
    # contiguous, as eager's and sdpa's: models view it (JetMoE splits its heads by a view)
    return out[..., :v_width].transpose(1, 2).contiguous(), weights if wanted else None


def eager_masks_attention_forward(module: torch.nn.Module, query: torch.Tensor,
                                  key: torch.Tensor, value: torch.Tensor,
                                  attention_mask: torch.Tensor | None,
                                  scaling: float | None = None, dropout: float = 0.0,
                                  is_causal: bool | None = None,
                                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`abft_attention_forward` as eager's attention function computes it: every causal
    triangle and window is in eager's masks (transformers' eager builder leaves a mask out only
    where it hides nothing), so a call without a mask hides nothing, whatever the module's or the
    caller's ``is_causal`` (CLAP's and ALIGN's text encoders, which have no such flag, ran
    causal without padding). Registered as :data:`EAGER_MASKS`."""
    return abft_attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                                  is_causal=False, **kwargs)


def weights_wanted() -> bool:
    """Whether the running forward may collect attention weights: True unless transformers'
    output collector (``output_attentions`` and its kin) is active and collects none, or the
    forward runs inside a backward (activation checkpointing's recomputation, outside the
    model's forward and its collector: nothing collects them there, and the fused core keeps the
    recomputation's memory O(L)). Called outside a model's forward, or where transformers has no
    such collector, weights are made."""
    collector = getattr(output_capturing, "_active_collector", None)
    collected = None if collector is None else collector.get()
    if collected is None and recomputing():
        return False
    return not isinstance(collected, dict) or any("attention" in key for key in collected)


def not_allowed(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A transformers attention mask in :class:`ProtectedCore`'s convention: boolean masks
    inverted (True = NOT allowed), float masks with their "minus infinity" (at or below half the
    dtype's lowest value) as ``-inf``."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return mask.logical_not()
    if not mask.is_floating_point():
        raise TypeError(f"attention_mask must be bool or float, got {mask.dtype}")
    return mask.masked_fill(mask <= torch.finfo(mask.dtype).min / 2, -math.inf)


AttentionInterface.register(NAME, abft_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionInterface.register(EAGER_MASKS, eager_masks_attention_forward)
AttentionMaskInterface.register(EAGER_MASKS, eager_mask)
