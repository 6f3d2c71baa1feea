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


@numba.njit(parallel=True, cache=True)
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
            c0, c1, c2 = coef[cb, i, 0], coef[cb, i, 1], coef[cb, i, 2]
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


@numba.njit(parallel=True, cache=True)
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
        c = coef[cb]
        for i in range(i0, i1):
            row = x[xb, i]
            s0 = 0.0
            s1 = 0.0
            s2 = 0.0
            for j in range(ncols):
                v = np.float64(row[j])
                s0 += c[j, 0] * v
                s1 += c[j, 1] * v
                s2 += c[j, 2] * abs(v)
            o = out[b, i]
            o[0], o[1], o[2], o[3], o[4] = s0, s1, s2, 0.0, -1.0
            if not (np.isfinite(s0) and np.isfinite(s1) and np.isfinite(s2)):
                _scan(row, o)


@lru_cache(maxsize=64)
def _default_coef(length: int) -> np.ndarray:
    """``[1, (l+1)/length, 1]`` per position: plain sum, location-weighted sum, absolute sum."""
    coef = np.ones((1, length, 3))
    coef[0, :, 1] = location_weights(length)
    coef.setflags(write=False)
    return coef


def _kernel_view(x: np.ndarray) -> np.ndarray:
    """float32/float64 data as is (any strides); 16-bit data upcast to float32."""
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


class CpuBackend:
    """NumPy + numba implementation of :class:`abftgemm.backend.Backend`."""

    name = "numpy"
    xp = np

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
        _col_reduce(_kernel_view(x), _default_coef(x.shape[1]) if coef is None else coef, out)

    def row_reduce(self, x: np.ndarray, coef: np.ndarray | None, out: np.ndarray) -> None:
        _row_reduce(_kernel_view(x), _default_coef(x.shape[2]) if coef is None else coef, out)


@lru_cache(maxsize=1)
def backend() -> CpuBackend:
    """The process-wide CPU backend."""
    return CpuBackend()
