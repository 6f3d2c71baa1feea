"""The protected attention product on PyTorch tensors: ``softmax(scale Q K^T + mask) V``.

:class:`ProtectedCore` holds what one attention module's product runs under (check mode, checking
plan, fault hook, last report, plans and buffers per device) and computes it, forward and backward,
through the custom operators of :mod:`attention._torch_core_op` on the tensors' memory (CPU
tensors as NumPy arrays, CUDA tensors as CuPy arrays). It is what :mod:`attention.hf` attaches to
the attention modules of Hugging Face transformers models, which compute their own projections.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

import abftgemm
from abftgemm.report import Report
from attention import _torch_op, _torch_core_op
from attention.core import CORES
from attention.plan import CheckingPlan
from attention.workspace import Workspace

FaultHook = Callable[[str, Any], None]
__all__ = ["ProtectedCore"]


class ProtectedCore:
    """The checked attention product of one attention module.

    Parameters
    ----------
    check : {"correct", "detect", "off"}
        As in :func:`abftgemm.matmul`, for every site.
    plan : attention.CheckingPlan, optional
        How often each site is checked (default: every call).
    core : {"auto", "fused", "unfused"}
        Which implementation of :mod:`attention.core` runs: ``"auto"`` the fused core where it
        applies (CPU, float32/float64, causal or no mask, no dropout, no fault hook, every call
        checked, ``need_weights=False``), else the unfused one; the others force one.

    Attributes
    ----------
    fault_hook : callable ``(site, c)`` or None
        Sees every raw product of :data:`attention.core.CORE_SITES` and the softmax steps
        (:data:`attention.core.CORE_INVARIANT_SITES`; ``"dropout"`` with dropout) before
        verification, forward and backward.
    last_report : abftgemm.Report
        Findings of the last forward, extended by its backward.
    last_core : str or None
        ``"fused"`` or ``"unfused"``: the implementation the last forward ran.
    """

    def __init__(self, check: str = "correct", plan: CheckingPlan | None = None,
                 core: str = "auto"):
        if check not in abftgemm.CHECK_MODES:
            raise ValueError(f"check must be one of {abftgemm.CHECK_MODES}, got {check!r}")
        if core not in CORES:
            raise ValueError(f"core must be one of {CORES}, got {core!r}")
        self.check, self.core = check, core
        self.last_core: str | None = None
        self.plan = plan or CheckingPlan()
        self.fault_hook: FaultHook | None = None
        self.last_report = Report()
        self._workspaces: dict[torch.device, Workspace] = {}
        self.op_id = _torch_op.register(self)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, scale: float | None = None,
                 is_causal: bool = False, need_weights: bool = False,
                 dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, weights)`` of ``softmax(scale query key^T + attn_mask) value``, differentiable
        in ``query``, ``key`` and ``value``.

        Parameters
        ----------
        query : tensor (..., L, D)
        key, value : tensor (..., S, D)
            Same leading dimensions and dtype as ``query``.
        attn_mask : tensor, optional
            Broadcastable to ``(..., L, S)``: bool, True = NOT allowed, or float, added to the
            scaled scores.
        scale : float, optional
            Default ``1 / sqrt(D)``.
        is_causal : bool
            Query ``i`` sees keys ``j <= i`` only (``L == S``).
        need_weights : bool
            Also return the probabilities ``(..., L, S)`` (a new tensor without gradient; after
            dropout, as PyTorch's attention functions return them).
        dropout : float
            Attention dropout probability (:mod:`attention.dropout`); the mask is drawn with
            PyTorch's generator on the tensors' device.

        Returns
        -------
        out : tensor (..., L, D)
        weights : tensor (..., L, S) or None
        """
        lead, (seq_q, d), seq_k = query.shape[:-2], query.shape[-2:], key.shape[-2]
        if key.shape[:-2] != lead or value.shape != key.shape or key.shape[-1] != d:
            raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} must be (..., L, D), (..., S, D), (..., S, D)")
        if not (query.dtype == key.dtype == value.dtype):
            raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, "
                            f"{key.dtype}, {value.dtype}")
        n = 1
        for size in lead:
            n *= size
        q, k, v = (t.reshape(n, -1, d).contiguous() for t in (query, key, value))
        mask = _flat_mask(attn_mask, lead, n, seq_q, seq_k)
        if not 0 <= dropout <= 1:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout}")
        keep = torch.rand((n, seq_q, seq_k), device=q.device) >= dropout if dropout else None
        out, weights = _torch_core_op.apply_core(
            self.op_id, q, k, v, mask, 1 / d ** 0.5 if scale is None else float(scale),
            bool(is_causal), need_weights, keep, float(dropout))
        out = out.view(*lead, seq_q, d)
        return out, (weights.view(*lead, seq_q, seq_k) if need_weights else None)

    def __getstate__(self) -> dict[str, Any]:
        """Without its plans and buffers (``copy.deepcopy``, ``torch.save`` and ``pickle`` work
        after a forward; a copy builds its own on first use)."""
        state = self.__dict__.copy()
        state["_workspaces"] = {}
        del state["op_id"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"core": "auto", "last_core": None, **state})
        self.op_id = _torch_op.register(self)

    def _workspace_for(self, device: torch.device) -> Workspace:
        ws = self._workspaces.get(device)
        if ws is None:
            ws = self._workspaces[device] = Workspace()
        return ws


def _flat_mask(mask: torch.Tensor | None, lead: torch.Size, n: int, seq_q: int,
               seq_k: int) -> torch.Tensor | None:
    """``mask`` as the core takes it: ``(L, S)`` when shared by every batch item and head, else
    ``(n, L, S)``."""
    if mask is None:
        return None
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool or float, got {mask.dtype}")
    try:
        full = mask.expand(*lead, seq_q, seq_k)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"{(*lead, seq_q, seq_k)}") from None
    if all(s == 1 for s in mask.shape[:-2]) and mask.shape[-2:] == (seq_q, seq_k):
        return mask.reshape(seq_q, seq_k).contiguous()
    return full.reshape(n, seq_q, seq_k).contiguous()
