"""Multi-head attention whose every GEMM, forward and backward, is checksum-protected.

Three layers, as in flash-attention: the softmax kernels and planned products, the functional
core (:mod:`attention.functional`, explicit state in a :class:`~attention.context.Context`), and
this thin stateful class: parameters, a workspace of plans and buffers per shape, and
``last_report`` as a convenience (the findings of the last pass, forward and backward, as in
:class:`attention.torch.MultiheadAttention`).
"""
from __future__ import annotations

import math

from typing import Any, Callable

import numpy as np

import abftgemm
from abftgemm.checksums import check_dtype
from abftgemm.plan import Counters, check_option
from abftgemm.report import Report, register_library_package
from attention.context import Context
from attention.functional import PARAM_KEYS, attention_backward, attention_forward
from attention.fused_choice import check_core
from attention.plan import CheckingPlan
from attention.workspace import Workspace

register_library_package("attention")  # fault warnings point at the caller of the layer

FaultHook = Callable[[str, Any], None]
__all__ = ["MultiHeadAttention", "PARAM_KEYS"]


class MultiHeadAttention:
    """Multi-head self-attention with ABFT-protected GEMMs and invariant-checked softmax.

    One instance runs one pass at a time: its plans and buffers are one workspace. Threads that
    run passes at once each need their own instance (the functional core, or the PyTorch module
    :class:`attention.torch.MultiheadAttention`, which keeps a workspace per thread).

    Parameters
    ----------
    d_model : int
        Model width; ``n_heads`` must divide it.
    n_heads : int
        Heads are contiguous column blocks of width ``d_model // n_heads``.
    causal : bool
        Query ``i`` sees keys ``j <= i`` only.
    dtype : str or dtype
        ``"float16"``, ``"bfloat16"``, ``"float32"`` or ``"float64"``: parameters, activations
        and GEMM operands. GEMMs accumulate in float32 (float64 for float64); softmax and its
        backward compute in float32 (float64) and store in ``dtype``.
    xp : module
        ``numpy`` (CPU) or ``cupy`` (GPU).
    seed : int
        Seed of the parameter initialization.
    check : {"correct", "detect", "off"}
        As in :func:`abftgemm.matmul`, for every site.
    plan : CheckingPlan, optional
        How often each site is checked (default: every call).
    core : {"auto", "fused", "unfused"}
        The attention product between the projections (``core`` of
        :func:`attention.functional.attention_forward`): ``"auto"`` runs the fused core
        (:mod:`attention.fused`) where it applies (CPU data of any supported dtype, finite, no
        dropout mask given, no ``need_weights``, no fault hook, every call checked), else the
        unfused sites; a backward whose fused gradients overflow the data's dtype runs again on
        the unfused sites, which pass an overflow through as plain math gives it.

    Attributes
    ----------
    params : dict
        ``"wq","wk","wv","wo"`` ``(d_model, d_model)`` applied as ``x @ w``; ``"bq","bk","bv","bo"``
        ``(d_model,)``.
    last_report : Report
        The findings of the last pass: those of the last ``forward``, extended by its
        ``backward`` once that runs (the backward of an earlier forward's cache makes that
        forward's report the last one). The same meaning as
        :attr:`attention.torch.MultiheadAttention.last_report`.
    last_core : str or None
        ``"fused"`` or ``"unfused"``: the attention product the last ``forward`` ran.

    Notes
    -----
    A query row with no visible key (all keys masked) gets attention probabilities of 0, so its
    context is 0 and its output is ``bo``; no gradient flows through its scores.
    """

    def __init__(self, d_model: int, n_heads: int, *, causal: bool = False,
                 dtype: Any = "float32", xp: Any = np, seed: int = 0, check: str = "correct",
                 plan: CheckingPlan | None = None, core: str = "auto"):
        if n_heads <= 0 or d_model <= 0 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        check_option("check", check, abftgemm.CHECK_MODES)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        check_core(core)
        self.causal, self.xp, self.check, self.core = causal, xp, check, core
        self.last_core: str | None = None
        self.dtype = check_dtype(_dtype(dtype))
        self.plan = plan or CheckingPlan()
        self.params = self._init_params(seed)
        self.last_report = Report()
        self._workspace = Workspace()

    def _init_params(self, seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        d = self.d_model
        host = {k: rng.standard_normal((d, d)) / math.sqrt(d) for k in ("wq", "wk", "wv", "wo")}
        host.update({k: 0.1 * rng.standard_normal(d) for k in ("bq", "bk", "bv", "bo")})
        return {k: self.xp.asarray(v.astype(self.dtype)) for k, v in host.items()}

    # ------------------------------------------------------------------ forward
    def forward(self, x: Any, mask: Any | None = None, fault_hook: FaultHook | None = None, *,
                key: Any | None = None, value: Any | None = None, attn_mask: Any | None = None,
                check: str | None = None, dropout: float = 0.0, dropout_keep: Any | None = None,
                rng: Any | None = None, need_weights: bool = False,
                dropout_seed: int | None = None, key_add: Any | None = None
                ) -> tuple[Any, dict[str, Any]]:
        """Attention output for ``x`` (see :func:`attention.functional.attention_forward`).

        Parameters
        ----------
        x : array (batch, seq, d_model)
            Same array module and dtype as the layer.
        mask : bool array (batch, seq_k), optional
            Key-padding mask, True = attend.
        fault_hook : callable ``(site, c)``, optional
            Called with every site's raw product before verification.
        key, value : array (batch, seq_k, d_model), optional
            Cross-attention inputs.
        attn_mask : array (seq, seq_k) or (batch*heads, seq, seq_k), optional
            Boolean (True = not allowed) or additive float.
        check : {"correct", "detect", "off"}, optional
            This call's check mode (default: the layer's ``check``).
        dropout, dropout_keep, rng, dropout_seed
            Attention dropout of this call (a training step): probability, optional mask
            ``(batch*heads, seq, seq_k)`` (True = kept; the unfused product runs) or seed of the
            keep decisions, and the generator that draws the mask (unfused product) or the seed
            (fused core) otherwise (:func:`attention.functional.attention_forward`).
        need_weights : bool
            Keep the attention probabilities in ``cache["probs"]`` (the unfused product runs).
        key_add : float array (batch, seq_k), optional
            Float key-padding mask, added to every query's scaled scores (``-inf``: not
            allowed); O(seq_k) per batch item on the fused core.

        Returns
        -------
        y : array (batch, seq, d_model)
        cache : dict
            What ``backward`` needs; ``cache["core"]`` says which product ran (also
            ``last_core``), ``cache["probs"]`` holds the attention probabilities after the
            unfused one, None after the fused core; ``cache["report"]``: this call's findings,
            which its backward extends.
        """
        ctx = self._context(fault_hook, check)
        y, saved = attention_forward(self.params, x, ctx, n_heads=self.n_heads,
                                     causal=self.causal, key=key, value=value, key_visible=mask,
                                     attn_mask=attn_mask, dropout=dropout,
                                     dropout_keep=dropout_keep, rng=rng,
                                     workspace=self._workspace, need_weights=need_weights,
                                     core=self.core, dropout_seed=dropout_seed,
                                     key_add=key_add)
        self.last_report = saved["report"] = ctx.report
        self.last_core = saved["core"]
        return y, saved

    # ------------------------------------------------------------------ backward
    def backward(self, dy: Any, cache: dict[str, Any], fault_hook: FaultHook | None = None, *,
                 check: str | None = None) -> tuple[Any, dict[str, Any]]:
        """Gradients of a loss with gradient ``dy`` w.r.t. the inputs and every parameter.

        Parameters
        ----------
        dy : array (batch, seq, d_model)
        cache : dict
            From ``forward``.
        fault_hook : callable ``(site, c)``, optional
        check : {"correct", "detect", "off"}, optional

        Returns
        -------
        dx : array (batch, seq, d_model); ``(d_query, d_key, d_value)`` in cross-attention
        grads : dict
            Same keys and shapes as ``params``.
        """
        ctx = self._context(fault_hook, check, cache.get("report"))
        dx, grads = attention_backward(cache, dy, ctx, workspace=self._workspace)
        self.last_report = ctx.report
        return dx, grads

    def _context(self, fault_hook: FaultHook | None, check: str | None,
                 report: Report | None = None) -> Context:
        return Context(self.check if check is None else check, self.plan, fault_hook,
                       Report() if report is None else report)

    @property
    def counters(self) -> Counters:
        """Launches, allocations and host syncs of the layer's planned products."""
        return self._workspace.counters


def _dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)
