"""CPU kernels of a planned product: the two verification launches of the fast path.

A planned product (:class:`abftgemm.plan.ProtectedMatmul`) verifies its columns on the fast path:

1. :func:`predict_cols` reads ``a`` once for its column encoding ``E^T A`` (plain sums, sums
   weighted by the location weights ``(i+1)/m``, sums of ``|.|``) and ``b`` once to carry it
   through: ``pred = (E^T A) B`` and ``S = (1^T |A|) |B|`` per column of the product;
2. :func:`observe_flag_cols` reads the product once for its column checksums and judges every
   column on the same pass, returning the number of flagged or unverifiable columns (the
   verdict).

Both write only into workspaces the plan allocated, so an execute allocates nothing. 16-bit
products are observed through a 65536-entry float32 table of their bit patterns, a few rows at a
time, so that the product is read once and never copied whole. The judgement of a column is the
same as the ``flag`` primitive's (:func:`abftgemm.cpu_kernels.judge`).
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

#: Rows of a 16-bit product converted to float32 at a time (64 rows of 4096 float32 values are
#: 1 MiB, cache resident).
_BITS_BLOCK = 64


@numba.njit(cache=True, fastmath=FAST)
def predict_cols(a: Any, a_transposed: bool, b: Any, b_transposed: bool, bias: Any,
                 encode_a: bool, weights_m: Any, enc: Any, p: Any, rows: Any, pred: Any) -> None:
    """Predicted column checksums of every batch item of ``a @ b (+ bias)``.

    Parameters
    ----------
    a : (batch or 1, m, k) float32/float64, or with ``a_transposed`` its transpose (see b)
    b : (batch or 1, k, n) float32/float64, or with ``b_transposed`` its transpose
        (batch or 1, n, k), read along its rows (a column-major ``B``, such as PyTorch's
        ``x @ W.T``, read down its columns at memory speed instead of across them)
    bias : (n,) float64, or (0,) for none
    encode_a : bool
        Compute ``enc`` from ``a`` (False: ``enc`` holds an encoding handed in or kept constant).
    weights_m : (m,) float64 location weights
    enc : (3, batch or 1, k) float64: the column encoding of ``a`` (written with ``encode_a``)
    p : (3, n) float64 workspace
    rows : (max(n, k), 5) float64 workspace (used with ``a_transposed``, ``b_transposed``)
    pred : (batch, 3, n) float64 output: ``[plain, weighted, sum |A||B|]`` per column
    """
    m = a.shape[2] if a_transposed else a.shape[1]
    if encode_a:
        encode_cols(a, a_transposed, weights_m, rows, enc)
    mean_weight = (m + 1) / 2 / max(m, 1)
    for t in range(pred.shape[0]):
        p[:] = 0.0
        bt, et = b[min(t, b.shape[0] - 1)], fields(enc, t)
        if b_transposed:
            _row_sums_as_columns(bt, et, rows, p)
        else:
            sum_columns(bt, et, 0, bt.shape[0], p)
        for j in range(bias.shape[0]):
            pred_bias = bias[j] * m
            p[0, j] += pred_bias
            p[1, j] += pred_bias * mean_weight
            p[2, j] += abs(pred_bias)
        pred[t] = p


@numba.njit(cache=True, fastmath=FAST)
def encode_cols(a: Any, a_transposed: bool, weights_m: Any, rows: Any, enc: Any) -> None:
    """Column encoding ``enc`` (3, batch, k) of ``a`` (batch, m, k): plain, location-weighted
    and absolute column sums (with ``a_transposed``, ``a`` is given as its transpose
    (batch, k, m), and each column is a row dot product; ``rows`` is a (k, 5) workspace)."""
    for i in range(enc.shape[1]):
        e = fields(enc, i)
        if a_transposed:
            _row_sums_as_columns(a[i], weights_m, rows, e)
        else:
            enc[:, i] = 0.0
            sum_columns(a[i], weights_m, 0, a.shape[1], e)


@numba.njit(cache=True, fastmath=FAST)
def observe_flag_cols(c: Any, weights_m: Any, pred: Any, c_obs: float, c_pred: float,
                      floor: float, c_mag: float, safe: float, counts: Any, obs: Any) -> int:
    """Observe the column checksums of a float32/float64 product and judge every column.

    ``c`` (batch, m, n); ``pred`` (batch, 3, n) from :func:`predict_cols`; ``counts`` (n,)
    workspace; ``obs`` (3, batch, n) output: the observed column encoding of the product, to
    hand on as it is. Returns the number of flagged or unverifiable columns (the verdict; host
    memory, so no array holds it).
    """
    total = 0
    for t in range(c.shape[0]):
        obs[:, t] = 0.0
        o = fields(obs, t)
        sum_columns(c[t], weights_m, 0, c.shape[1], o)
        for j in range(counts.shape[0]):
            counts[j] = 0.0
            if not (np.isfinite(o[0][j]) and np.isfinite(o[1][j]) and np.isfinite(o[2][j])):
                for i in range(c.shape[1]):
                    counts[j] += not np.isfinite(c[t, i, j])
        total += _judge_columns(pred[t], o, counts, c_obs, c_pred, floor, c_mag, safe)
    return total


@numba.njit(cache=True, fastmath=FAST)
def observe_flag_cols_bits(bits: Any, table: Any, weights_m: Any, pred: Any, c_obs: float,
                           c_pred: float, floor: float, c_mag: float, safe: float, counts: Any,
                           scratch: Any, obs: Any) -> int:
    """:func:`observe_flag_cols` for a 16-bit product given as its bit patterns ``bits``
    (uint16) and ``table`` (the float32 value of each pattern); ``scratch`` is a float32
    ``(rows, n)`` workspace that holds a block of converted rows."""
    m = bits.shape[1]
    block = scratch.shape[0]
    total = 0
    for t in range(bits.shape[0]):
        obs[:, t] = 0.0
        o = fields(obs, t)
        for i0 in range(0, m, block):
            rows = min(block, m - i0)
            for i in range(rows):
                src, dst = bits[t, i0 + i], scratch[i]
                for j in range(src.shape[0]):
                    dst[j] = table[src[j]]
            sum_columns(scratch, weights_m[i0:i0 + rows], 0, rows, o)
        for j in range(counts.shape[0]):
            counts[j] = 0.0
            if not (np.isfinite(o[0][j]) and np.isfinite(o[1][j]) and np.isfinite(o[2][j])):
                for i in range(m):
                    counts[j] += not np.isfinite(table[bits[t, i, j]])
        total += _judge_columns(pred[t], o, counts, c_obs, c_pred, floor, c_mag, safe)
    return total


@numba.njit(cache=True, fastmath=FAST, inline="always")
def _row_sums_as_columns(xt: Any, c: Any, rows: Any, fields_out: Any) -> None:
    """The column sums of the matrix whose transpose is ``xt`` (``(L, r)``, C-contiguous), read
    along ``xt``'s rows: ``fields_out[f][j]`` (``(3, L)`` or three ``(L,)`` arrays) gets row
    ``j``'s sum with coefficients ``c`` (see ``sum_rows``); ``rows`` is an ``(>= L, 5)``
    workspace."""
    sum_rows(xt, c, 0, xt.shape[0], rows)
    f0, f1, f2 = fields_out[0], fields_out[1], fields_out[2]
    for j in range(xt.shape[0]):
        f0[j], f1[j], f2[j] = rows[j, 0], rows[j, 1], rows[j, 2]


@numba.njit(cache=True, inline="always")
def _judge_columns(pred: Any, obs: Any, counts: Any, c_obs: float, c_pred: float, floor: float,
                   c_mag: float, safe: float) -> int:
    """The number of flagged or unverifiable columns of one batch item (``obs``: its three
    observed field vectors; ``counts``: its non-finite elements per column)."""
    n = 0
    o0, o1, o2 = obs[0], obs[1], obs[2]
    for j in range(counts.shape[0]):
        _, flagged, ok = judge(pred[0, j], pred[1, j], pred[2, j], o0[j], o1[j], o2[j],
                               counts[j], c_obs, c_pred, floor, c_mag, safe)
        n += flagged or not ok
    return n


class CpuWorkspace:
    """Every array a planned product needs on the CPU, allocated once, and the launches that
    use them (the GEMM through ``backend``). ``counters`` (a :class:`abftgemm.plan.Counters`)
    counts both."""

    def __init__(self, backend: CpuBackend, op: Any, counters: Any,
                 thresholds: ColumnThresholds | None):
        self._backend = backend
        self._counters = counters
        batch, m, k, n = op.batch, op.m, op.k, op.n
        self._wide = op.dtype.itemsize == 2
        # 16-bit: the GEMM runs in float32 (as cuBLAS accumulates), rounded once, and the
        # prediction reads the same float32 copies of a and b (made by the GEMM, or by
        # predict() after a caller's GEMM)
        self._converted = False
        if self._wide:
            self._table = bits_table(op.dtype)
            self._a32 = self._alloc(op.a.shape, np.float32)
            self._b32 = self._alloc(op.b.shape, np.float32)
            self._buffers = (self._a32, self._b32, self._alloc((batch, m, n), np.float32),
                             self._alloc((n,), np.float32))
        else:
            self._buffers = None
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

    # The GEMM: one launch, and one more to add a bias (as on the GPU).
    def gemm(self, op: Any, c: np.ndarray, triangle: str | None = None) -> None:
        """``c = op.a @ op.b (+ op.bias)`` without allocating (``triangle``: ``a`` is zero
        outside it, see :func:`abftgemm._cpu_triangles.triangular_matmul`)."""
        self._counters.launches += 1 + (op.bias is not None)
        self._backend.gemm(op.a, op.b, c, op.bias, triangle, buffers=self._buffers)
        self._converted = self._wide

    # The two verification launches.
    def encode(self, a: np.ndarray) -> None:
        """Column encoding of ``a`` into the workspace now (a constant operand)."""
        self._counters.launches += 1
        if self._wide:
            a = as_float32(a, self._a32)
        a, a_transposed = rows_first(a)
        encode_cols(a, a_transposed, self._weights, self._rows, self._enc)

    def set_encoding(self, cols: np.ndarray) -> None:
        """Use the column encoding ``cols`` ``(3, batch or 1, k)`` handed on from elsewhere in
        the next prediction, read in place (no copy: each field vector is contiguous, as the
        prediction walks it along ``k``)."""
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
        a, a_transposed = rows_first(self._a32 if self._wide else op.a)
        b, b_transposed = rows_first(self._b32 if self._wide else op.b)
        predict_cols(a, a_transposed, b, b_transposed, self._bias64, encode_a, self._weights,
                     self._used, self._p, self._rows, self._pred)

    def observe_flag(self, c: np.ndarray) -> None:
        """Observe and judge the product's columns (launch 2)."""
        self._counters.launches += 1
        if self._wide:
            self._flagged = observe_flag_cols_bits(
                c.view(np.uint16), self._table, self._weights, self._pred, *self._coefficients,
                self._safe, self._counts, self._scratch, self._obs)
        else:
            self._flagged = observe_flag_cols(c, self._weights, self._pred, *self._coefficients,
                                              self._safe, self._counts, self._obs)

    def release(self) -> None:
        """Nothing to free beyond the arrays, which go with the workspace object."""

    def abandon(self) -> None:
        """Forget the float32 copies of a 16-bit execute that stopped before its prediction
        (each observation overwrites the verdict), and an encoding handed on to it."""
        self._converted = False
        self._given = None

    def ready_verdict(self) -> None:
        """The verdict is already in host memory."""

    def verdict_flagged(self) -> bool:
        """True when the last observation flagged a column or found one unverifiable."""
        return self._flagged > 0

    def a_encoding(self) -> np.ndarray:
        """Column encoding of ``a`` the last prediction used, ``(3, batch or 1, k)`` (the
        workspace, or the encoding handed on)."""
        return self._used

    def observed_cols(self) -> np.ndarray:
        """Observed column encoding of the last product, ``(3, batch, n)`` (the workspace)."""
        return self._obs
