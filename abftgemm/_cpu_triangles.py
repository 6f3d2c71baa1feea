"""Triangular products on the CPU (docs/design.md, "The planned product"), each under
:class:`abftgemm.threads.blas_scope` and without NumPy floating-point warnings (INF and NaN in a
product are the checks' business).
"""
from __future__ import annotations

import math

import numpy as np

from abftgemm._cpu_gemm import gemm
from abftgemm.threads import blas_scope

#: Rows per block: the fastest measured from 256 to 1024 rows (two blocks of 64 at 128 rows).
_BLOCK_ROWS = 128
#: Rows per block below 256 rows; a product of at most this many rows stays whole.
_SMALL_BLOCK_ROWS = 64


def triangle_blocks(m: int) -> list[tuple[int, int]]:
    """Even row blocks ``[lo, hi)`` of an ``m``-row triangular product, at most the size above."""
    size = _SMALL_BLOCK_ROWS if m < 2 * _BLOCK_ROWS else _BLOCK_ROWS
    blocks = max(1, -(-m // size))
    step = max(1, -(-m // blocks))
    return [(lo, min(m, lo + step)) for lo in range(0, m, step)]


@np.errstate(all="ignore")
def triangular_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray,
                      triangle: str | None) -> None:
    """``out = a @ b`` for ``a`` (batch or 1, m, k) that is zero outside ``triangle``
    (``"lower"``: for ``j > i``; ``"upper"``: for ``j < i``; None: a whole product), never
    reading those zeros."""
    m, k = a.shape[-2], a.shape[-1]
    blocks = triangle_blocks(m) if triangle is not None else [(0, m)]
    with blas_scope():
        if len(blocks) == 1:
            _matmul(a, b, out)
            return
        for lo, hi in blocks:
            cols = slice(0, min(hi, k)) if triangle == "lower" else slice(min(lo, k), k)
            np.matmul(a[..., lo:hi, cols], b[..., cols, :], out=out[..., lo:hi, :])


def _matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``np.matmul(a, b, out=out)``, as one 2-D product (:func:`abftgemm._cpu_gemm.gemm`) when
    it is one, or when every batch item of ``a`` shares one ``b`` and ``a`` and ``out`` are
    stacks of rows: one large GEMM threads where NumPy's loop of small ones cannot."""
    shared_b = b.ndim == 2 or (b.ndim == 3 and b.shape[0] == 1)
    if a.ndim == out.ndim == 3 and a.shape[0] > 1 and shared_b and _stacked_rows(a) \
            and _stacked_rows(out):
        gemm(_as_rows(a), b.reshape(b.shape[-2:]), _as_rows(out))
    elif _one_matrix(a) and _one_matrix(b) and _one_matrix(out):
        gemm(a.reshape(a.shape[-2:]), b.reshape(b.shape[-2:]), out.reshape(out.shape[-2:]))
    else:
        np.matmul(a, b, out=out)


def _one_matrix(x: np.ndarray) -> bool:
    """Whether every axis of ``x`` before the last two has length 1."""
    return math.prod(x.shape[:-2]) == 1


def _as_rows(x: np.ndarray) -> np.ndarray:
    """``x`` (batch, m, n), a stack of rows, as the ``(batch * m, n)`` matrix it views."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2])


def _stacked_rows(x: np.ndarray) -> bool:
    """Whether ``x`` (batch, m, n) views a ``(batch * m, n)`` matrix."""
    return x.strides[0] == x.shape[1] * x.strides[1]


def row_limits(m: int, n: int) -> np.ndarray:
    """How many leading columns of each of the ``m`` rows :func:`lower_product` computes, (m,)
    int64: every column of the row's block and the blocks before it, at least ``j <= i``."""
    limits = np.empty(m, np.int64)
    for lo, hi in triangle_blocks(m):
        limits[lo:hi] = min(hi, n)
    return limits


@np.errstate(all="ignore")
def lower_product(a: np.ndarray, b: np.ndarray, out: np.ndarray, rest: bool = False) -> None:
    """``out = a @ b`` in columns ``j < row_limits(m, n)[i]`` of each row ``i`` only (the rest
    is left as it was); with ``rest``, in the columns it left out, completing ``a @ b``."""
    m, n = out.shape[-2], out.shape[-1]
    with blas_scope():
        for lo, hi in triangle_blocks(m):
            cols = slice(min(hi, n), n) if rest else slice(0, min(hi, n))
            if cols.start < cols.stop:
                np.matmul(a[..., lo:hi, :], b[..., :, cols], out=out[..., lo:hi, cols])
