"""CPU (numba) softmax-backward invariant check of :mod:`attention.softmax`, row by row.

The same invariants, tolerances and NaN behaviour as the GPU kernel (attention/kernels/softmax.cu),
computed in one pass per row. The sums run in the rows' dtype, the layer's accumulation dtype
(float32 for 16- and 32-bit layers: eight lanes instead of four): a float32 sum of ``L`` terms
errs by at most ``L`` units of roundoff of its magnitudes, and ``r**2`` by twice that of
``sum P dP**2`` (Cauchy-Schwarz), together at most 3/8 of the tolerance ``8 L`` units of the same
magnitudes; the GPU sums in float64. A row whose input-only sums overflow is not judged, as a
row holding INF/NaN (a dS fault that overflows a sum still fails its check).
:func:`backward_row` is also what the fused backward kernel of :mod:`attention._cpu_softmax`
runs on each row it produces.
"""
from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from attention._cpu_vmath import like


@numba.njit(cache=True, inline="always")
def _worse(worst: float, value: float) -> float:
    """``max(worst, value)`` where a NaN on either side wins and stays."""
    if worst != worst or value != value:
        return math.nan
    return value if value > worst else worst


@numba.njit(cache=True)
def backward_ratio(ds: Any, dp: Any, p: Any, u: float, tiny: float, seq_q: int,
                   causal: bool) -> tuple[float, float, float]:
    """``(worst error/tolerance ratio, that row's plain error, its plain tolerance)``.

    ``(rows, L)`` float arrays, row ``r`` the query ``r % seq_q``; see
    :func:`attention.softmax.check_backward` for the two row checksums and their tolerances. A
    non-finite ratio counts as infinite. Rows whose input-only sums (of P, ``|P dP|``,
    ``P dP**2``) are not finite are skipped: their P or dP holds INF/NaN, or overflows the
    check's own arithmetic, and plain math's dS passes through (a worst ratio of -1: no row was
    judged). ``causal``: past the diagonal P is 0 and dP is not read (see :func:`backward_row`).
    """
    result = np.array([-1.0, 0.0, 0.0])
    length = ds.shape[1]
    for r in range(ds.shape[0]):
        visible = min(r % seq_q + 1, length) if causal else length
        backward_row(ds[r], dp[r], p[r], visible, u, tiny, result)
    return result[0], result[1], result[2]


@numba.njit(cache=True, fastmath={"reassoc", "contract"}, inline="always")
def backward_row(ds: Any, dp: Any, p: Any, visible: int, u: float, tiny: float,
                 result: Any) -> None:
    """One row of :func:`backward_ratio`, folded into ``result`` ``[worst ratio, its plain
    error, its plain tolerance]``; ``r = sum P dP`` recomputed here. Entries from ``visible`` on
    (past the diagonal of a causal row) take P and dP as 0, without reading them: there dS must
    be 0, and only its plain sums see it (a fault stored there fails the plain checksum). The
    sums run in the rows' dtype (eight float32 lanes; see the module docstring), their
    combination in float64."""
    zero = like(ds, 0.0)
    r = sum_p = sum_ds = abs_terms = abs_ds = second = ds_dp = abs_ds_dp = zero
    for j in range(visible, ds.shape[0]):
        sum_ds += ds[j]
        abs_ds += abs(ds[j])
    for j in range(visible):
        pj, dpj, dsj = p[j], dp[j], ds[j]
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
        return
    r64, second64 = np.float64(r), np.float64(second)
    plain_err = abs(np.float64(sum_ds) - r64 * (1 - np.float64(sum_p)))
    plain_tol = u * (np.float64(abs_terms) + np.float64(abs_ds) + abs(r64)) + tiny
    weighted_err = abs(np.float64(ds_dp) - (second64 - r64 * r64))
    weighted_tol = u * (abs(second64) + r64 * r64 + np.float64(abs_ds_dp)) + tiny
    ratio = _worse(plain_err / plain_tol, weighted_err / weighted_tol)
    if not math.isfinite(ratio):
        ratio = math.inf
    if ratio > result[0]:
        result[0], result[1], result[2] = ratio, plain_err, plain_tol


def rows(x: Any, dtype: np.dtype | None = None) -> np.ndarray:
    """``x`` as a C-contiguous ``(rows, L)`` array (cast to ``dtype`` if given; no copy when it
    already is one)."""
    x = np.asarray(x, dtype=dtype)
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
