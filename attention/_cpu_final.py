"""numba kernels of the fused core's final checks (:mod:`attention.fused_final`): float64 sums of
float32 or float64 data as stored (no float64 copy of an operand), one pass over each operand,
heads in parallel.

Each kernel is one Python function compiled twice (:func:`abftgemm.cpu_kernels.twins`):
:data:`PARALLEL` runs its heads in numba's pool, :data:`SERIAL` one after another, for a process
that cannot enter the pool (:func:`abftgemm.threads.pool_kernels` picks).
"""
from __future__ import annotations

import types
from typing import Any

import numba
import numpy as np

from abftgemm.cpu_kernels import twins
from attention import _cpu_fused as K

#: As in :mod:`attention._cpu_fused`: reassociation and contraction vectorize the sums; no
#: ``fastmath=True``, which would let a NaN or INF through.
_FAST = {"reassoc", "contract"}
#: ``rows`` of :func:`column_sums` that counts every row.
EVERY_ROW = np.ones((0, 0), np.bool_)


def observe_rows(x: Any, out: Any) -> None:
    """``out[b, r] = (sum_c x_brc, sum_c w_c x_brc, sum_c |x_brc|)``, ``w_c = (c + 1) / d``: the
    observed row checksums of every head of ``x`` ``(n, L, d)``, as the fused kernels weigh
    them; ``out`` ``(n, L, 3)``."""
    for b in numba.prange(x.shape[0]):
        K._observe_rows(x[b], out[b])


def observe(x: Any, rows: Any, cols: Any) -> None:
    """:func:`observe_rows` into ``rows`` ``(n, L, 3)`` and, in the same pass, :func:`column_sums`
    over every row into ``cols`` ``(n, 2, d)``: what both final checks of a gradient read."""
    for b in numba.prange(x.shape[0]):
        _observe_head(x[b], rows[b], cols[b])


@numba.njit(cache=True, fastmath=_FAST)
def _observe_head(x: Any, rows: Any, cols: Any) -> None:
    """:func:`observe` of one head ``x`` ``(L, d)``."""
    d = x.shape[1]
    w = np.empty(d)
    for c in range(d):
        w[c] = (c + 1) / d
    s, a = cols[0], cols[1]
    s[:] = 0.0
    a[:] = 0.0
    for r in range(x.shape[0]):
        xr = x[r]
        t0 = t1 = t2 = 0.0
        for c in range(d):
            v = np.float64(xr[c])
            t0 += v
            t1 += v * w[c]
            t2 += abs(v)
            s[c] += v
            a[c] += abs(v)
        rows[r, 0], rows[r, 1], rows[r, 2] = t0, t1, t2


def column_sums(x: Any, rows: Any, out: Any) -> None:
    """Per head ``b`` of ``x`` ``(n, L, d)`` and column ``c``: ``out[b, 0, c]`` the sum of
    ``x_brc`` over the rows ``r`` that ``rows`` ``(n, L)`` marks (:data:`EVERY_ROW`: all) and
    ``out[b, 1, c]`` the sum of ``|x_brc|`` over all rows; ``out`` ``(n, 2, d)``."""
    every = rows.shape[0] == 0
    for b in numba.prange(x.shape[0]):
        s, a = out[b, 0], out[b, 1]
        s[:] = 0.0
        a[:] = 0.0
        for r in range(x.shape[1]):
            xr = x[b, r]
            take = 1.0 if every else np.float64(rows[b, r])
            for c in range(x.shape[2]):
                v = np.float64(xr[c])
                s[c] += take * v
                a[c] += abs(v)


def column_abs_max(x: Any, out: Any) -> None:
    """``out[b, c] = max_r |x_brc|`` for ``x`` ``(n, L, d)``, in float64."""
    for b in numba.prange(x.shape[0]):
        m = out[b]
        m[:] = 0.0
        for r in range(x.shape[1]):
            xr = x[b, r]
            for c in range(x.shape[2]):
                v = abs(np.float64(xr[c]))
                m[c] = v if v > m[c] else m[c]


def dk_rows(d_out: Any, out: Any, vmax: Any, g: Any, a: Any, s: Any) -> None:
    """The row terms of the dK check's threshold, per head ``b`` and query row ``r`` of
    ``d_out`` and ``out`` ``(n, L, d)``: ``g[b, r] = sum_c |dO_brc| vmax[b, c]``, ``a[b, r] =
    sum_c |dO_brc O_brc|`` (the product in float64) and ``s[b, r] = sum_c |dO_brc|``."""
    for b in numba.prange(d_out.shape[0]):
        vm = vmax[b]
        for r in range(d_out.shape[1]):
            dr, orow = d_out[b, r], out[b, r]
            tg = ta = ts = 0.0
            for c in range(d_out.shape[2]):
                x = abs(np.float64(dr[c]))
                tg += x * vm[c]
                ta += abs(np.float64(dr[c]) * np.float64(orow[c]))
                ts += x
            g[b, r], a[b, r], s[b, r] = tg, ta, ts


def add_weighted_abs_columns(x: Any, weights: Any, acc: Any) -> None:
    """``acc[i, b, c] += sum_r weights[i, b, r] |x_brc|`` for ``x`` ``(n, L, d)``, ``weights``
    ``(m, n, L)``, ``acc`` ``(m, n, d)``: ``m`` weightings of the magnitudes in one pass."""
    for b in numba.prange(x.shape[0]):
        for r in range(x.shape[1]):
            xr = x[b, r]
            for i in range(weights.shape[0]):
                wr = weights[i, b, r]
                t = acc[i, b]
                for c in range(x.shape[2]):
                    t[c] += wr * abs(np.float64(xr[c]))


_KERNELS = (observe_rows, observe, column_sums, column_abs_max, dk_rows,
            add_weighted_abs_columns)
_COMPILED = {f.__name__: twins(f, cache=True, fastmath=_FAST) for f in _KERNELS}
#: The kernels, heads in numba's pool.
PARALLEL = types.SimpleNamespace(**{name: pair[0] for name, pair in _COMPILED.items()})
#: The same kernels, heads one after another.
SERIAL = types.SimpleNamespace(**{name: pair[1] for name, pair in _COMPILED.items()})
