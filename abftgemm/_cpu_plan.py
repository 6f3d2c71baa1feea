"""A planned product's CPU workspace and the two verification launches of its fast path,
:func:`predict_cols` and :func:`observe_flag_cols`, which write only into it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numba
import numpy as np

from abftgemm.cpu_kernels import (FAST, as_float32, bits_table, fields, judge, rows_first,
                                  sum_columns, sum_rows)

if TYPE_CHECKING:
    from abftgemm._cpu import CpuBackend
    from abftgemm.backend import ColumnThresholds

#: Rows of a 16-bit product converted to float32 at a time (cache resident).
_BITS_BLOCK = 64


@numba.njit(cache=True, fastmath=FAST)
def predict_cols(a: Any, a_transposed: bool, b: Any, b_transposed: bool, bias: Any,
                 encode_a: bool, weights_m: Any, enc: Any, p: Any, rows: Any, pred: Any) -> None:
    """Predicted column checksums ``pred`` (batch, 3, n), ``[plain, weighted, sum |A||B|]``, of
    ``a @ b (+ bias)``: ``a`` (batch or 1, m, k) and ``b`` (batch or 1, k, n) as ``rows_first``
    gives them, ``bias`` (n,) or (0,) for none, ``enc`` (3, batch or 1, k) the column encoding of
    ``a`` (computed here with ``encode_a``); ``p`` and ``rows`` are workspaces."""
    m = a.shape[2] if a_transposed else a.shape[1]
    if encode_a:
        encode_cols(a, a_transposed, weights_m, rows, enc)
    mean_weight = (m + 1) / 2 / max(m, 1)
    for t in range(pred.shape[0]):
        _column_sums(b[min(t, b.shape[0] - 1)], b_transposed, fields(enc, t), rows, p)
        for j in range(bias.shape[0]):
            pred_bias = bias[j] * m
            p[0, j] += pred_bias
            p[1, j] += pred_bias * mean_weight
            p[2, j] += abs(pred_bias)
        pred[t] = p


@numba.njit(cache=True, fastmath=FAST)
def encode_cols(a: Any, a_transposed: bool, weights_m: Any, rows: Any, enc: Any) -> None:
    """Column encoding ``enc`` (3, batch, k) of ``a`` (batch, m, k), or of the matrices whose
    transposes ``a`` holds (``rows``: a (k, 5) workspace)."""
    for i in range(enc.shape[1]):
        _column_sums(a[i], a_transposed, weights_m, rows, fields(enc, i))


@numba.njit(cache=True, fastmath=FAST)
def observe_flag_cols(c: Any, table: Any, weights_m: Any, pred: Any, c_obs: float, c_pred: float,
                      floor: float, c_mag: float, safe: float, counts: Any, scratch: Any,
                      obs: Any) -> int:
    """Observe the column checksums ``obs`` (3, batch, n) of the product ``c`` and judge every
    column against ``pred``. ``c`` is float32/float64 with ``table`` None, or a 16-bit product's
    bit patterns with ``table`` their float32 values, converted a block of rows at a time into
    ``scratch``. Returns the number flagged or unverifiable."""
    m = c.shape[1]
    total = 0
    for t in range(c.shape[0]):
        obs[:, t] = 0.0
        o = fields(obs, t)
        if table is None:
            sum_columns(c[t], weights_m, 0, m, o)
        else:
            for i0 in range(0, m, scratch.shape[0]):
                rows = min(scratch.shape[0], m - i0)
                for i in range(rows):
                    src, dst = c[t, i0 + i], scratch[i]
                    for j in range(src.shape[0]):
                        dst[j] = table[src[j]]
                sum_columns(scratch, weights_m[i0:i0 + rows], 0, rows, o)
        for j in range(counts.shape[0]):
            counts[j] = 0.0
            if not (np.isfinite(o[0][j]) and np.isfinite(o[1][j]) and np.isfinite(o[2][j])):
                for i in range(m):
                    x = c[t, i, j] if table is None else table[c[t, i, j]]
                    counts[j] += not np.isfinite(x)
        for j in range(counts.shape[0]):
            _, flagged, ok = judge(pred[t, 0, j], pred[t, 1, j], pred[t, 2, j], o[0][j], o[1][j],
                                   o[2][j], counts[j], c_obs, c_pred, floor, c_mag, safe)
            total += flagged or not ok
    return total


@numba.njit(cache=True, fastmath=FAST, inline="always")
def _column_sums(x: Any, transposed: bool, c: Any, rows: Any, out: Any) -> None:
    """The column sums of ``x``, or of the matrix whose transpose ``x`` (L, r) is (read along
    ``x``'s rows into ``rows``, an (>= L, 5) workspace), into ``out`` (3, L)."""
    f0, f1, f2 = out[0], out[1], out[2]
    if transposed:
        sum_rows(x, c, 0, x.shape[0], rows)
        for j in range(x.shape[0]):
            f0[j], f1[j], f2[j] = rows[j, 0], rows[j, 1], rows[j, 2]
    else:
        f0[:] = 0.0
        f1[:] = 0.0
        f2[:] = 0.0
        sum_columns(x, c, 0, x.shape[0], out)


class CpuWorkspace:
    """Every array a planned product needs on the CPU, allocated once, and the launches that
    use them, both counted in ``counters`` (a :class:`abftgemm.plan.Counters`)."""

    def __init__(self, backend: CpuBackend, op: Any, counters: Any,
                 thresholds: ColumnThresholds | None):
        self._backend = backend
        self._counters = counters
        batch, m, k, n = op.batch, op.m, op.k, op.n
        self._wide = op.dtype.itemsize == 2
        # 16-bit: the prediction reads the GEMM's float32 copies of a and b (or its own)
        self._converted = False
        self._buffers = self._table = self._scratch = None
        if self._wide:
            self._table = bits_table(op.dtype)
            self._a32 = self._alloc(op.a.shape, np.float32)
            self._b32 = self._alloc(op.b.shape, np.float32)
            self._buffers = (self._a32, self._b32, self._alloc((batch, m, n), np.float32),
                             self._alloc((n,), np.float32))
        if thresholds is None:
            return
        self._coefficients, self._safe = thresholds
        self._weights = self._alloc((m,), np.float64)
        self._weights[:] = np.arange(1, m + 1) / m
        self._bias64 = self._alloc((n if op.bias is not None else 0,), np.float64)
        self._enc = self._alloc((3, op.a.shape[0], k), np.float64)
        self._used = self._enc  # the encoding of a the last prediction read
        self._given: np.ndarray | None = None  # handed on for the next prediction
        self._p = self._alloc((3, n), np.float64)
        self._rows = self._alloc((max(n, k), 5), np.float64)
        self._pred = self._alloc((batch, 3, n), np.float64)
        self._obs = self._alloc((3, batch, n), np.float64)
        self._counts = self._alloc((n,), np.float64)
        self._flagged = 0  # the verdict of the last observation, as its kernel returned it
        if self._wide:
            self._scratch = self._alloc((min(_BITS_BLOCK, max(m, 1)), n), np.float32)

    def _alloc(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        self._counters.allocations += 1
        return np.zeros(shape, dtype=dtype)

    def gemm(self, op: Any, c: np.ndarray, triangle: str | None = None) -> None:
        """``c = op.a @ op.b (+ op.bias)`` without allocating."""
        self._counters.launches += 1 + (op.bias is not None)  # a bias is one more, as on the GPU
        self._backend.gemm(op.a, op.b, c, op.bias, triangle, buffers=self._buffers)
        self._converted = self._wide

    def encode(self, a: np.ndarray) -> None:
        """Column encoding of ``a`` into the workspace now (a constant operand)."""
        self._counters.launches += 1
        if self._wide:
            a = as_float32(a, self._a32)
        encode_cols(*rows_first(a), self._weights, self._rows, self._enc)

    def set_encoding(self, cols: np.ndarray) -> None:
        """Use the column encoding ``cols`` in the next prediction, read in place."""
        self._given = cols

    def predict(self, op: Any, encode_a: bool) -> None:
        """Predicted column checksums of the product of ``op`` (launch 1)."""
        self._counters.launches += 1
        if op.bias is not None:
            np.copyto(self._bias64, op.bias, casting="unsafe")
        given, self._given = self._given, None
        self._used = self._enc if encode_a or given is None else given
        if self._wide and not self._converted:  # a caller's GEMM ran: this product's copies
            as_float32(op.a, self._a32)
            as_float32(op.b, self._b32)
        self._converted = False
        predict_cols(*rows_first(self._a32 if self._wide else op.a),
                     *rows_first(self._b32 if self._wide else op.b), self._bias64, encode_a,
                     self._weights, self._used, self._p, self._rows, self._pred)

    def observe_flag(self, c: np.ndarray) -> None:
        """Observe and judge the product's columns (launch 2)."""
        self._counters.launches += 1
        self._flagged = observe_flag_cols(
            c.view(np.uint16) if self._wide else c, self._table, self._weights, self._pred,
            *self._coefficients, self._safe, self._counts, self._scratch, self._obs)

    def release(self) -> None:
        """Nothing to free beyond the arrays, which go with the workspace object."""

    def abandon(self) -> None:
        """Forget the float32 copies of an execute that stopped before its prediction, and an
        encoding handed on to it."""
        self._converted = False
        self._given = None

    def ready_verdict(self) -> None:
        """The verdict is already in host memory."""

    def verdict_flagged(self) -> bool:
        """True when the last observation flagged a column or found one unverifiable."""
        return self._flagged > 0

    def a_encoding(self) -> np.ndarray:
        """Column encoding of ``a`` the last prediction used (the workspace, or one handed on)."""
        return self._used

    def observed_cols(self) -> np.ndarray:
        """Observed column encoding of the last product, ``(3, batch, n)`` (the workspace)."""
        return self._obs
