"""GEMMs on the CPU through BLAS, from Python and from numba: :func:`blas_gemm`, ``c = op(a) @
op(b) + beta c`` on strided views in place (numba), and :func:`gemm`, one 2-D product split by
rows over numba's pool instead of the BLAS's own threads where a ``blas_scope(numba_pool=True)``
asks for it (docs/design.md, "The planned product").

numba's ``np.dot`` takes contiguous operands only and overwrites its output, so a transposed or
strided operand needed a copy, an accumulator a buffer and a pass of its own. :func:`blas_gemm`
calls the BLAS numba's ``np.dot`` calls (SciPy's, through numba's ``numba_xxgemm``) with the
views' leading dimensions, transposes and ``beta``.
"""
from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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
    trans_a, trans_b = not _rows_contiguous(a), not _rows_contiguous(b)
    with one_blas_thread():
        _row_blocks(a.T if trans_a else a, trans_a, b.T if trans_b else b, trans_b, out,
                    -(-m // threads))


def _rows_contiguous(x: np.ndarray) -> bool:
    """Whether the 2-D ``x``'s rows are contiguous and apart by at least their length, in
    order (else its columns are, :func:`_pool_takes` said)."""
    item = x.itemsize
    return x.shape[1] < 2 or x.strides[1] == item and (x.shape[0] < 2
                                                       or x.strides[0] >= x.shape[1] * item)


def _pool_takes(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """Whether :func:`blas_gemm` takes the operands as they are: rows or columns of ``a`` and
    ``b`` contiguous, ``out`` C-contiguous and apart from them (an ``out`` that overlaps ``a`` or
    ``b`` would be read after BLAS wrote it; ``np.matmul`` buffers it)."""
    return (a.dtype == b.dtype == out.dtype and a.dtype in (np.float32, np.float64)
            and out.flags.c_contiguous
            and all(_rows_contiguous(x) or _rows_contiguous(x.T) for x in (a, b))
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


@intrinsic
def _xxgemm(typingctx: Any, trans_a: Any, trans_b: Any, m: Any, n: Any, k: Any, alpha: Any,
            a: Any, lda: Any, b: Any, ldb: Any, beta: Any, c: Any, ldc: Any) -> Any:
    """Column-major ``C (m x n) = alpha op(A) op(B) + beta C`` (each ``op`` by its flag,
    ``ord('n')`` or ``ord('t')``) through numba's ``numba_xxgemm``; returns its status
    (negative: no BLAS)."""
    sig = types.int32(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        char, intp = ir.IntType(8), context.get_value_type(types.intp)
        void_p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [char, char, char, intp, intp, intp, void_p,
                                                void_p, intp, void_p, intp, void_p, void_p,
                                                intp])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
        dtype = signature.args[6].dtype
        kind = ir.Constant(char, ord("s" if dtype == types.float32 else "d"))

        def size(i: int) -> Any:
            return context.cast(builder, args[i], signature.args[i], types.intp)

        def flag(i: int) -> Any:
            return builder.trunc(size(i), char)

        def slot(i: int) -> Any:
            value = context.cast(builder, args[i], signature.args[i], dtype)
            return builder.bitcast(cgutils.alloca_once_value(builder, value), void_p)

        def data(i: int) -> Any:
            array = context.make_array(signature.args[i])(context, builder, args[i])
            return builder.bitcast(array.data, void_p)

        return builder.call(fn, (kind, flag(0), flag(1), size(2), size(3), size(4), slot(5),
                                 data(6), size(7), data(8), size(9), slot(10), data(11),
                                 size(12)))

    return sig, codegen


@numba.njit(cache=True)
def _leading(x: Any, cols: int) -> int:
    """The leading dimension of the row-major 2-D view ``x`` (``cols`` wide): its rows must be
    contiguous and apart by at least their length, in order."""
    item = x.itemsize
    if x.shape[0] > 1 and x.shape[1] > 1 and x.strides[1] != item:
        raise ValueError("gemm: an operand's rows are not contiguous")
    if x.shape[0] > 1 and x.strides[0] < x.shape[1] * item:
        raise ValueError("gemm: an operand's rows overlap or run backwards")
    return max(x.strides[0] // item, cols, 1)


@numba.njit(cache=True)
def blas_gemm(a: Any, b: Any, c: Any, beta: float, trans_a: bool, trans_b: bool, rows: int
              ) -> None:
    """``c = op(a) @ op(b) + beta c``, float32 or float64 row-major 2-D views with contiguous
    rows (``op(x)`` is ``x``, or ``x^T`` with its ``trans_``); one BLAS call per ``rows`` rows of
    ``c``.

    ``c`` must not overlap ``a`` or ``b``; ``beta`` is 0 (``c`` is not read) or 1.
    """
    m, n = c.shape
    k = b.shape[1] if trans_b else b.shape[0]
    if m == 0 or n == 0:
        return
    if k == 0:
        if beta == 0:
            c[:] = 0
        return
    ldb, ldc = _leading(b, k if trans_b else n), _leading(c, n)
    lda = _leading(a, m if trans_a else k)
    # c^T = op(b)^T op(a)^T in BLAS's column-major terms, where a row-major x reads as x^T
    flag_a, flag_b = ord("t") if trans_a else ord("n"), ord("t") if trans_b else ord("n")
    for r0 in range(0, m, rows):
        r1 = min(r0 + rows, m)
        piece = a[:, r0:r1] if trans_a else a[r0:r1]
        if _xxgemm(flag_b, flag_a, n, r1 - r0, k, 1.0, b, ldb, piece, lda, beta, c[r0:r1],
                   ldc) < 0:
            raise RuntimeError("gemm: no BLAS (SciPy's cython_blas) for numba")
