"""One 2-D GEMM on the CPU, split by rows over numba's pool instead of the BLAS's own threads
where a ``blas_scope(numba_pool=True)`` asks for it (docs/design.md, "The planned product"):
each row block one call of :func:`abftgemm.cpu_kernels.blas_gemm` on the operands as they lie.
"""
from __future__ import annotations

import numba
import numpy as np

from abftgemm.cpu_kernels import blas_gemm, rows_readable
from abftgemm.threads import (numba_pool_usable, numba_threads, one_blas_thread, scope_pool,
                              scope_threads)

#: ``m n k`` above which a product runs split over the pool: from there on OpenBLAS threads it
#: (its ``GEMM_MULTITHREAD_THRESHOLD``).
POOL_MIN_WORK = 1 << 18
#: Rows each thread gets at least; fewer threads when the product has fewer rows.
POOL_MIN_ROWS = 16


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a @ b`` for 2-D operands at the open :class:`abftgemm.threads.blas_scope`'s
    thread count, in numba's pool where that scope asks for it."""
    m, k = a.shape
    n = b.shape[1]
    threads = min(scope_threads(), numba.config.NUMBA_NUM_THREADS, m // POOL_MIN_ROWS) \
        if scope_pool() and numba_pool_usable() else 1
    if threads < 2 or m * n * k <= POOL_MIN_WORK or not _pool_takes(a, b, out):
        np.matmul(a, b, out=out)
        return
    numba_threads(threads)
    trans_a, trans_b = not rows_readable(a), not rows_readable(b)  # (else their transposes)
    with one_blas_thread():
        _row_blocks(a.T if trans_a else a, trans_a, b.T if trans_b else b, trans_b, out,
                    -(-m // threads))


def _pool_takes(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """Whether :func:`blas_gemm` takes the operands as they are: rows or columns of ``a`` and
    ``b`` contiguous, ``out`` C-contiguous and apart from them (an ``out`` that overlaps ``a`` or
    ``b`` would be read after BLAS wrote it; ``np.matmul`` buffers it)."""
    return (a.dtype == b.dtype == out.dtype and a.dtype in (np.float32, np.float64)
            and out.flags.c_contiguous
            and all(rows_readable(x) or rows_readable(x.T) for x in (a, b))
            and not np.may_share_memory(out, a) and not np.may_share_memory(out, b))


@numba.njit(parallel=True, cache=True, nogil=True)
def _row_blocks(a, trans_a, b, trans_b, out, step):  # pragma: no cover (compiled)
    """``out[lo:hi] = op(a)[lo:hi] @ op(b)`` for row blocks of ``step`` rows, one per thread."""
    m = out.shape[0]
    for block in numba.prange(-(-m // step)):
        lo = block * step
        hi = min(m, lo + step)
        blas_gemm(a[:, lo:hi] if trans_a else a[lo:hi], b, out[lo:hi], 0.0, trans_a, trans_b,
                  hi - lo)
