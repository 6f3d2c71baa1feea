"""CPU (numba) implementations of the softmax invariant checks of :mod:`attention.softmax`.

The same invariants, tolerances and NaN behaviour as the array-module versions there (which the
GPU runs), computed row by row in one pass and in float64: with NumPy the checks were ~20 array
operations over ``(batch*heads, seq, seq)``, each a full pass with a temporary (16 ms against
2 ms for the softmax itself at 16x256x256 float32). Summing in float64 only makes the computed
side more exact; the tolerances, set for the layer's accumulation dtype, are unchanged.
"""
from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np


@numba.njit(cache=True, inline="always")
def _worse(worst: float, value: float) -> float:
    """``max(worst, value)`` where a NaN on either side wins and stays."""
    if worst != worst or value != value:
        return math.nan
    return value if value > worst else worst


@numba.njit(cache=True)
def forward_errors(p: Any, z: Any, visible: Any, floor: float) -> tuple[float, float, float]:
    """``(worst row-sum error, worst log-identity error, largest |z| the identity used)``.

    ``p``, ``z``: ``(rows, L)`` float arrays; ``visible``: ``(rows, L)`` bool, or None for all
    visible. See :func:`attention.softmax.check_forward` for the invariants.
    """
    worst_row = 0.0
    worst_log = 0.0
    z_max = 0.0
    for i in range(p.shape[0]):
        pi, zi = p[i], z[i]
        finite = True
        any_visible = visible is None
        top = -math.inf
        arg = 0
        total = 0.0
        for j in range(pi.shape[0]):
            shown = visible is None or visible[i, j]
            if shown:
                any_visible = True
                if not math.isfinite(zi[j]):
                    finite = False
            v = np.float64(pi[j])
            total += v
            if v > top or (v != v and top == top):  # first maximum; a NaN is the maximum
                top, arg = v, j
        if not finite:
            continue
        worst_row = _worse(worst_row, abs(total - (1.0 if any_visible else 0.0)))
        if top != top:
            continue  # a NaN in P: the row-sum error is NaN already
        log_top = math.log(top) if top > 0 else 0.0
        z_top = np.float64(zi[arg])
        for j in range(pi.shape[0]):
            v = np.float64(pi[j])
            if v > floor * top and (visible is None or visible[i, j]):
                zj = np.float64(zi[j])
                worst_log = _worse(worst_log, abs(math.log(v) - log_top - (zj - z_top)))
                z_max = _worse(z_max, abs(zj))
    return worst_row, worst_log, z_max


@numba.njit(cache=True)
def backward_ratio(ds: Any, dp: Any, p: Any, u: float, tiny: float) -> tuple[float, float, float]:
    """``(worst error/tolerance ratio, that row's plain error, its plain tolerance)``.

    ``(rows, L)`` float arrays; see :func:`attention.softmax.check_backward` for the two row
    checksums and their tolerances. A non-finite ratio counts as infinite. Rows whose
    input-only sums (of P, ``|P dP|``, ``P dP**2``) are not finite are skipped: their P or dP
    holds INF/NaN, or overflows the check's own arithmetic, and plain math's dS passes through
    (a worst ratio of -1: no row was judged).
    """
    worst, worst_err, worst_tol = -1.0, 0.0, 0.0
    for i in range(ds.shape[0]):
        r = sum_p = sum_ds = abs_terms = abs_ds = second = ds_dp = abs_ds_dp = 0.0
        for j in range(ds.shape[1]):
            pj, dpj, dsj = np.float64(p[i, j]), np.float64(dp[i, j]), np.float64(ds[i, j])
            term = pj * dpj
            r += term
            sum_p += pj
            sum_ds += dsj
            abs_terms += abs(term)
            abs_ds += abs(dsj)
            second += term * dpj
            ds_dp += dsj * dpj
            abs_ds_dp += abs(dsj * dpj)
        if not (math.isfinite(sum_p) and math.isfinite(abs_terms) and math.isfinite(second)):
            continue
        plain_err = abs(sum_ds - r * (1 - sum_p))
        plain_tol = u * (abs_terms + abs_ds + abs(r)) + tiny
        weighted_err = abs(ds_dp - (second - r * r))
        weighted_tol = u * (abs(second) + r * r + abs_ds_dp) + tiny
        ratio = _worse(plain_err / plain_tol, weighted_err / weighted_tol)
        if not math.isfinite(ratio):
            ratio = math.inf
        if ratio > worst:
            worst, worst_err, worst_tol = ratio, plain_err, plain_tol
    return worst, worst_err, worst_tol


def rows(x: Any, dtype: np.dtype | None = None) -> np.ndarray:
    """``x`` as a C-contiguous ``(rows, L)`` array (cast to ``dtype`` if given; no copy when it
    already is one)."""
    x = np.asarray(x, dtype=dtype)
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
