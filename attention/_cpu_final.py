"""numba kernels of the fused core's final checks (:mod:`attention.fused_final`): one pass over
each ``(heads, rows, d)`` operand, float64 sums of float32 or float64 data as stored (no float64
copy of an operand), heads one after another.
"""
from __future__ import annotations

from typing import Any

import numba
import numpy as np

from attention import _cpu_fused as K

#: As in :mod:`attention._cpu_fused`: reassociation and contraction vectorize the sums; no
#: ``fastmath=True``, which would let a NaN or INF through.
_FAST = {"reassoc", "contract"}
#: ``rows`` of :func:`column_sums` that counts every row.
EVERY_ROW = np.ones((0, 0), np.bool_)


@numba.njit(cache=True)
def observe_rows(x: Any, out: Any) -> None:
    """``out[b, r] = (sum_c x_brc, sum_c w_c x_brc, sum_c |x_brc|)``, ``w_c = (c + 1) / d``: the
    observed row checksums of every head of ``x`` ``(n, L, d)``, as the fused kernels weigh
    them; ``out`` ``(n, L, 3)``."""
    for b in range(x.shape[0]):
        K._observe_rows(x[b], out[b])


@numba.njit(cache=True, fastmath=_FAST)
def column_sums(x: Any, rows: Any, out: Any) -> None:
    """Per head ``b`` of ``x`` ``(n, L, d)`` and column ``c``: ``out[b, 0, c]`` the sum of
    ``x_brc`` over the rows ``r`` that ``rows`` ``(n, L)`` marks (:data:`EVERY_ROW`: all) and
    ``out[b, 1, c]`` the sum of ``|x_brc|`` over all rows; ``out`` ``(n, 2, d)``."""
    n, length, d = x.shape
    every = rows.shape[0] == 0
    for b in range(n):
        s, a = out[b, 0], out[b, 1]
        s[:] = 0.0
        a[:] = 0.0
        for r in range(length):
            xr = x[b, r]
            take = 1.0 if every else np.float64(rows[b, r])
            for c in range(d):
                v = np.float64(xr[c])
                s[c] += take * v
                a[c] += abs(v)


@numba.njit(cache=True)
def column_abs_max(x: Any, out: Any) -> None:
    """``out[b, c] = max_r |x_brc|`` for ``x`` ``(n, L, d)``, in float64."""
    n, length, d = x.shape
    for b in range(n):
        m = out[b]
        m[:] = 0.0
        for r in range(length):
            xr = x[b, r]
            for c in range(d):
                v = abs(np.float64(xr[c]))
                m[c] = v if v > m[c] else m[c]


@numba.njit(cache=True, fastmath=_FAST)
def dk_rows(d_out: Any, out: Any, vmax: Any, g: Any, a: Any, s: Any) -> None:
    """The row terms of the dK check's threshold, per head ``b`` and query row ``r`` of
    ``d_out`` and ``out`` ``(n, L, d)``: ``g[b, r] = sum_c |dO_brc| vmax[b, c]``, ``a[b, r] =
    sum_c |dO_brc O_brc|`` (the product in float64) and ``s[b, r] = sum_c |dO_brc|``."""
    n, length, d = d_out.shape
    for b in range(n):
        vm = vmax[b]
        for r in range(length):
            dr, orow = d_out[b, r], out[b, r]
            tg = ta = ts = 0.0
            for c in range(d):
                x = abs(np.float64(dr[c]))
                tg += x * vm[c]
                ta += abs(np.float64(dr[c]) * np.float64(orow[c]))
                ts += x
            g[b, r], a[b, r], s[b, r] = tg, ta, ts


@numba.njit(cache=True, fastmath=_FAST)
def add_weighted_abs_columns(x: Any, weight: Any, acc: Any) -> None:
    """``acc[b, c] += sum_r weight[b, r] |x_brc|`` for ``x`` ``(n, L, d)``, ``weight`` ``(n,
    L)``, ``acc`` ``(n, d)``."""
    n, length, d = x.shape
    for b in range(n):
        t = acc[b]
        for r in range(length):
            wr = weight[b, r]
            xr = x[b, r]
            for c in range(d):
                t[c] += wr * abs(np.float64(xr[c]))
