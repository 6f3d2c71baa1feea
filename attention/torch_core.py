"""The protected attention product on PyTorch tensors: ``softmax(scale Q K^T + mask) V``.

:class:`ProtectedCore` holds what one attention module's product runs under (a
:class:`attention.torch_functional.Protection`: check mode, checking plan, fault hook, last report,
plans and buffers per device, and its choice of core) and computes it, forward and backward,
through :func:`attention.torch_functional.attention_core` on the tensors' memory (CPU tensors as
NumPy arrays, CUDA tensors as CuPy arrays). It is what :mod:`attention.hf` attaches to
the attention modules of Hugging Face transformers models, which compute their own projections.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from attention._torch_state import Protection, ProtectionAttribute
from attention.fused_choice import check_core
from attention.plan import CheckingPlan
from attention.torch_functional import attention_core

FaultHook = Callable[[str, Any], None]
__all__ = ["ProtectedCore"]


class ProtectedCore:
    """The checked attention product of one attention module.

    Parameters
    ----------
    check, plan
        As in :class:`attention.torch_functional.Protection`.
    core : {"auto", "fused", "unfused"}
        Which implementation of :mod:`attention.core` runs: ``"auto"`` the fused core where it
        applies (CPU, any float dtype, no mask that wants its
        gradient, no fault hook, every call checked, ``need_weights=False``), else the unfused
        one; the others force one.

    Attributes
    ----------
    protection : attention.torch_functional.Protection
        What its calls run under; ``check``, ``plan``, ``fault_hook``, ``last_report``,
        ``total_report`` and ``last_core`` are its attributes, read and set through the module.
    fault_hook : callable ``(site, c)`` or None
        Sees every raw product of :data:`attention.core.CORE_SITES` and the softmax steps
        (:data:`attention.core.CORE_INVARIANT_SITES`; ``"dropout"`` with dropout) before
        verification, forward and backward.
    last_report : abftgemm.Report
        The findings of the last pass: the last forward's, extended by its backward.
    total_report : abftgemm.Report
        Every call's findings, forward and backward, since it was last replaced (a model that
        calls one attention module twice in a step has both calls' here; see
        :attr:`attention.torch_functional.Protection.total_report`).
    last_core : str or None
        ``"fused"`` or ``"unfused"``: the implementation the last forward ran.
    """

    check = ProtectionAttribute()
    plan = ProtectionAttribute()
    fault_hook = ProtectionAttribute()
    last_report = ProtectionAttribute()
    total_report = ProtectionAttribute()
    last_core = ProtectionAttribute()

    def __init__(self, check: str = "correct", plan: CheckingPlan | None = None,
                 core: str = "auto"):
        check_core(core)
        self.protection = Protection(check, plan)
        self.core = core

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, scale: float | None = None,
                 is_causal: bool = False, need_weights: bool = False,
                 dropout: float = 0.0, sinks: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, weights)`` of ``softmax(scale query key^T + attn_mask) value``: the
        :func:`attention.torch_functional.attention_core` of these arguments (``dropout`` its
        ``dropout_p``; ``sinks`` its attention sinks) under this module's protection and
        core."""
        if not 0 <= dropout <= 1:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout}")
        return attention_core(query, key, value, protection=self.protection,
                              attn_mask=attn_mask, scale=scale, is_causal=is_causal,
                              need_weights=need_weights, dropout_p=dropout, core=self.core,
                              sinks=sinks)
