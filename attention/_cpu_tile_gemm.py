"""The fused core's tile products on the CPU: ``c = op(a) @ b + beta c`` through BLAS on strided
views, in calls of at most a given number of ``c``'s rows (numba).

numba's ``np.dot`` takes contiguous operands only and overwrites its output, so an accumulator
needed a buffer and a pass of its own, and a product one call. :func:`gemm` calls the BLAS numba's
``np.dot`` calls (SciPy's, through numba's ``numba_xxgemm``) with the views' leading dimensions
and ``beta``: accumulators take their tile products in place, and a product may go in pieces of
``c``'s rows. Some BLAS builds run small products on faster kernels than larger ones (OpenBLAS's
AVX-512 kernels, for ``m n k`` up to 10^6: a 128 x 128 x 64 float32 product in two pieces of 64
rows takes two thirds of the time of one call), others run the pieces slower; the rows per call
are measured once per process, dtype and head dimension (:func:`gemm_rows`). A piece's elements
are the same dot products as the whole product's, summed over the same inner length.
"""
from __future__ import annotations

import functools
import time
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from abftgemm.threads import one_blas_thread

#: A piece must beat one whole call by this factor to be taken (the two are within the timing's
#: noise otherwise, and one call is the plain choice).
_MARGIN = 0.9


@intrinsic
def _xxgemm(typingctx: Any, trans_b: Any, m: Any, n: Any, k: Any, alpha: Any, a: Any,
            lda: Any, b: Any, ldb: Any, beta: Any, c: Any, ldc: Any) -> Any:
    """Column-major ``C (m x n) = alpha A op(B) + beta C`` (``op`` by ``trans_b``, ``ord('n')`` or
    ``ord('t')``) through numba's ``numba_xxgemm``; returns its status (negative: no BLAS)."""
    sig = types.int32(trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        char, intp = ir.IntType(8), context.get_value_type(types.intp)
        void_p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [char, char, char, intp, intp, intp, void_p,
                                                void_p, intp, void_p, intp, void_p, void_p,
                                                intp])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
        dtype = signature.args[5].dtype
        kind = ir.Constant(char, ord("s" if dtype == types.float32 else "d"))

        def size(i: int) -> Any:
            return context.cast(builder, args[i], signature.args[i], types.intp)

        def slot(i: int) -> Any:
            value = context.cast(builder, args[i], signature.args[i], dtype)
            return builder.bitcast(cgutils.alloca_once_value(builder, value), void_p)

        def data(i: int) -> Any:
            array = context.make_array(signature.args[i])(context, builder, args[i])
            return builder.bitcast(array.data, void_p)

        flag = builder.trunc(context.cast(builder, args[0], signature.args[0], types.intp), char)
        return builder.call(fn, (kind, ir.Constant(char, ord("n")), flag, size(1), size(2),
                                 size(3), slot(4), data(5), size(6), data(7), size(8), slot(9),
                                 data(10), size(11)))

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
def gemm(a: Any, b: Any, c: Any, beta: float, trans_a: bool, rows: int) -> None:
    """``c = op(a) @ b + beta c``, float32 or float64 row-major 2-D views with contiguous rows
    (``op(a)`` is ``a``, or ``a^T`` with ``trans_a``); one BLAS call per ``rows`` rows of ``c``.

    ``c`` must not overlap ``a`` or ``b``; ``beta`` is 0 (``c`` is not read) or 1 in the kernels.
    """
    m, n = c.shape
    k = b.shape[0]
    if m == 0 or n == 0:
        return
    if k == 0:
        if beta == 0:
            c[:] = 0
        return
    ldb, ldc = _leading(b, n), _leading(c, n)
    lda = _leading(a, m if trans_a else k)
    trans = ord("t") if trans_a else ord("n")
    for r0 in range(0, m, rows):
        r1 = min(r0 + rows, m)
        piece = a[:, r0:r1] if trans_a else a[r0:r1]
        if _xxgemm(trans, n, r1 - r0, k, 1.0, b, ldb, piece, lda, beta, c[r0:r1], ldc) < 0:
            raise RuntimeError("gemm: no BLAS (SciPy's cython_blas) for numba")


@numba.njit(cache=True)
def _time_products(rows: int, calls: int, q: Any, kt: Any, s: Any, v: Any, o: Any) -> None:
    """``calls`` rounds of a tile's three kinds of products (``S = Q K^T``, ``O += P V``,
    ``dV += P^T dO``) in pieces of ``rows`` rows."""
    for _ in range(calls):
        gemm(q, kt, s, 0.0, False, rows)
        gemm(s, v, o, 1.0, False, rows)
        gemm(s, v, o, 1.0, True, rows)


@functools.cache
def gemm_rows(dtype: np.dtype, d: int, tile: int) -> int:
    """The rows of ``c`` per BLAS call that run a ``tile x tile`` tile's products (head dimension
    ``d``, ``dtype`` float32 or float64) fastest here, single-threaded: ``tile``, or half or a
    quarter of it where that takes at most :data:`_MARGIN` of one call's time (each measured
    three times, alternately, the best taken). Measured once per process and arguments (a few
    milliseconds)."""
    rng = np.random.default_rng(0)
    q, v = (rng.standard_normal((tile, d)).astype(dtype) for _ in range(2))
    kt = rng.standard_normal((d, tile)).astype(dtype)
    s, o = np.empty((tile, tile), dtype), np.zeros((tile, d), dtype)
    choices = [r for r in (tile, tile // 2, tile // 4) if r >= 16] or [tile]
    best = dict.fromkeys(choices, np.inf)
    with one_blas_thread():
        _time_products(tile, 2, q, kt, s, v, o)  # compiled and warm
        for _ in range(3):
            for r in choices:
                start = time.perf_counter()
                _time_products(r, 8, q, kt, s, v, o)
                best[r] = min(best[r], time.perf_counter() - start)
    fastest = min(best, key=best.get)
    return fastest if best[fastest] <= _MARGIN * best[tile] else tile
