"""CPU backend: NumPy GEMM plus numba kernels (built from :mod:`abftgemm.cpu_kernels`) that reduce
a matrix to checksums in one pass. 16-bit data reaches the kernels as float32 (numba has no
float16/bfloat16 arithmetic).
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numba
import numpy as np
from numba.extending import overload

from abftgemm._cpu_plan import CpuWorkspace
from abftgemm._cpu_triangles import lower_product, row_limits, triangular_matmul
from abftgemm.checksums import location_weights
from abftgemm.cpu_kernels import (FAST, as_float32, fields, judge, row_sums, rows_first,
                                  store_columns, sum_columns, sum_row, sum_rows)

if TYPE_CHECKING:
    from abftgemm.backend import ColumnThresholds

_ROW_BLOCK = 64  # rows per cache-resident block of _both_reduce


def _batch_item(coef: Any, b: int) -> Any:
    """Batch item ``b`` of an encoding ``(3, batch or 1, L)``; default weights ``(L,)`` as is."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_batch_item, inline="always")
def _batch_item_impl(coef, b):  # noqa: ANN001 (numba compares signatures)
    if coef.ndim == 1:
        return lambda coef, b: coef
    return lambda coef, b: fields(coef, b)


@numba.njit(cache=True, fastmath=FAST)
def _col_reduce(x: Any, coef: Any, out: Any) -> None:
    """Column reduction of every batch item (see backend.py ``col_reduce``)."""
    p = np.empty((3, x.shape[2]))
    for b in range(out.shape[0]):
        xb = x[min(b, x.shape[0] - 1)]
        p[:] = 0.0
        sum_columns(xb, _batch_item(coef, b), 0, xb.shape[0], p)
        store_columns(xb, p, out[b])


@numba.njit(cache=True, fastmath=FAST)
def _row_reduce(x: Any, coef: Any, out: Any) -> None:
    """Row reduction of every batch item (see backend.py ``row_reduce``); one row at a time
    with the default coefficients, which leave no vectors to share between rows."""
    for b in range(out.shape[0]):
        xb, cb = x[min(b, x.shape[0] - 1)], _batch_item(coef, b)
        if coef.ndim == 1:
            for i in range(xb.shape[0]):
                sum_row(xb[i], cb, out[b, i])
        else:
            sum_rows(xb, cb, 0, xb.shape[0], out[b])


@numba.njit(cache=True, fastmath=FAST)
def _both_reduce(x: Any, ccoef: Any, rcoef: Any, out_col: Any, out_row: Any) -> None:
    """Column and row reductions of every batch item in one read of it: blocks of rows stay in
    cache for their second pass, in the order measured fastest per kind of row coefficients."""
    nrows = x.shape[1]
    p = np.empty((3, x.shape[2]))
    for b in range(out_col.shape[0]):
        xb = x[min(b, x.shape[0] - 1)]
        cc, rc = _batch_item(ccoef, b), _batch_item(rcoef, b)
        p[:] = 0.0
        for i in range(0, nrows, _ROW_BLOCK):
            e = min(i + _ROW_BLOCK, nrows)
            if rcoef.ndim == 1:
                for r in range(i, e):
                    sum_row(xb[r], rc, out_row[b, r])
                sum_columns(xb, cc, i, e, p)
            else:
                sum_columns(xb, cc, i, e, p)
                sum_rows(xb, rc, i, e, out_row[b])
        store_columns(xb, p, out_col[b])


@numba.njit(cache=True)
def _flag(pred: Any, obs: Any, c_obs: float, c_pred: float, floor: float, c_mag: float,
          safe: float, tau: Any, bad: Any, verifiable: Any, counts: Any) -> None:
    """Threshold, verifiability and disagreement of every vector (see backend.py ``flag``),
    without short-circuit branches and with the counts in registers, so the loop vectorizes."""
    n_bad = n_unverifiable = 0
    for i in range(pred.shape[0]):
        t, flagged, ok = judge(pred[i, 0], pred[i, 1], pred[i, 2], obs[i, 0], obs[i, 1],
                               obs[i, 2], obs[i, 3], c_obs, c_pred, floor, c_mag, safe)
        tau[i], bad[i], verifiable[i] = t, flagged, ok
        n_bad += flagged
        n_unverifiable += not ok
    counts[0] += n_bad
    counts[1] += n_unverifiable


def _coefficients(coef: np.ndarray | None, length: int) -> np.ndarray:
    """An encoding ``(3, batch or 1, length)`` as it is; None as the location weights."""
    return _default_weights(length) if coef is None else coef


@lru_cache(maxsize=64)
def _default_weights(length: int) -> np.ndarray:
    """Location weights ``(l+1)/length``, read-only. Computed inline, LLVM factored the
    ``1/length`` out of the sum, which then overflowed for near-INF float64 errors."""
    weights = location_weights(length)
    weights.setflags(write=False)
    return weights


def _kernel_view(x: np.ndarray) -> np.ndarray:
    """float32/float64 data as is (any strides); 16-bit data upcast to float32."""
    return x if x.dtype in (np.float32, np.float64) else as_float32(x)


@numba.njit(cache=True)
def add_bias(c: Any, bias: Any) -> None:
    """``c[t, i, :] += bias`` for every row (NumPy's broadcasting ``+=`` allocates a buffer)."""
    for t in range(c.shape[0]):
        for i in range(c.shape[1]):
            row = c[t, i]
            for j in range(row.shape[0]):
                row[j] += bias[j]


@numba.njit(cache=True, fastmath=FAST)
def _predict_lower_rows(a: Any, b: Any, b_transposed: bool, weights_n: Any, limits: Any,
                        enc: Any, pred: Any) -> None:
    """Row checksums of every batch item of ``a @ b`` where row ``i`` covers columns
    ``j < limits[i]`` only: the row encoding of ``b``'s leading columns grows block by block
    (one read of ``b``), and each block's rows take it so far."""
    m = pred.shape[1]
    for t in range(pred.shape[0]):
        at, bt = a[min(t, a.shape[0] - 1)], b[min(t, b.shape[0] - 1)]
        enc[:] = 0.0
        done = i = 0
        while i < m:
            hi = limits[i]
            if b_transposed:  # column j of b is row j of bt
                sum_columns(bt, weights_n, done, hi, enc)
            else:
                for c in range(bt.shape[0]):
                    s0, s1, s2 = row_sums(bt[c, done:hi], weights_n[done:hi])
                    enc[0, c] += s0
                    enc[1, c] += s1
                    enc[2, c] += s2
            done, end = hi, i
            while end < m and limits[end] == hi:
                end += 1
            sum_rows(at, enc, i, end, pred[t])
            i = end


class CpuBackend:
    """NumPy + numba implementation of :class:`abftgemm.backend.Backend`."""

    name = "numpy"
    xp = np

    def flag(self, pred: np.ndarray, obs: np.ndarray,
             coefficients: tuple[float, float, float, float], safe: float, counts: np.ndarray,
             out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        shape = pred.shape[:-1]
        tau, bad, verifiable = out if out is not None else (
            np.empty(shape), np.empty(shape, bool), np.empty(shape, bool))
        _flag(pred.reshape(-1, 5), obs.reshape(-1, 5), *coefficients, safe, tau.reshape(-1),
              bad.reshape(-1), verifiable.reshape(-1), counts)
        return tau, bad, verifiable

    def gemm(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None,
             triangle: str | None = None, out_triangle: str | None = None, *,
             buffers: tuple[np.ndarray, ...] | None = None) -> None:
        """``out = a @ b (+ bias)`` (see backend.py). 16-bit products accumulate in float32 (as
        cuBLAS does) in ``buffers`` ``(a32, b32, c32, bias32)`` (new arrays when None) and round
        once. ``triangle`` and ``out_triangle`` as in :mod:`abftgemm._cpu_triangles`; the latter
        only for float32/float64 without bias."""
        if a.dtype not in (np.float32, np.float64):
            a32, b32, c32, bias32 = buffers or (None, None, np.empty(out.shape, np.float32), None)
            triangular_matmul(as_float32(a, a32), as_float32(b, b32), c32, triangle)
            if bias is not None:
                add_bias(c32, as_float32(bias, bias32))
            with np.errstate(over="ignore"):  # an overflow to INF is the checks' finding
                out[...] = c32
        elif out_triangle is not None and bias is None:
            lower_product(a, b, out)
        else:
            triangular_matmul(a, b, out, triangle)
            if bias is not None:
                add_bias(out, bias)

    def row_limits(self, m: int, n: int, dtype: Any) -> np.ndarray | None:
        """:func:`abftgemm._cpu_triangles.row_limits`; None when every row is whole."""
        if np.dtype(dtype) not in (np.float32, np.float64):
            return None
        limits = row_limits(m, n)
        return None if (limits == n).all() else limits

    def complete_lower(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """See :class:`abftgemm.backend.RowPrefixes` (float32/float64: there are limits)."""
        lower_product(a, b, out, rest=True)

    def predict_lower_rows(self, a: np.ndarray, b: np.ndarray, limits: np.ndarray,
                           enc: np.ndarray, pred: np.ndarray) -> None:
        """See :class:`abftgemm.backend.RowPrefixes` (the location weights of whole rows)."""
        _predict_lower_rows(a, *rows_first(b), _default_weights(b.shape[-1]), limits, enc,
                            pred)

    def synchronize(self) -> None:
        """Nothing runs asynchronously on the CPU."""

    def plan_workspace(self, op: Any, counters: Any, thresholds: ColumnThresholds | None,
                       verdicts: Any) -> CpuWorkspace:
        """:mod:`abftgemm._cpu_plan`'s workspace (its verdict is in host memory: no ledger slot)."""
        return CpuWorkspace(self, op, counters, thresholds)

    def col_reduce(self, x: np.ndarray, coef: np.ndarray | None, out: np.ndarray) -> None:
        _col_reduce(_kernel_view(x), _coefficients(coef, x.shape[1]), out)

    def row_reduce(self, x: np.ndarray, coef: np.ndarray | None, out: np.ndarray) -> None:
        _row_reduce(_kernel_view(x), _coefficients(coef, x.shape[2]), out)

    def both_reduce(self, x: np.ndarray, col_coef: np.ndarray | None,
                    row_coef: np.ndarray | None, out_col: np.ndarray, out_row: np.ndarray) -> None:
        _both_reduce(_kernel_view(x), _coefficients(col_coef, x.shape[1]),
                     _coefficients(row_coef, x.shape[2]), out_col, out_row)


@lru_cache(maxsize=1)
def backend() -> CpuBackend:
    """The process-wide CPU backend."""
    return CpuBackend()
