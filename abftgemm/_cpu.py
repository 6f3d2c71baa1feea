"""CPU backend: NumPy GEMM plus numba kernels that reduce a matrix to checksums in one pass.

The numba kernels are compiled on first use and cached on disk (``cache=True``), so a new process
does not recompile them. 16-bit data is upcast to float32 before the kernels (numba has no
float16/bfloat16 arithmetic); the GEMM itself accumulates in float32 for 16-bit inputs.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import numba
import numpy as np
from numba import prange

from abftgemm.checksums import location_weights

#: Let LLVM reorder and fuse the float64 sums so they vectorize. Not ``fastmath=True``: that also
#: assumes no NaN/INF and would break the non-finite checks. Reordering is covered by the float64
#: checksum term of the threshold, which bounds any summation order.
_FAST = {"reassoc", "contract"}
_ROW_BLOCK = 64


@numba.njit(cache=True, inline="always")
def _scan(v: Any, out: Any) -> None:
    """Count the non-finite elements of ``v`` and record the last one's index."""
    count = 0
    last = -1
    for l in range(v.shape[0]):
        if not np.isfinite(v[l]):
            count += 1
            last = l
    out[3] = count
    out[4] = last


# The kernels sweep the matrix row by row (one sequential read) and handle four rows per step:
# column sums live in float64 arrays of the row's length, and updating them once per four rows
# instead of once per row cut a 2048x2048 column reduction from 0.85 to 0.32 ms.


def _col_reduce(x: Any, coef: Any, out: Any, partial: Any) -> None:
    """Column reduction: ``partial`` is ``(batch, blocks, 3, ncols)`` scratch, one per row block."""
    nrows = x.shape[1]
    blocks = partial.shape[1]
    rows_per = (nrows + blocks - 1) // blocks
    for task in prange(out.shape[0] * blocks):
        b, k = task // blocks, task % blocks
        i0, i1 = k * rows_per, min(k * rows_per + rows_per, nrows)
        _sum_columns(x[min(b, x.shape[0] - 1)], coef[min(b, coef.shape[0] - 1)], i0, i1,
                     partial[b, k], True)
    _combine_columns(x, partial, out)


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _sum_columns(x: Any, c: Any, i0: int, i1: int, p: Any, zero: bool) -> None:
    """``p[f, j] (=, or += unless zero) sum over rows i0..i1 of c[f, i] * x[i, j]`` (``|x|`` for
    f = 2)."""
    p0, p1, p2 = p[0], p[1], p[2]
    if zero:
        p[:] = 0.0
    i = i0
    while i + 4 <= i1:
        r0, r1, r2, r3 = x[i], x[i + 1], x[i + 2], x[i + 3]
        a0, a1, a2, a3 = c[0, i], c[0, i + 1], c[0, i + 2], c[0, i + 3]
        w0, w1, w2, w3 = c[1, i], c[1, i + 1], c[1, i + 2], c[1, i + 3]
        g0, g1, g2, g3 = c[2, i], c[2, i + 1], c[2, i + 2], c[2, i + 3]
        for j in range(p0.shape[0]):
            v0, v1 = np.float64(r0[j]), np.float64(r1[j])
            v2, v3 = np.float64(r2[j]), np.float64(r3[j])
            p0[j] += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3
            p1[j] += w0 * v0 + w1 * v1 + w2 * v2 + w3 * v3
            p2[j] += g0 * abs(v0) + g1 * abs(v1) + g2 * abs(v2) + g3 * abs(v3)
        i += 4
    while i < i1:
        r0 = x[i]
        a0, w0, g0 = c[0, i], c[1, i], c[2, i]
        for j in range(p0.shape[0]):
            v0 = np.float64(r0[j])
            p0[j] += a0 * v0
            p1[j] += w0 * v0
            p2[j] += g0 * abs(v0)
        i += 1


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _sum_row(row: Any, c0: Any, c1: Any, c2: Any, o: Any) -> None:
    """``o = [sum c0*row, sum c1*row, sum c2*|row|, non-finite count, last non-finite index]``."""
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    for j in range(row.shape[0]):
        v = np.float64(row[j])
        s0 += c0[j] * v
        s1 += c1[j] * v
        s2 += c2[j] * abs(v)
    _store(row, s0, s1, s2, o)


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _sum_rows(x: Any, c: Any, i0: int, i1: int, out: Any) -> None:
    """:func:`_sum_row` for rows ``i0..i1``, four at a time (each weight read once per four)."""
    c0, c1, c2 = c[0], c[1], c[2]
    i = i0
    while i + 4 <= i1:
        r0, r1, r2, r3 = x[i], x[i + 1], x[i + 2], x[i + 3]
        s00 = s01 = s02 = s10 = s11 = s12 = 0.0
        s20 = s21 = s22 = s30 = s31 = s32 = 0.0
        for j in range(r0.shape[0]):
            a, w, g = c0[j], c1[j], c2[j]
            v0, v1 = np.float64(r0[j]), np.float64(r1[j])
            v2, v3 = np.float64(r2[j]), np.float64(r3[j])
            s00 += a * v0
            s01 += w * v0
            s02 += g * abs(v0)
            s10 += a * v1
            s11 += w * v1
            s12 += g * abs(v1)
            s20 += a * v2
            s21 += w * v2
            s22 += g * abs(v2)
            s30 += a * v3
            s31 += w * v3
            s32 += g * abs(v3)
        _store(r0, s00, s01, s02, out[i])
        _store(r1, s10, s11, s12, out[i + 1])
        _store(r2, s20, s21, s22, out[i + 2])
        _store(r3, s30, s31, s32, out[i + 3])
        i += 4
    while i < i1:
        _sum_row(x[i], c0, c1, c2, out[i])
        i += 1


@numba.njit(cache=True, inline="always")
def _store(row: Any, s0: float, s1: float, s2: float, o: Any) -> None:
    """Write one vector's sums; count its non-finite elements only when a sum is not finite."""
    o[0], o[1], o[2], o[3], o[4] = s0, s1, s2, 0.0, -1.0
    if not (np.isfinite(s0) and np.isfinite(s1) and np.isfinite(s2)):
        _scan(row, o)


def _row_reduce(x: Any, coef: Any, out: Any) -> None:
    batch, nrows = out.shape[0], out.shape[1]
    nblocks = (nrows + _ROW_BLOCK - 1) // _ROW_BLOCK
    for task in prange(batch * nblocks):
        b = task // nblocks
        i0 = (task % nblocks) * _ROW_BLOCK
        _sum_rows(x[min(b, x.shape[0] - 1)], coef[min(b, coef.shape[0] - 1)], i0,
                  min(i0 + _ROW_BLOCK, nrows), out[b])


def _both_reduce(x: Any, ccoef: Any, rcoef: Any, out_col: Any, out_row: Any, partial: Any) -> None:
    """Column and row reductions in one read of ``x``.

    ``ccoef``/``rcoef`` are ``(batch or 1, 3, L)`` (coefficient-major, so the inner loops read
    them contiguously). ``partial`` is ``(batch, blocks, 3, ncols)`` scratch: each row block sums
    its columns there, and the blocks are added up at the end. Four rows at a time feed both the
    column sums and their own row sums from one load.
    """
    nrows = x.shape[1]
    blocks = partial.shape[1]
    rows_per = (nrows + blocks - 1) // blocks
    for task in prange(out_col.shape[0] * blocks):
        b, k = task // blocks, task % blocks
        i0, i1 = k * rows_per, min(k * rows_per + rows_per, nrows)
        xb = x[min(b, x.shape[0] - 1)]
        cc = ccoef[min(b, ccoef.shape[0] - 1)]
        rc = rcoef[min(b, rcoef.shape[0] - 1)]
        p = partial[b, k]
        p[:] = 0.0
        i = i0
        while i + 4 <= i1:
            _four_rows_both(xb, cc, rc, i, p, out_row[b])
            i += 4
        if i < i1:
            _sum_columns(xb, cc, i, i1, p, False)
            _sum_rows(xb, rc, i, i1, out_row[b])
    _combine_columns(x, partial, out_col)


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _four_rows_both(x: Any, cc: Any, rc: Any, i: int, p: Any, out: Any) -> None:
    """Rows ``i..i+3``: add them into the column sums ``p`` and write their own row sums."""
    r0, r1, r2, r3 = x[i], x[i + 1], x[i + 2], x[i + 3]
    a0, a1, a2, a3 = cc[0, i], cc[0, i + 1], cc[0, i + 2], cc[0, i + 3]
    w0, w1, w2, w3 = cc[1, i], cc[1, i + 1], cc[1, i + 2], cc[1, i + 3]
    g0, g1, g2, g3 = cc[2, i], cc[2, i + 1], cc[2, i + 2], cc[2, i + 3]
    c0, c1, c2 = rc[0], rc[1], rc[2]
    p0, p1, p2 = p[0], p[1], p[2]
    s00 = s01 = s02 = s10 = s11 = s12 = 0.0
    s20 = s21 = s22 = s30 = s31 = s32 = 0.0
    for j in range(r0.shape[0]):
        v0, v1 = np.float64(r0[j]), np.float64(r1[j])
        v2, v3 = np.float64(r2[j]), np.float64(r3[j])
        b0, b1, b2, b3 = abs(v0), abs(v1), abs(v2), abs(v3)
        p0[j] += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3
        p1[j] += w0 * v0 + w1 * v1 + w2 * v2 + w3 * v3
        p2[j] += g0 * b0 + g1 * b1 + g2 * b2 + g3 * b3
        e, f, h = c0[j], c1[j], c2[j]
        s00 += e * v0
        s01 += f * v0
        s02 += h * b0
        s10 += e * v1
        s11 += f * v1
        s12 += h * b1
        s20 += e * v2
        s21 += f * v2
        s22 += h * b2
        s30 += e * v3
        s31 += f * v3
        s32 += h * b3
    _store(r0, s00, s01, s02, out[i])
    _store(r1, s10, s11, s12, out[i + 1])
    _store(r2, s20, s21, s22, out[i + 2])
    _store(r3, s30, s31, s32, out[i + 3])


@numba.njit(cache=True)
def _combine_columns(x: Any, partial: Any, out_col: Any) -> None:
    """Add up the row blocks' column sums of :func:`_both_reduce`."""
    batch, ncols = out_col.shape[0], out_col.shape[1]
    for b in range(batch):
        xb = min(b, x.shape[0] - 1)
        for j in range(ncols):
            t0 = 0.0
            t1 = 0.0
            t2 = 0.0
            for k in range(partial.shape[1]):
                t0 += partial[b, k, 0, j]
                t1 += partial[b, k, 1, j]
                t2 += partial[b, k, 2, j]
            o = out_col[b, j]
            o[0], o[1], o[2], o[3], o[4] = t0, t1, t2, 0.0, -1.0
            if not (np.isfinite(t0) and np.isfinite(t1) and np.isfinite(t2)):
                _scan(x[xb, :, j], o)


@numba.njit(cache=True)
def _flag(pred: Any, obs: Any, c_obs: float, c_pred: float, floor: float, tau: Any, bad: Any,
          verifiable: Any, counts: Any) -> None:
    """Threshold, verifiability and disagreement of every vector (see backend.py ``flag``)."""
    for i in range(pred.shape[0]):
        p, o = pred[i], obs[i]
        t = c_obs * o[2] + c_pred * p[2] + floor
        ok = np.isfinite(p[0]) and np.isfinite(p[1]) and np.isfinite(p[2])
        # A non-finite element, or finite ones whose sums overflow, make the observed |C| sum
        # and so tau infinite: with finite predictions that is a fault on its own.
        within = (abs(p[0] - o[0]) <= t and abs(p[1] - o[1]) <= t and np.isfinite(o[2])
                  and o[3] == 0)
        tau[i] = t
        verifiable[i] = ok
        bad[i] = ok and not within
        counts[0] += ok and not within
        counts[1] += not ok


class _Kernel:
    """One kernel compiled twice: threaded for large inputs, serial for small ones.

    Small reductions finish before threads can be woken, and right after a GEMM the BLAS threads
    still spin on the cores numba would use: on 2 cores the serial build was faster up to
    2048x2048 (8.0 vs 9.9 ms of checks at 2048^3). Below ``PARALLEL_MIN_ELEMENTS`` the serial build
    (``prange`` runs as ``range``) is used.
    """

    def __init__(self, fn: Any):
        self.parallel = numba.njit(parallel=True, cache=True, fastmath=_FAST)(fn)
        self.serial = numba.njit(cache=True, fastmath=_FAST)(fn)

    def __call__(self, x: np.ndarray, *args: Any) -> None:
        run = self.parallel if x.size >= PARALLEL_MIN_ELEMENTS else self.serial
        run(x, *args)


PARALLEL_MIN_ELEMENTS = 1 << 24
_col_reduce_kernel = _Kernel(_col_reduce)
_row_reduce_kernel = _Kernel(_row_reduce)
_both_reduce_kernel = _Kernel(_both_reduce)


@lru_cache(maxsize=64)
def _default_coef(length: int) -> np.ndarray:
    """``(1, 3, length)``: weights of the plain sum, the location-weighted sum, the absolute sum."""
    coef = np.ones((1, 3, length))
    coef[0, 1] = location_weights(length)
    coef.setflags(write=False)
    return coef


def _coef_major(coef: np.ndarray | None, length: int) -> np.ndarray:
    """Coefficients ``(batch or 1, length, 3)`` as a contiguous ``(batch or 1, 3, length)`` array,
    so the kernels' inner loops read each weight vector contiguously."""
    if coef is None:
        return _default_coef(length)
    return np.ascontiguousarray(coef.transpose(0, 2, 1))


def _kernel_view(x: np.ndarray) -> np.ndarray:
    """float32/float64 data as is (any strides); 16-bit data upcast to float32."""
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


class CpuBackend:
    """NumPy + numba implementation of :class:`abftgemm.backend.Backend`."""

    name = "numpy"
    xp = np

    def flag(self, pred: np.ndarray, obs: np.ndarray, coefficients: tuple[float, float, float],
             counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        shape = pred.shape[:-1]
        tau, bad, verifiable = np.empty(shape), np.empty(shape, bool), np.empty(shape, bool)
        _flag(pred.reshape(-1, 5), obs.reshape(-1, 5), *coefficients, tau.reshape(-1),
              bad.reshape(-1), verifiable.reshape(-1), counts)
        return tau, bad, verifiable

    def gemm(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None) -> None:
        if a.dtype in (np.float32, np.float64):
            np.matmul(a, b, out=out)
            if bias is not None:
                out += bias
            return
        # 16-bit: accumulate in float32 (as cuBLAS does with compute type 32F), round once.
        acc = np.matmul(a.astype(np.float32), b.astype(np.float32))
        if bias is not None:
            acc += bias.astype(np.float32)
        out[...] = acc

    def col_reduce(self, x: np.ndarray, coef: np.ndarray | None, out: np.ndarray) -> None:
        _col_reduce_kernel(_kernel_view(x), _coef_major(coef, x.shape[1]), out,
                           _partial(x, out))

    def row_reduce(self, x: np.ndarray, coef: np.ndarray | None, out: np.ndarray) -> None:
        _row_reduce_kernel(_kernel_view(x), _coef_major(coef, x.shape[2]), out)

    def both_reduce(self, x: np.ndarray, col_coef: np.ndarray | None,
                    row_coef: np.ndarray | None, out_col: np.ndarray, out_row: np.ndarray) -> None:
        nrows, ncols = x.shape[1:]
        _both_reduce_kernel(_kernel_view(x), _coef_major(col_coef, nrows),
                            _coef_major(row_coef, ncols), out_col, out_row, _partial(x, out_col))


def _partial(x: np.ndarray, out_col: np.ndarray) -> np.ndarray:
    """Scratch for the column sums of each row block: one block per thread that will run."""
    threads = numba.get_num_threads() if x.size >= PARALLEL_MIN_ELEMENTS else 1
    blocks = max(1, min(threads, x.shape[1] // _ROW_BLOCK))
    return np.empty((out_col.shape[0], blocks, 3, x.shape[2]))


@lru_cache(maxsize=1)
def backend() -> CpuBackend:
    """The process-wide CPU backend."""
    return CpuBackend()
