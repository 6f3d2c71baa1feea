"""When the fused attention core (:mod:`attention.fused`) can run an attention product: the rules
shared by the bare product (:func:`attention.core.core_forward`) and the layer, which runs it
between its projections (:func:`attention.functional.attention_forward`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from abftgemm.cpu_kernels import all_finite as cpu_all_finite
from attention.context import Context
from attention.fused import SUPPORTED as FUSED_DTYPES
from attention.fused_rules import additive_ok, key_additive_bad
from attention.passes import CORE_BACKWARD, CORE_FORWARD

#: The ``core`` choices: ``"auto"`` the fused core where it applies, else the unfused one.
CORES = ("auto", "fused", "unfused")
#: The GEMM sites of the unfused attention product (forward, then backward).
CORE_SITES = tuple(s.site for s in CORE_FORWARD + CORE_BACKWARD if s.op.startswith("gemm"))


#: Why the fused core refuses a call whatever its data: the reasons its arguments decide, which
#: the layers and the PyTorch entry points (before they draw a dropout) give in these words.
WEIGHTS_ASKED = "the attention weights were asked for (the fused core makes none)"
CAUSAL_NOT_SQUARE = "causal=True with seq_q != seq_k (the fused core's causal mask is square)"
#: ... and a mask whose gradient is wanted, formatted with the mask's name.
MASK_GRAD = "it keeps no L x L array, so it cannot return the gradient of {}; use core='auto' " \
    "or 'unfused'"


def refused(why_not: str) -> ValueError:
    """The error of a call forced onto the fused core (``core="fused"``) that it cannot run."""
    return ValueError(f"the fused attention core does not apply here: {why_not}")


def check_core(core: str) -> None:
    """``core`` must be one of :data:`CORES`."""
    if core not in CORES:
        raise ValueError(f"core must be one of {CORES}, got {core!r}")


def static_reason(xp: Any, dtype: np.dtype, attn_add: Any | None, ctx: Context,
                  dropout_keep: Any | None = None, forced: bool = False,
                  need_weights: bool = False, key_add: Any | None = None) -> str | None:
    """Why the fused core cannot run a product, from what is known before its operands exist
    (None when it can): it takes float16, bfloat16, float32 or float64 data (16-bit data
    computed in float32), an additive mask (:func:`attention.fused_rules.additive_ok`) or none,
    and a per-key one ``key_add`` (float64 ``(batch, seq_k)``) or none, the two and their sums
    all of them additive masks it takes (:func:`attention.fused_rules.key_additive_bad`),
    attention dropout with its keep decisions drawn from a seed (not a given mask
    ``dropout_keep``: the unfused core applies that), no attention weights, and checks every
    tile on every call. NumPy data run its CPU kernels; CuPy data its CUDA kernels
    (:mod:`attention._cuda_fused`, final checks included) only where ``forced``: on an H200
    they were several times slower than the unfused core (bench/NOTES.md), so ``core="auto"``
    keeps such data on the unfused core. ``forced``
    (``core="fused"``): a fault hook and a plan that checks the product's sites less often do
    not count (the hook then sees the fused sites)."""
    if xp is not np and not forced:
        return f"the data are {xp.__name__} arrays (the fused CUDA kernels are slower than the " \
               "unfused core on a GPU; core='fused' runs them)"
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype} (the fused core takes float16, bfloat16, float32 and float64)"
    # CuPy data's mask is judged by the fused CUDA core (in a pass, on the device).
    if attn_add is not None and xp is np and not additive_ok(xp, attn_add, dtype):
        return "an attn_mask holding NaN, +inf or values that overflow the scores"
    if key_add is not None and xp is np and key_additive_bad(xp, key_add, attn_add, dtype):
        return "a float key padding mask holding NaN, +inf or values that overflow the scores " \
               "(alone or added to attn_mask)"
    if dropout_keep is not None:
        return "an explicit dropout mask, dropout_keep (the unfused core applies it; the fused " \
               "core draws its own keep decisions from a seed)"
    if need_weights:
        return WEIGHTS_ASKED
    if not forced:
        if ctx.fault_hook is not None:
            return "a fault hook (it names the unfused core's sites; core='fused' runs the " \
                   "fused sites)"
        sites = ctx.plan.sites
        if any(sites[s].every != 1 or sites[s].probability != 1 for s in CORE_SITES):
            return "a checking plan that skips calls (the fused core checks every tile)"
    return None


def finite_reason(**operands: Any) -> str | None:
    """Why the fused core cannot take these NumPy or CuPy operands (None when it can): it takes
    non-empty, finite data only."""
    for name, t in operands.items():
        if t.size == 0:
            return f"{name} is empty"
        if not all_finite(t):
            return f"{name} holds INF or NaN"
    return None


def all_finite(t: Any) -> bool:
    """No INF or NaN in the NumPy or CuPy array ``t``, from the exponent bits (one pass, no
    temporary; bfloat16 data need it on CuPy)."""
    if isinstance(t, np.ndarray):
        return cpu_all_finite(t)
    from attention._cuda_fused import finite
    return finite(t)


def overflowed(report: Any, before: int, grads: tuple[Any, ...]) -> bool:
    """Whether the fused core's backward, which added no event to ``report`` beyond its first
    ``before``, returned INF or NaN: an overflow of the data's dtype (float16 gradients past
    its range, rounded from the float32 tiles), which the fused core's final checks cannot tell
    from a fault. The unfused core judges each element and passes overflow through, so the
    callers run the step again there."""
    return len(report.events) == before and not all(all_finite(g) for g in grads)


def backward_reason(d_out: Any) -> str | None:
    """Why the fused core's backward cannot take this gradient (None when it can): a
    non-finite ``d_out`` (the unfused core passes it through)."""
    if not all_finite(d_out):
        return "d_out holds INF or NaN"
    return None
