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
_COL_BLOCK = 256  # columns per task: long enough to vectorize, short enough to balance threads
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


def _col_reduce(x: Any, coef: Any, out: Any) -> None:
    batch, ncols = out.shape[0], out.shape[1]
    nrows = x.shape[1]
    nblocks = (ncols + _COL_BLOCK - 1) // _COL_BLOCK
    for task in prange(batch * nblocks):
        b = task // nblocks
        j0 = (task % nblocks) * _COL_BLOCK
        j1 = min(j0 + _COL_BLOCK, ncols)
        xb = b if x.shape[0] > 1 else 0
        cb = b if coef.shape[0] > 1 else 0
        s0 = np.zeros(j1 - j0)
        s1 = np.zeros(j1 - j0)
        s2 = np.zeros(j1 - j0)
        for i in range(nrows):
            c0, c1, c2 = coef[cb, 0, i], coef[cb, 1, i], coef[cb, 2, i]
            row = x[xb, i, j0:j1]
            for j in range(j1 - j0):
                v = np.float64(row[j])
                s0[j] += c0 * v
                s1[j] += c1 * v
                s2[j] += c2 * abs(v)
        for j in range(j1 - j0):
            o = out[b, j0 + j]
            o[0], o[1], o[2], o[3], o[4] = s0[j], s1[j], s2[j], 0.0, -1.0
            if not (np.isfinite(s0[j]) and np.isfinite(s1[j]) and np.isfinite(s2[j])):
                _scan(x[xb, :, j0 + j], o)


def _row_reduce(x: Any, coef: Any, out: Any) -> None:
    batch, nrows = out.shape[0], out.shape[1]
    ncols = x.shape[2]
    nblocks = (nrows + _ROW_BLOCK - 1) // _ROW_BLOCK
    for task in prange(batch * nblocks):
        b = task // nblocks
        i0 = (task % nblocks) * _ROW_BLOCK
        i1 = min(i0 + _ROW_BLOCK, nrows)
        xb = b if x.shape[0] > 1 else 0
        cb = b if coef.shape[0] > 1 else 0
        c0, c1, c2 = coef[cb, 0], coef[cb, 1], coef[cb, 2]
        for i in range(i0, i1):
            row = x[xb, i]
            s0 = 0.0
            s1 = 0.0
            s2 = 0.0
            for j in range(ncols):
                v = np.float64(row[j])
                s0 += c0[j] * v
                s1 += c1[j] * v
                s2 += c2[j] * abs(v)
            o = out[b, i]
            o[0], o[1], o[2], o[3], o[4] = s0, s1, s2, 0.0, -1.0
            if not (np.isfinite(s0) and np.isfinite(s1) and np.isfinite(s2)):
                _scan(row, o)


def _both_reduce(x: Any, ccoef: Any, rcoef: Any, out_col: Any, out_row: Any, partial: Any) -> None:
    """Column and row reductions in one read of ``x``.

    ``ccoef``/``rcoef`` are ``(batch or 1, 3, L)`` (coefficient-major, so the inner loop reads
    them contiguously). ``partial`` is ``(batch, blocks, 3, ncols)`` scratch: each row block sums
    its columns there, and the blocks are added up at the end.
    """
    batch, ncols = out_col.shape[0], out_col.shape[1]
    nrows = x.shape[1]
    blocks = partial.shape[1]
    rows_per = (nrows + blocks - 1) // blocks
    for task in prange(batch * blocks):
        b = task // blocks
        i0 = (task % blocks) * rows_per
        i1 = min(i0 + rows_per, nrows)
        xb = b if x.shape[0] > 1 else 0
        cc = ccoef[b if ccoef.shape[0] > 1 else 0]
        rc = rcoef[b if rcoef.shape[0] > 1 else 0]
        p0, p1, p2 = partial[b, task % blocks, 0], partial[b, task % blocks, 1], partial[b, task % blocks, 2]
        p0[:] = 0.0
        p1[:] = 0.0
        p2[:] = 0.0
        r0, r1, r2 = rc[0], rc[1], rc[2]
        for i in range(i0, i1):
            row = x[xb, i]
            c0, c1, c2 = cc[0, i], cc[1, i], cc[2, i]
            s0 = 0.0
            s1 = 0.0
            s2 = 0.0
            for j in range(ncols):
                v = np.float64(row[j])
                a = abs(v)
                s0 += r0[j] * v
                s1 += r1[j] * v
                s2 += r2[j] * a
                p0[j] += c0 * v
                p1[j] += c1 * v
                p2[j] += c2 * a
            o = out_row[b, i]
            o[0], o[1], o[2], o[3], o[4] = s0, s1, s2, 0.0, -1.0
            if not (np.isfinite(s0) and np.isfinite(s1) and np.isfinite(s2)):
                _scan(row, o)
    _combine_columns(x, partial, out_col)


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
        c_obs, c_pred, floor = coefficients
        tau = c_obs * obs[..., 2] + c_pred * pred[..., 2] + floor
        verifiable = np.isfinite(pred[..., :3]).all(-1)
        diff = pred[..., :2] - obs[..., :2]
        # A non-finite element, or finite ones whose sums overflow, make the observed |C| sum and
        # so tau infinite: with finite predictions that is a fault on its own.
        within = ((np.abs(diff[..., 0]) <= tau) & (np.abs(diff[..., 1]) <= tau)
                  & np.isfinite(obs[..., 2]) & (obs[..., 3] == 0))
        bad = verifiable & ~within
        counts += (bad.sum(), (~verifiable).sum())
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
        _col_reduce_kernel(_kernel_view(x), _coef_major(coef, x.shape[1]), out)

    def row_reduce(self, x: np.ndarray, coef: np.ndarray | None, out: np.ndarray) -> None:
        _row_reduce_kernel(_kernel_view(x), _coef_major(coef, x.shape[2]), out)

    def both_reduce(self, x: np.ndarray, col_coef: np.ndarray | None,
                    row_coef: np.ndarray | None, out_col: np.ndarray, out_row: np.ndarray) -> None:
        nrows, ncols = x.shape[1:]
        threads = numba.get_num_threads() if x.size >= PARALLEL_MIN_ELEMENTS else 1
        blocks = max(1, min(threads, nrows // _ROW_BLOCK))
        partial = np.empty((out_col.shape[0], blocks, 3, ncols))
        _both_reduce_kernel(_kernel_view(x), _coef_major(col_coef, nrows), _coef_major(row_coef, ncols),
                     out_col, out_row, partial)


@lru_cache(maxsize=1)
def backend() -> CpuBackend:
    """The process-wide CPU backend."""
    return CpuBackend()
