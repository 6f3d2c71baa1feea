"""CPU backend: NumPy GEMM plus numba kernels (built from :mod:`abftgemm.cpu_kernels`) that reduce
a matrix to checksums in one pass.

The numba kernels are compiled on first use and cached on disk (``cache=True``), so a new process
does not recompile them. 16-bit data is upcast to float32 before the kernels (numba has no
float16/bfloat16 arithmetic); the GEMM itself accumulates in float32 for 16-bit inputs.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numba
import numpy as np
from numba.extending import overload

from abftgemm._cpu_plan import CpuWorkspace
from abftgemm._cpu_triangles import complete_lower, lower_product, row_limits, triangular_matmul
from abftgemm.checksums import location_weights
from abftgemm.cpu_kernels import (FAST, as_float32, fields, judge, row_sums, rows_first,
                                  store_columns, sum_columns, sum_row, sum_rows)

if TYPE_CHECKING:
    from abftgemm.backend import ColumnThresholds

_ROW_BLOCK = 64  # rows per cache-resident block of _both_reduce


def _batch_item(coef: Any, b: int) -> Any:
    """Batch item ``b`` of coefficients ``(3, batch or 1, L)`` as :func:`fields` gives it; the
    default weights ``(L,)`` as they are."""
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
    """Row reduction of every batch item (see backend.py ``row_reduce``).

    With the default coefficients the rows are read one at a time: with no coefficient vectors
    to share between rows there is nothing to gain from several concurrent row streams, and
    they read from memory more slowly (bench/NOTES.md).
    """
    for b in range(out.shape[0]):
        xb, cb = x[min(b, x.shape[0] - 1)], _batch_item(coef, b)
        if coef.ndim == 1:
            for i in range(xb.shape[0]):
                sum_row(xb[i], cb, out[b, i])
        else:
            sum_rows(xb, cb, 0, xb.shape[0], out[b])


@numba.njit(cache=True, fastmath=FAST)
def _both_reduce(x: Any, ccoef: Any, rcoef: Any, out_col: Any, out_row: Any) -> None:
    """Column and row reductions of every batch item in one read of it from memory.

    ``ccoef``/``rcoef`` are encodings ``(3, batch or 1, L)`` (field-major, so the inner loops read
    them contiguously) or the default location weights ``(L,)``. The rows go through in blocks of 64
    that stay in cache for their second use. With default row coefficients a block's row sums stream
    it in one row at a time, then its column sums re-read it; with coefficient vectors the column
    sums stream it in, then its row sums re-read it four rows at a time, each coefficient loaded
    once per four rows. Each is the fastest order measured (bench/NOTES.md).
    """
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
    """Threshold, verifiability and disagreement of every vector (see backend.py ``flag``).

    Written without short-circuit branches and with the counts kept in registers, so the loop
    vectorizes.
    """
    n_bad = 0
    n_unverifiable = 0
    for i in range(pred.shape[0]):
        t, flagged, ok = judge(pred[i, 0], pred[i, 1], pred[i, 2], obs[i, 0], obs[i, 1],
                               obs[i, 2], obs[i, 3], c_obs, c_pred, floor, c_mag, safe)
        tau[i] = t
        verifiable[i] = ok
        bad[i] = flagged
        n_bad += flagged
        n_unverifiable += not ok
    counts[0] += n_bad
    counts[1] += n_unverifiable


def _coefficients(coef: np.ndarray | None, length: int) -> np.ndarray:
    """Coefficients as the kernels take them: an encoding ``(3, batch or 1, length)`` as it is
    (read in place, each field vector contiguously when it is C-contiguous); None (the
    defaults) as the location weights alone, ``(length,)``."""
    return _default_weights(length) if coef is None else coef


@lru_cache(maxsize=64)
def _default_weights(length: int) -> np.ndarray:
    """Location weights ``(l+1)/length`` (read-only, shared). They are data, not computed in the
    kernels: with ``(l+1) * (1/length)`` computed inline, LLVM's reassociation factored the
    ``1/length`` out of the sum, and ``sum (l+1) * x_l`` overflowed for near-INF float64 errors
    (the normalization exists to prevent exactly that)."""
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
    ``j < limits[i]`` only (see :meth:`CpuBackend.predict_lower_rows`): the row encoding of
    ``b``'s leading columns grows block by block (one read of ``b``, by rows of ``b`` or, with
    ``b_transposed``, of its C-contiguous transpose), and each block's rows take it so far."""
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
        cuBLAS does with compute type 32F) and round once; ``buffers`` ``(a32, b32, c32,
        bias32)`` are float32 workspaces for that (a plan's; new arrays when None). With
        ``triangle``, ``a`` is zero outside it and only its triangle's blocks are multiplied;
        with ``out_triangle="lower"`` (no bias) row ``i`` is computed up to
        ``row_limits(m, n)[i]`` only, in float32/float64 (:mod:`abftgemm._cpu_triangles`)."""
        if a.dtype in (np.float32, np.float64):
            if out_triangle is not None and bias is None:
                lower_product(a, b, out)
                return
            triangular_matmul(a, b, out, triangle)
            if bias is not None:
                add_bias(out, bias)
            return
        a32, b32, c32, bias32 = buffers if buffers is not None else (None,) * 4
        if c32 is None:
            c32 = np.empty(out.shape, np.float32)
        acc = triangular_matmul(as_float32(a, a32), as_float32(b, b32), c32, triangle)
        if bias is not None:
            add_bias(acc, as_float32(bias, bias32))
        out[...] = acc

    def row_limits(self, m: int, n: int, dtype: Any) -> np.ndarray | None:
        """:func:`abftgemm._cpu_triangles.row_limits`; None when every row is whole (always for
        16-bit products)."""
        if np.dtype(dtype) not in (np.float32, np.float64):
            return None
        limits = row_limits(m, n)
        return None if (limits == n).all() else limits

    def complete_lower(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """See :class:`abftgemm.backend.RowPrefixes` (float32/float64: there are limits)."""
        complete_lower(a, b, out)

    def predict_lower_rows(self, a: np.ndarray, b: np.ndarray, limits: np.ndarray,
                           enc: np.ndarray, pred: np.ndarray) -> None:
        """See :class:`abftgemm.backend.RowPrefixes`: the fields of ``row_reduce(a, coef)``, with
        the default location weights of the whole row."""
        _predict_lower_rows(a, *rows_first(b), _default_weights(b.shape[-1]), limits, enc,
                            pred)

    def synchronize(self) -> None:
        """Nothing runs asynchronously on the CPU."""

    def plan_workspace(self, op: Any, counters: Any, thresholds: ColumnThresholds | None,
                       verdicts: Any) -> CpuWorkspace:
        """Workspaces and launches of a planned product (:mod:`abftgemm._cpu_plan`; its verdict
        is the kernel's return value, host memory: no ledger slot)."""
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
