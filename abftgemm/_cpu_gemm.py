"""One 2-D GEMM on the CPU, its threads in numba's pool instead of the BLAS's own.

The fused attention core runs in numba's thread pool. A product that NumPy's BLAS (OpenBLAS)
spreads over its own threads leaves those threads spinning for a while after it returns, on the
cores numba's threads need next, and the core ran slower right after the layer's projections
than alone (bench/NOTES.md). So in the passes that run the fused core
(``blas_scope(numba_pool=True)``) a product large enough for the BLAS to thread is cut into one
row block per thread of the library's policy, each block one single-threaded BLAS call (SciPy's,
through numba's ``np.dot``) from a thread of numba's pool: one pool for the whole pass, at the
speed of the BLAS's own threads (bench/NOTES.md). Elsewhere the BLAS keeps its threads, since a
caller's own NumPy products next to ours would meet the same contention the other way round.
Smaller products, one thread, a process that cannot enter numba's pool
(:func:`abftgemm.threads.numba_pool_usable`), and what numba's ``np.dot`` cannot take (16-bit,
mixed dtypes, strided or overlapping operands) go to ``np.matmul``.
"""
from __future__ import annotations

import numba
import numpy as np

from abftgemm.threads import (numba_pool_usable, numba_threads, one_blas_thread, scope_pool,
                              scope_threads)

#: ``m n k`` above which a product runs split over the pool: OpenBLAS threads a GEMM from
#: ``m n k > 2^18`` on (its ``GEMM_MULTITHREAD_THRESHOLD``), so no product it would thread is
#: left to it.
POOL_MIN_WORK = 1 << 18
#: Rows each thread gets at least; fewer threads when the product has fewer rows.
POOL_MIN_ROWS = 16


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a @ b`` for 2-D ``a`` (m, k), ``b`` (k, n), ``out`` (m, n), at the thread count
    of the open :class:`abftgemm.threads.blas_scope`, in numba's pool where that scope asks for
    it (``numba_pool=True``)."""
    m, k = a.shape
    n = b.shape[1]
    threads = min(scope_threads(), numba.config.NUMBA_NUM_THREADS, m // POOL_MIN_ROWS) \
        if scope_pool() and numba_pool_usable() else 1
    if threads < 2 or m * n * k <= POOL_MIN_WORK or not _pool_takes(a, b, out):
        np.matmul(a, b, out=out)
        return
    numba_threads(threads)
    with one_blas_thread():
        _row_blocks(a, b, out, -(-m // threads))


def _pool_takes(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """Whether numba's ``np.dot`` takes the operands as they are: float32 or float64 alike,
    ``out`` C-contiguous and apart from ``a`` and ``b`` (``np.matmul`` buffers an overlap; BLAS
    would read what it wrote), ``a`` and ``b`` contiguous either way."""
    return (a.dtype == b.dtype == out.dtype and a.dtype in (np.float32, np.float64)
            and out.flags.c_contiguous and _contiguous(a) and _contiguous(b)
            and not np.may_share_memory(out, a) and not np.may_share_memory(out, b))


def _contiguous(x: np.ndarray) -> bool:
    return x.flags.c_contiguous or x.flags.f_contiguous


@numba.njit(parallel=True, cache=True, nogil=True)
def _row_blocks(a, b, out, step):  # pragma: no cover (compiled)
    """``out[lo:hi] = a[lo:hi] @ b`` for row blocks of ``step`` rows, one per thread (a block of
    a column-major ``a`` is copied first: numba's ``np.dot`` takes contiguous blocks)."""
    m = a.shape[0]
    for block in numba.prange(-(-m // step)):
        lo = block * step
        hi = min(m, lo + step)
        np.dot(np.ascontiguousarray(a[lo:hi]), b, out[lo:hi])
