"""The attention product alone: ``softmax(scale Q K^T + mask) V``, forward and backward protected.

Where a model computes its own projections (Hugging Face transformers models hand their attention
function Q, K and V split into heads), only the attention product is left to protect:
:func:`core_forward` and :func:`core_backward` run the steps
:data:`attention.passes.CORE_FORWARD` and :data:`attention.passes.CORE_BACKWARD` (sites
``scores``, ``softmax``, ``context``; ``d_probs``, ``d_v``, ``softmax_backward``, ``d_q``,
``d_k``): the layer's own core, run by its executor (one settle per pass, replay on a repair).
Heads are the leading batch axis: ``(batch * heads, seq, head_dim)``.

Two implementations: the fused core (:mod:`attention.fused`: tiles, O(L) extra memory, every
tile checked; its fault-hook sites are :data:`attention.fused.FUSED_SITES`) and the unfused one
above (the scores and probabilities materialized; the reference, and the path for what the fused
core does not support). ``core="auto"`` (the default) runs the fused core where it applies
(:func:`fused_unsupported`), ``"fused"`` and ``"unfused"`` force one; ``saved["core"]`` says which
ran.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from abftgemm.backend import array_module
from abftgemm.checksums import SUPPORTED_DTYPES
from attention.context import Context
from attention.dropout import Dropout, for_core
from attention.fused import fused_backward, fused_forward
from attention.fused_choice import (CORE_SITES, CORES, backward_reason,  # noqa: F401
                                     check_core, finite_reason, overflowed, refused,
                                     static_reason)
from attention.fused_final import verify_grads, verify_output
from attention.fused_rules import check_causal, key_additive_of, key_visible_of
from attention.functional import (_additive, backward_pass, check_mask_grad, folded_mask,
                                  forward_pass, mask_gradient)
from attention.passes import CORE_BACKWARD, CORE_FORWARD, Variant
from attention.workspace import Workspace, counts_reads

#: The GEMM sites the attention product runs (forward, then backward:
#: :data:`attention.fused_choice.CORE_SITES`), and its invariant sites.
CORE_INVARIANT_SITES = tuple(s.site for s in CORE_FORWARD + CORE_BACKWARD
                             if s.op.startswith("softmax"))


class _CoreInputs:
    """Validated inputs of one attention product (kept in ``saved`` for backward); the attributes
    the checked softmax steps read (:func:`attention.softmax_steps.forward_step`)."""

    def __init__(self, q: Any, k: Any, v: Any, scale: float, causal: bool, mask_add: Any | None,
                 key_visible: Any | None, key_add: Any | None):
        self.xp, self.q, self.k, self.v, self.dtype = array_module(q), q, k, v, q.dtype
        self.scale, self.causal, self.mask_add, self.key_add = scale, causal, mask_add, key_add
        self.key_visible = key_visible
        self._folded: Any | None = None
        self.dropout: Dropout | None = None
        self.n_heads = 1  # heads are already the batch axis
        # The softmax steps scale the scores by 1 / sqrt(head_dim).
        d = q.shape[-1]
        self.head_dim = d if scale == 1 / math.sqrt(d) else scale ** -2

    @property
    def attn_add(self) -> Any | None:
        """The unfused core's additive mask: ``mask_add`` (``attn_mask`` as float64), a mask
        given per group of heads made whole and ``key_add`` folded in as a float64 ``(n, seq_q,
        seq_k)`` array, on first use (never where only the fused core runs)."""
        return folded_mask(self, self.q.shape[0], self.q.shape[1])


@counts_reads
def core_forward(q: Any, k: Any, v: Any, ctx: Context, *, scale: float | None = None,
                 causal: bool = False, attn_mask: Any | None = None,
                 key_visible: Any | None = None, dropout: float = 0.0,
                 dropout_keep: Any | None = None, rng: Any | None = None,
                 workspace: Workspace | None = None, core: str = "auto",
                 dropout_seed: int | None = None, mask_grad: bool = False,
                 key_add: Any | None = None) -> tuple[Any, dict[str, Any]]:
    """``softmax(scale q k^T + mask) v`` with every product and the softmax checked.

    Parameters
    ----------
    q : array (n, seq_q, d)
        Queries, ``n`` = batch * heads; C-contiguous, float16, bfloat16, float32 or float64.
    k, v : array (n, seq_k, d)
        Keys and values, same dtype and array module as ``q``, C-contiguous.
    ctx : Context
        Check mode, frequencies, fault hook (sites :data:`CORE_SITES` and
        :data:`CORE_INVARIANT_SITES`); findings go to ``ctx.report``.
    scale : float, optional
        Positive factor of the scores (default ``1 / sqrt(d)``).
    causal : bool
        Query ``i`` sees keys ``j <= i`` only (``seq_q`` must equal ``seq_k``).
    attn_mask : array (seq_q, seq_k) or (m, seq_q, seq_k), optional
        Boolean, True = NOT allowed, or float, added to the scaled scores; ``m`` divides ``n``:
        heads ``b`` with ``b // (n / m) = i`` read mask ``i`` (``m`` = batch: one mask per
        batch item, shared by its heads; the CPU fused core reads it so, never copied per
        head).
    key_visible : bool array (n, seq_k), optional
        True = the key may be attended to (key padding: the same keys hidden from every query,
        an ``O(L)`` mask where ``attn_mask`` is ``L x L``). Combines with ``causal`` and
        ``attn_mask``.
    dropout, dropout_keep, rng, dropout_seed
        Attention dropout, as :func:`attention.attention_forward` takes it (the mask is
        ``(n, seq_q, seq_k)``; site ``"dropout"`` on the unfused core). A given
        ``dropout_keep`` runs the unfused core.
    workspace : Workspace, optional
        Plans and buffers to reuse across calls.
    core : {"auto", "fused", "unfused"}
        Which implementation runs (module docstring); ``"fused"`` raises ``ValueError`` where
        the fused core does not apply.
    mask_grad : bool
        :func:`core_backward` also returns the gradient of the float ``attn_mask`` (a learned
        position bias): the unfused core runs, the gradient being its checked ``dS``.
    key_add : float array (m, seq_k), optional
        A per-key additive mask (a float key padding mask), ``m`` dividing ``n``: heads ``[h n /
        m, (h + 1) n / m)`` share row ``h``, as a batch item's heads share its padding. Added to
        the scaled scores after ``attn_mask``; an ``O(L)`` mask where ``attn_mask`` is ``L x
        L`` (the unfused core, if it runs, folds it into one).

    Returns
    -------
    out : array (n, seq_q, d)
        A new array. The fused core's backward reads it (``rowsum(dO * O)``, and its final
        checks): change a copy, not ``out`` itself, before :func:`core_backward` (a changed
        ``out`` fails those checks, raising ``UncorrectableError``).
    saved : dict
        What :func:`core_backward` needs; ``saved["core"]`` is ``"fused"`` or ``"unfused"``,
        ``saved["probs"]`` holds the probabilities (and ``saved["probs_dropped"]`` those after
        dropout, or None); both are None after the fused core, which keeps no ``L x L`` array.
    """
    check_core(core)
    inp = _inputs(q, k, v, scale, causal, attn_mask, key_visible, key_add)
    shape = (q.shape[0], q.shape[1], k.shape[1])
    if mask_grad:
        check_mask_grad(attn_mask, core)
        core = "unfused"
    if core != "unfused":
        why_not = fused_unsupported(inp, ctx, dropout_keep, forced=core == "fused")
        if why_not is None:
            _, drop = for_core(np, dropout, None, dropout_seed, shape, rng, fused=True)
            p, seed = drop or (0.0, None)
            before = len(ctx.report.events)
            out, saved = fused_forward(
                q, k, v, ctx, scale=inp.scale, causal=inp.causal, attn_mask=inp.mask_add,
                key_visible=inp.key_visible, dropout=p, dropout_seed=seed, workspace=workspace,
                key_add=inp.key_add, check_finite=False)  # fused_unsupported read them
            if core == "fused" or ctx.check == "off" or not overflowed(ctx.report, before,
                                                                        (out,)):
                out, saved = verify_output(out, saved, ctx)
                return out, {"inputs": inp, "core": "fused", "fused": saved, "probs": None,
                             "probs_dropped": None}
            # an output past the data's dtype (float16): the unfused core passes a genuine
            # overflow through and tells it from a fault, on the same dropout decisions
            return core_forward(q, k, v, ctx, scale=inp.scale, causal=causal,
                                attn_mask=attn_mask, key_visible=key_visible, dropout=p,
                                dropout_seed=seed, workspace=workspace, core="unfused",
                                key_add=key_add)
        if core == "fused":
            raise refused(why_not)
    inp.dropout, _ = for_core(inp.xp, dropout, dropout_keep, dropout_seed, shape, rng,
                              fused=False)
    variant = Variant(causal=inp.causal, dropout=inp.dropout is not None, gpu=inp.xp is not np)
    out, saved = forward_pass(CORE_FORWARD, CORE_BACKWARD, variant, inp,
                              lambda: {"qh": q, "kh": k, "vh": v}, "context_h", ctx, workspace)
    saved["core"] = "unfused"
    saved["mask_shape"] = attn_mask.shape if mask_grad else None
    return out, saved


def fused_unsupported(inp: _CoreInputs, ctx: Context, dropout_keep: Any | None = None,
                      forced: bool = False) -> str | None:
    """Why the fused core cannot run this product (None when it can): it takes float16,
    bfloat16, float32 or float64 data, finite, a causal mask, a boolean or additive
    ``attn_mask`` (:func:`attention.fused_rules.additive_ok`) or none, dropout drawn from a seed
    (not a given ``dropout_keep``), and checks every tile on every call; CuPy data only when
    ``forced`` (:func:`attention.fused_choice.static_reason`). ``forced`` (``core="fused"``): a
    fault hook and a plan that checks the core's sites less often do not count (the hook then
    sees the fused sites)."""
    return static_reason(inp.xp, inp.dtype, inp.mask_add, ctx, dropout_keep, forced,
                         key_add=inp.key_add) or finite_reason(q=inp.q, k=inp.k, v=inp.v)


@counts_reads
def core_backward(saved: dict[str, Any], d_out: Any, ctx: Context, *,
                  workspace: Workspace | None = None) -> tuple[Any, ...]:
    """``(dq, dk, dv)`` (new arrays) from the gradient ``d_out`` ``(n, seq_q, d)`` of
    :func:`core_forward`'s output, C-contiguous, of its dtype; every product checked. After a
    forward with ``mask_grad=True``, ``(dq, dk, dv, d_mask)``: ``d_mask`` the gradient of
    ``attn_mask``, of its shape, float64 (the checked ``dS`` over ``scale``, summed over the
    batch for a 2-D mask)."""
    inp: _CoreInputs = saved["inputs"]
    if d_out.shape != inp.q.shape or d_out.dtype != inp.dtype:
        raise ValueError(f"d_out must have shape {inp.q.shape} and dtype {inp.dtype}, got "
                         f"{d_out.shape} {d_out.dtype}")
    if not d_out.flags.c_contiguous:
        raise ValueError("d_out must be C-contiguous")
    if saved["core"] == "fused":  # the inputs as given now (a caller may hand them on anew)
        saved["fused"].update(q=inp.q, k=inp.k, v=inp.v)
        if backward_reason(d_out) is None:
            before = len(ctx.report.events)
            grads = fused_backward(saved["fused"], d_out, ctx, workspace, check_finite=False)
            # check="off" leaves faults in place, as the forward does (no fallback there)
            if ctx.check == "off" or not overflowed(ctx.report, before, grads):
                return verify_grads(saved["fused"], d_out, grads, ctx)
        # The unfused core passes non-finite gradients through, and tells an overflow of the
        # data's dtype from a fault: its forward again, then its backward.
        mask = inp.mask_add if inp.mask_add is None or len(inp.mask_add) > 1 else inp.mask_add[0]
        drop = saved["fused"]["dropout"] or (0.0, None)  # the same keep decisions, materialized
        _, saved = core_forward(inp.q, inp.k, inp.v, ctx, scale=inp.scale, causal=inp.causal,
                                attn_mask=mask, key_visible=inp.key_visible,
                                key_add=inp.key_add, workspace=workspace, core="unfused",
                                dropout=drop[0], dropout_seed=drop[1])
    env = lambda: {"qh": inp.q, "kh": inp.k, "vh": inp.v, "d_context_h": d_out}  # noqa: E731
    mask_shape = saved.get("mask_shape")
    outputs = ("d_qh", "d_kh", "d_vh") + (("d_scores",) if mask_shape else ())
    p = backward_pass(CORE_BACKWARD, saved["variant"], saved, env, outputs, ctx, workspace)
    grads = p.env["d_qh"], p.env["d_kh"], p.env["d_vh"]
    if mask_shape:
        return (*grads, mask_gradient(inp, p.env["d_scores"], mask_shape))
    return grads


def _inputs(q: Any, k: Any, v: Any, scale: float | None, causal: bool,
            attn_mask: Any | None, key_visible: Any | None, key_add: Any | None) -> _CoreInputs:
    xp = array_module(q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if array_module(t) is not xp or t.dtype != q.dtype:
            raise TypeError(f"{name} must be a {xp.__name__} array of q's dtype {q.dtype}")
        if t.ndim != 3:
            raise ValueError(f"{name} must be 3-D (batch * heads, seq, head_dim), got {t.shape}")
        if not t.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} must be (n, seq_q, d), "
                         "(n, seq_k, d), (n, seq_k, d)")
    check_causal(causal, q.shape[1], k.shape[1])
    if q.shape[2] < 1:
        raise ValueError(f"head_dim must be at least 1, got q {q.shape}")
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if not 1e-150 < scale < 1e150:  # its square and inverse square stay finite and nonzero
        raise ValueError(f"scale must be a number between 1e-150 and 1e150, got {scale}")
    add = _additive(xp, attn_mask, q.shape[0], q.shape[1], k.shape[1])
    if key_visible is not None:
        if not isinstance(key_visible, xp.ndarray):
            raise TypeError(f"key_visible must be a {xp.__name__} array, as q is, got "
                            f"{type(key_visible).__name__}")
        key_visible = key_visible_of(xp, key_visible, q, k)
    if key_add is not None:  # its values are judged where a core takes it
        key_add, _ = key_additive_of(xp, key_add, q, k, add, read_values=False)
    return _CoreInputs(q, k, v, scale, bool(causal), add, key_visible, key_add)
