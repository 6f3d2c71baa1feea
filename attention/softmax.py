"""Masked softmax, forward and backward, each checked by an invariant that does not share its work.

Softmax is not linear, so GEMM checksums cannot pass through it. Instead:

- forward: every row with a visible key sums to 1 (hidden rows to 0), and the log-domain identity
  ``log P_ij - z_ij = -(max_j z_ij) - log(sum_j exp(z_ij - max_j z_ij))``, the same for every
  visible entry of row ``i`` that is not negligible, holds: the check measures its spread,
  ``max_j - min_j`` of ``log P_ij - z_ij``.
  The forward pass computes ``exp(z - max) / sum``; the check takes logarithms of what was
  delivered, so a fault in the exponential, the sum or the division cannot cancel out;
- backward: ``dS = P * (dP - r)``, ``r = rowsum(dP * P)``, has rows summing to 0 (exactly
  ``r (1 - sum P)`` for a P whose rows sum to 1 only up to rounding) and rows whose dP-weighted
  sum is the variance ``sum P dP**2 - r**2``, whatever ``dP``.

Arithmetic runs in float32 for 16- and 32-bit layers (float64 for float64) and the result is
stored in the layer's dtype. A check that fails triggers one recomputation; if that fails too, the
layer raises :class:`abftgemm.UncorrectableError`.

Each step is one kernel per backend with the same boundaries: numba on the CPU
(:mod:`attention._cpu_softmax`, run by the steps of :mod:`attention._cpu_steps`), a CUDA RawKernel
on the GPU (:mod:`attention._cuda_softmax`, run by :mod:`attention._cuda_steps`); the backend's
step classes are chosen once per step by :mod:`attention.softmax_steps`,
each reading its rows once, observing the row checksums the deferred check of the product before
it needs, and judging its invariants on what it stored. Both use the tolerances defined here; the
GPU kernel judges each row with that row's own largest ``|z| + |log P|`` (the CPU's verdict
uses the largest of the pass), and keeps its verdict on the device until the pass settles.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from abftgemm.checksums import accumulation_dtype, unit_roundoff

#: P entries below this fraction of their row's maximum are skipped by the log identity: their
#: logarithms are dominated by the rounding of tiny numbers, and they carry almost no weight.
#: So are subnormal entries (below :func:`abftgemm.checksums.smallest_normal` of P's dtype, such
#: as float16's from 6.1e-5 down): they keep only an absolute precision, and the identity's
#: tolerance assumes a relative one.
LOG_CHECK_FLOOR = 1e-3


Verdict = Callable[[], tuple[bool, float, float]]
"""An invariant check's outcome, read when called: ``(ok, worst error, its tolerance)``. On the GPU
it stays on the device until the pass settles (:class:`attention._cuda_softmax.DeviceVerdict`)."""


def forward_tolerances(p_dtype: np.dtype, length: int) -> tuple[float, float, float]:
    """``(row_tol, log_base, log_slope)`` for probabilities stored in ``p_dtype``, rows of
    ``length``: a row sum may miss its target by ``row_tol``; the log identity's spread (the
    largest minus the smallest ``log P_ij - z_ij`` of a row, over the entries it uses) may reach
    ``log_base + log_slope * size``, ``size`` the largest ``|z_ij| + |log P_ij|`` it used."""
    acc = accumulation_dtype(p_dtype)
    u = unit_roundoff(p_dtype) + length * unit_roundoff(acc)
    # relative error of P entries >= floor*top is ~u each; logs turn that into absolute ~2u.
    # The check's own arithmetic in the accumulation dtype (a 2-ulp log, one subtraction) errs by
    # at most ~5 units of roundoff of size per entry, twice in a spread.
    return 4 * u, 8 * u, 12 * unit_roundoff(acc)


def forward_verdict(errors: tuple[float, float, float], p_dtype: np.dtype,
                     length: int) -> tuple[bool, float, float]:
    """(ok, worst error, its tolerance) from ``(worst row-sum error, worst log-identity spread,
    largest size the identity used)`` of probabilities stored in ``p_dtype``, rows of
    ``length`` (see :func:`forward_tolerances`)."""
    worst_row, worst_log, size = errors
    row_tol, log_base, log_slope = forward_tolerances(p_dtype, length)
    log_tol = log_base + log_slope * size
    ok = math.isfinite(worst_row) and math.isfinite(worst_log) and worst_row <= row_tol \
        and worst_log <= log_tol
    worst, tol = (worst_row, row_tol) if worst_row / row_tol >= worst_log / log_tol else \
        (worst_log, log_tol)
    return ok, worst, tol


def backward_tolerance(dtype: np.dtype, length: int) -> tuple[float, float]:
    """``(u, tiny)`` for dS in ``dtype`` (the accumulation dtype), rows of ``length``: a row's
    tolerance is ``u * (sum of its magnitudes) + tiny``."""
    return 8 * length * unit_roundoff(dtype), float(np.finfo(dtype).tiny)


def check_backward(ds: np.ndarray, dp: np.ndarray, p: np.ndarray,
                   causal: bool = False) -> tuple[bool, float, float]:
    """Two checksums of each row of ``dS`` (NumPy, ``(..., seq_q, seq_k)``), against closed forms
    computed from P and dP.

    With ``r = rowsum(dP * P)`` (recomputed here, not taken from the backward pass):

    - plain: ``sum_j dS_ij = r (1 - sum_j P_ij)`` (0 when P's rows sum to 1; the factor accounts
      for P stored in a low-precision dtype);
    - weighted by dP: ``sum_j dS_ij dP_ij = sum_j P_ij dP_ij**2 - r**2`` (a variance), which also
      catches faults that keep the plain sum, such as a scaled row.

    Rows whose P or dP hold INF/NaN (the user's non-finite data, or an overflow upstream; a
    fault there was caught by the check of the product or softmax that made them) are not
    judged: their dS passes through as plain math computes it. A fault in dS itself leaves
    P and dP finite and is judged. ``causal``: past the diagonal P is 0 by definition, so dS
    must be 0 there; those entries of dP are not read (on the CPU a causal ``dP`` is computed
    only up to each row block's last column, the rest of its memory is never written) and those
    of dS count in the plain checksum only. Returns (ok, plain error, plain tolerance) of the row
    that is worst by either checksum, from the numba kernel of :mod:`attention._cpu_checks` (the
    GPU judges inside its backward kernel, :mod:`attention._cuda_softmax`).
    """
    from attention import _cpu_checks  # numba: loaded with the CPU path only

    acc = ds.dtype
    u, tiny = backward_tolerance(acc, ds.shape[-1])
    if not ds.size:
        return True, 0.0, tiny
    rows = _cpu_checks.rows
    worst, err, tol = _cpu_checks.backward_ratio(rows(ds), rows(dp, acc), rows(p, acc), u, tiny,
                                                 ds.shape[-2] if ds.ndim > 1 else 1, causal)
    return worst <= 1, err, tol


class Step:
    """One checked softmax step of a pass (forward or backward), run by :meth:`run`.

    Attributes
    ----------
    verdict : Verdict or None
        The invariant check's outcome (None with ``check="off"``).
    encodings : tuple or None
        ``(column encoding of the output, of its transpose)``, each ``(3, batch*heads, L)``,
        when the kernel made them on its write (the CPU's fused kernels), else None.
    """

    def __init__(self) -> None:
        self.verdict: Verdict | None = None
        self.encodings: tuple[Any, Any] | None = None

    def run(self) -> None:
        """Compute (again, after the product it reads was repaired), let the fault hook see the
        output, check."""
        raise NotImplementedError

    def recompute(self) -> Verdict:
        """Recompute after a failed invariant; the new verdict."""
        raise NotImplementedError


class ForwardStep(Step):
    """The forward softmax: ``probs`` from the raw ``scores`` (the operands of
    :func:`attention.softmax_steps.forward_step`); each backend's class implements the steps."""

    def __init__(self, inp: Any, scores: Any, probs: Any, ctx: Any, ws: Any, plan: Any | None):
        super().__init__()
        self.inp, self.scores, self.probs, self.ctx, self.ws, self.plan = \
            inp, scores, probs, ctx, ws, plan


class BackwardStep(Step):
    """The backward softmax: ``dS`` from ``d_probs`` and ``probs`` (the operands of
    :func:`attention.softmax_steps.backward_step`); each backend's class implements the steps."""

    def __init__(self, d_probs: Any, probs: Any, d_scores: Any, scale: float, ctx: Any, ws: Any,
                 plan: Any | None, causal: bool, dropout: Any | None):
        super().__init__()
        self.dp, self.p, self.ds, self.scale = d_probs, probs, d_scores, scale
        self.causal, self.ctx, self.ws, self.plan = causal, ctx, ws, plan
        self.keep = None if dropout is None else dropout.keep
        self.keep_scale = 1.0 if dropout is None else dropout.scale
