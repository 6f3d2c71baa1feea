"""The numba building blocks of the CPU checksum passes, shared by every CPU kernel (attention's
too): column and row sums with the plain, location-weighted and absolute coefficients in float64,
the judgement of one vector, 16-bit data as float32, and BLAS products of strided views
(:func:`blas_gemm`). The ``inline="always"`` helpers are compiled into each caller, whose on-disk
cache does not see edits here (``make clean``).
"""
from __future__ import annotations

from functools import lru_cache
from types import FunctionType
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from abftgemm.threads import pool_kernels


#: Let LLVM reorder and fuse the float64 sums so they vectorize. Not ``fastmath=True``: that also
#: assumes no NaN/INF (the threshold bounds any summation order: docs/design.md, "Backends").
FAST = {"reassoc", "contract"}


# Serial kernels (numba's threads beside OpenBLAS's spinning ones made the checks slower) that
# sweep row by row; the default coefficients load only the weight vector (bench/NOTES.md).
ROWS_PER_UPDATE = 8  # rows per column-sum step (the body of _add_eight_rows is written for 8)
_ROW_STEP = 4  # rows per row-sum step, each coefficient loaded once per step (written out for 4)


def _vector_coefficients(c: Any, l: int) -> tuple[float, float, float]:
    """Coefficients ``(plain, weighted, absolute)`` of position ``l``: ``c[f][l]`` for a (3, L)
    array or three (L,) arrays, ``(1, c[l], 1)`` for the default location weights ``c`` (L,)."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_vector_coefficients, inline="always")
def _vector_coefficients_impl(c, l):  # noqa: ANN001 (numba compares signatures)
    if isinstance(c, types.BaseTuple):
        return lambda c, l: (c[0][l], c[1][l], c[2][l])
    if c.ndim == 1:
        return lambda c, l: (1.0, c[l], 1.0)
    return lambda c, l: (c[0, l], c[1, l], c[2, l])


@numba.njit(cache=True, inline="always")
def fields(enc: Any, t: int) -> tuple[Any, Any, Any]:
    """Batch item ``t`` (the last when it broadcasts) of an encoding ``(3, batch or 1, L)`` as
    three field vectors, typed contiguous where ``enc[:, t]`` would not be."""
    u = min(t, enc.shape[1] - 1)
    return enc[0, u], enc[1, u], enc[2, u]


@numba.njit(cache=True, fastmath=FAST, inline="always")
def sum_columns(x: Any, c: Any, i0: int, i1: int, p: Any) -> None:
    """``p[f][j] += sum over rows i0..i1 of c[f][i] * x[i, j]`` (``|x|`` for f = 2) in float64,
    ``p`` (3, ncols) or three (ncols,) arrays."""
    sum_column_prefix(x, c, i0, i1, p, p[0].shape[0])


@numba.njit(cache=True, fastmath=FAST, inline="always")
def sum_column_prefix(x: Any, c: Any, i0: int, i1: int, p: Any, n: int) -> None:
    """:func:`sum_columns` of the first ``n`` columns only."""
    i = i0
    while i + ROWS_PER_UPDATE <= i1:
        _add_eight_rows(x, c, i, p, n)
        i += ROWS_PER_UPDATE
    p0, p1, p2 = p[0], p[1], p[2]
    for r in range(i, i1):  # the leftover rows, one at a time
        r0 = x[r]
        a0, w0, g0 = _vector_coefficients(c, r)
        for j in range(n):
            v0 = np.float64(r0[j])
            p0[j] += a0 * v0
            p1[j] += w0 * v0
            p2[j] += g0 * abs(v0)


@numba.njit(cache=True, fastmath=FAST)
def _add_eight_rows(x: Any, c: Any, i: int, p: Any, n: int) -> None:
    """Rows ``i..i+8`` of :func:`sum_column_prefix`; not inlined (that doubled the cold
    compile time)."""
    p0, p1, p2 = p[0], p[1], p[2]
    r0, r1, r2, r3 = x[i], x[i + 1], x[i + 2], x[i + 3]
    r4, r5, r6, r7 = x[i + 4], x[i + 5], x[i + 6], x[i + 7]
    a0, w0, g0 = _vector_coefficients(c, i)
    a1, w1, g1 = _vector_coefficients(c, i + 1)
    a2, w2, g2 = _vector_coefficients(c, i + 2)
    a3, w3, g3 = _vector_coefficients(c, i + 3)
    a4, w4, g4 = _vector_coefficients(c, i + 4)
    a5, w5, g5 = _vector_coefficients(c, i + 5)
    a6, w6, g6 = _vector_coefficients(c, i + 6)
    a7, w7, g7 = _vector_coefficients(c, i + 7)
    for j in range(n):
        v0, v1 = np.float64(r0[j]), np.float64(r1[j])
        v2, v3 = np.float64(r2[j]), np.float64(r3[j])
        v4, v5 = np.float64(r4[j]), np.float64(r5[j])
        v6, v7 = np.float64(r6[j]), np.float64(r7[j])
        p0[j] += (a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3
                  + a4 * v4 + a5 * v5 + a6 * v6 + a7 * v7)
        p1[j] += (w0 * v0 + w1 * v1 + w2 * v2 + w3 * v3
                  + w4 * v4 + w5 * v5 + w6 * v6 + w7 * v7)
        p2[j] += (g0 * abs(v0) + g1 * abs(v1) + g2 * abs(v2) + g3 * abs(v3)
                  + g4 * abs(v4) + g5 * abs(v5) + g6 * abs(v6) + g7 * abs(v7))


@numba.njit(cache=True, fastmath=FAST, inline="always")
def sum_rows(x: Any, c: Any, i0: int, i1: int, out: Any) -> None:
    """For rows ``i0..i1``: ``out[i] = [sum c0*row, sum c1*row, sum c2*|row|, non-finite count,
    last non-finite index]``: :func:`row_sums_into`'s sums, then each row's count."""
    row_sums_into(x[i0:i1], c, out[i0:i1])
    for i in range(i0, i1):
        _store(x[i], out[i, 0], out[i, 1], out[i, 2], out[i])


@numba.njit(cache=True, fastmath=FAST, inline="always")
def row_sums_into(x: Any, c: Any, out: Any) -> None:
    """``out[i, :3] = row_sums(x[i], c)`` for every row of ``x``, four rows at a time
    (:func:`four_row_sums`): :func:`sum_rows` without the non-finite count, for a caller that
    judges the sums itself."""
    i, rows = 0, x.shape[0]
    while i + _ROW_STEP <= rows:
        s = four_row_sums(x, c, i)
        for r in range(_ROW_STEP):
            out[i + r, 0], out[i + r, 1], out[i + r, 2] = s[3 * r], s[3 * r + 1], s[3 * r + 2]
        i += _ROW_STEP
    while i < rows:
        out[i, 0], out[i, 1], out[i, 2] = row_sums(x[i], c)
        i += 1


@numba.njit(cache=True, fastmath=FAST, inline="always")
def four_row_sums(x: Any, c: Any, i: int) -> tuple:
    """:func:`row_sums` of rows ``i..i+4`` of ``x`` in one pass, each coefficient loaded once for
    the four (and each row's sums reduced across the vector lanes once per four rows' work):
    ``(s00, s01, s02, s10, ..., s32)``, row by row."""
    r0, r1, r2, r3 = x[i], x[i + 1], x[i + 2], x[i + 3]
    s00 = s01 = s02 = s10 = s11 = s12 = 0.0
    s20 = s21 = s22 = s30 = s31 = s32 = 0.0
    for j in range(r0.shape[0]):
        a, w, g = _vector_coefficients(c, j)
        v0, v1 = np.float64(r0[j]), np.float64(r1[j])
        v2, v3 = np.float64(r2[j]), np.float64(r3[j])
        s00, s01, s02 = s00 + a * v0, s01 + w * v0, s02 + g * abs(v0)
        s10, s11, s12 = s10 + a * v1, s11 + w * v1, s12 + g * abs(v1)
        s20, s21, s22 = s20 + a * v2, s21 + w * v2, s22 + g * abs(v2)
        s30, s31, s32 = s30 + a * v3, s31 + w * v3, s32 + g * abs(v3)
    return s00, s01, s02, s10, s11, s12, s20, s21, s22, s30, s31, s32


@numba.njit(cache=True, fastmath=FAST, inline="always")
def sum_row(row: Any, c: Any, o: Any) -> None:
    """One row of :func:`sum_rows`."""
    s0, s1, s2 = row_sums(row, c)
    _store(row, s0, s1, s2, o)


@numba.njit(cache=True, fastmath=FAST, inline="always")
def row_sums(row: Any, c: Any) -> tuple[float, float, float]:
    """``(sum c0*row, sum c1*row, sum c2*|row|)`` of one row, in float64."""
    s0 = s1 = s2 = 0.0
    for j in range(row.shape[0]):
        a, w, g = _vector_coefficients(c, j)
        v = np.float64(row[j])
        s0, s1, s2 = s0 + a * v, s1 + w * v, s2 + g * abs(v)
    return s0, s1, s2


@numba.njit(cache=True, inline="always")
def _store(row: Any, s0: float, s1: float, s2: float, o: Any) -> None:
    """Write one vector's sums; count its non-finite elements, and note the last one's index,
    only when a sum is not finite."""
    o[0], o[1], o[2], o[3], o[4] = s0, s1, s2, 0.0, -1.0
    if not (np.isfinite(s0) and np.isfinite(s1) and np.isfinite(s2)):
        for k in range(row.shape[0]):
            if not np.isfinite(row[k]):
                o[3] += 1.0
                o[4] = k


@numba.njit(cache=True, inline="always")
def store_columns(x: Any, p: Any, out: Any) -> None:
    """Write the column sums ``p`` (3, ncols) of ``x`` into ``out`` (ncols, 5) as :func:`_store`."""
    for j in range(p.shape[1]):
        _store(x[:, j], p[0, j], p[1, j], p[2, j], out[j])


@numba.njit(cache=True, inline="always")
def judge(p0: float, p1: float, p2: float, o0: float, o1: float, o2: float, o3: float,
          c_obs: float, c_pred: float, floor: float, c_mag: float,
          safe: float) -> tuple[float, bool, bool]:
    """``(threshold, flagged, verifiable)`` of one vector from its predicted ``[plain, weighted,
    S = sum |A||B|]`` and observed ``[plain, weighted, sum |C|, non-finite count]`` checksums
    (checksum_acc.cuh's ``judge`` is the GPU's copy). Verifiable: a finite prediction, unless
    ``S`` reaches ``safe`` and the observation is not finite (settled on the rare path). Flagged:
    verifiable and a checksum difference above the threshold, a non-finite element, or
    ``sum |C|`` above the rigorous bound ``c_mag * S + floor``."""
    t = c_obs * o2 + c_pred * p2 + floor
    observed_finite = np.isfinite(o2) & (o3 == 0)
    ok = np.isfinite(p0) & np.isfinite(p1) & np.isfinite(p2) & ((p2 < safe) | observed_finite)
    within = ((abs(p0 - o0) <= t) & (abs(p1 - o1) <= t) & observed_finite
              & (o2 <= c_mag * p2 + floor))
    return t, ok and not within, ok


def as_float32(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """16-bit data as float32, exactly as ``x.astype(np.float32)``, in ``out`` (a new array when
    None) and returned. Contiguous data goes through a table of all 65536 bit patterns (NumPy's
    float16 conversion is a slower scalar loop); a non-contiguous ``x`` is copied first, or into
    a given ``out`` (a plan's workspace, which must not allocate) converted by NumPy."""
    if x.dtype.itemsize != 2 or (x.dtype.kind != "f" and x.dtype.name != "bfloat16"):
        raise TypeError(f"as_float32 converts 16-bit floats, not {x.dtype}")
    if out is None:
        out = np.empty(x.shape, dtype=np.float32)
        x = np.ascontiguousarray(x)
    elif out.shape != x.shape or out.dtype != np.float32:
        raise ValueError(f"as_float32: out is {out.dtype} {out.shape}, not float32 {x.shape}")
    if x.flags.c_contiguous:
        _lookup(x.reshape(-1).view(np.uint16), bits_table(x.dtype), out.reshape(-1))
    else:
        np.copyto(out, x, casting="unsafe")
    return out


@lru_cache(maxsize=2)
def bits_table(dtype: np.dtype) -> np.ndarray:
    """The float32 value of every bit pattern of the 16-bit ``dtype`` (NumPy's or ml_dtypes'
    conversion, tabulated once; read-only)."""
    table = np.arange(1 << 16, dtype=np.uint16).view(dtype).astype(np.float32)
    table.setflags(write=False)
    return table


@numba.njit(cache=True)
def _lookup(bits: Any, table: Any, out: Any) -> None:
    for i in range(bits.shape[0]):
        out[i] = table[bits[i]]


def twins(fn: Any, **options: Any) -> tuple[Any, Any]:
    """``(parallel, serial)``: ``fn`` compiled with ``options`` twice, its ``prange`` loops in
    numba's pool and, compiled without ``parallel``, run as ``range`` (for a process that cannot
    enter the pool: :func:`abftgemm.threads.pool_kernels`). The serial one is compiled from a copy
    named apart: numba's on-disk cache files a compilation by the function's name, signature and
    code alone, and would hand either out for the other."""
    serial = FunctionType(fn.__code__, fn.__globals__, fn.__name__)
    serial.__qualname__ = f"{fn.__qualname__}_serial"
    return (numba.njit(parallel=True, **options)(fn), numba.njit(**options)(serial))


#: Elements from which :func:`all_finite` scans in numba's pool (below, starting the pool's
#: threads costs more than they save).
POOL_MIN_SCAN = 1 << 18
#: Parts of an array :func:`all_finite` scans in the pool, in any order.
_SCAN_PARTS = 64


def all_finite(x: np.ndarray) -> bool:
    """No INF or NaN in the array ``x``. C-contiguous float data are judged from their exponent
    bits in one pass, without the bool array of ``np.isfinite(x).all()``, in numba's pool from
    :data:`POOL_MIN_SCAN` elements."""
    exponent = _exponent_bits(x.dtype)
    if exponent is None or not x.flags.c_contiguous:
        return bool(np.isfinite(x).all())
    bits = x.reshape(-1).view(exponent.dtype)
    if bits.size < POOL_MIN_SCAN:
        return bool(_top_exponent(bits, exponent) != exponent)
    tops = np.empty(_SCAN_PARTS, bits.dtype)
    pool_kernels(*_TOP_EXPONENTS)(bits, exponent, tops)
    return bool(tops.max() != exponent)


@lru_cache(maxsize=8)
def _exponent_bits(dtype: np.dtype) -> Any:
    """+INF's bit pattern (every exponent bit set) as an unsigned int; None for a non-float."""
    if dtype.kind != "f" and dtype.name != "bfloat16":
        return None
    return np.array(np.inf, dtype=dtype).view(f"u{dtype.itemsize}")[()]


@numba.njit(cache=True)
def _top_exponent(bits: Any, exponent: Any) -> Any:
    """The largest ``bits & exponent``, each term cast back to the data's width (numba types it
    wider) so that LLVM vectorizes the max in lanes of that width."""
    width = bits.dtype.type
    top = width(0)
    for i in range(bits.shape[0]):
        top = max(top, width(bits[i] & exponent))
    return top


def _top_exponents(bits: Any, exponent: Any, tops: Any) -> None:
    """``tops[t]`` = :func:`_top_exponent` of part ``t`` of ``len(tops)`` of ``bits``."""
    n = bits.shape[0]
    part = -(-n // tops.shape[0])
    for t in numba.prange(tops.shape[0]):
        tops[t] = _top_exponent(bits[min(n, t * part):min(n, (t + 1) * part)], exponent)


_TOP_EXPONENTS = twins(_top_exponents, cache=True)


def rows_first(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(x, False)``, or ``(x^T, True)`` when only the transpose of the (batch, rows, cols)
    array ``x`` is C-contiguous, for kernels that read along memory rows."""
    xt = x.transpose(0, 2, 1)
    if not x.flags.c_contiguous and xt.flags.c_contiguous:
        return xt, True
    return x, False


@intrinsic
def wide_vectors(typingctx: Any) -> Any:  # noqa: ARG001 (numba's intrinsic signature)
    """Let LLVM vectorize the calling kernel's loops with the widest vectors the CPU has (numba
    only): gives the calling function LLVM's ``"prefer-vector-width"="512"``. LLVM keeps to
    256-bit vectors on Intel CPUs with AVX-512 (its tuning assumes that 512-bit instructions
    lower the clock), where a float32 loop then runs 8 lanes and OpenBLAS's kernels 16; on a CPU
    without 512-bit vectors the attribute changes nothing. For loops that gain from it, measured
    (bench/NOTES.md): one number per element, as an exponential, but not memory-bound sums."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:  # noqa: ARG001
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')  # (not in llvmlite's
        return context.get_dummy_value()  # list of known attributes)
    return types.none(), codegen


# ---- BLAS from numba

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
def _rows_fault(x: Any) -> int:
    """0 where BLAS reads the row-major 2-D view ``x`` as it lies (each row contiguous, the rows
    apart by at least their length, in order), else 1 (a row is not contiguous: strided, or a
    zero stride) or 2 (rows overlap or run backwards). A dimension of length 1 may have any
    stride."""
    item = x.itemsize
    if x.shape[1] > 1 and x.strides[1] != item:
        return 1
    if x.shape[0] > 1 and x.strides[0] < x.shape[1] * item:
        return 2
    return 0


@numba.njit(cache=True)
def rows_readable(x: Any) -> bool:
    """Whether :func:`blas_gemm` takes the 2-D view ``x`` as it lies (:func:`_rows_fault`); it
    takes ``x^T`` with a transpose where ``rows_readable(x.T)``."""
    return _rows_fault(x) == 0


@numba.njit(cache=True)
def _leading(x: Any, cols: int) -> int:
    """The leading dimension of the row-major 2-D view ``x`` (``cols`` wide), which
    :func:`rows_readable` must take."""
    fault = _rows_fault(x)
    if fault == 1:
        raise ValueError("gemm: an operand's rows are not contiguous")
    if fault == 2:
        raise ValueError("gemm: an operand's rows overlap or run backwards")
    return max(x.strides[0] // x.itemsize, cols, 1)


@numba.njit(cache=True)
def blas_gemm(a: Any, b: Any, c: Any, beta: float, trans_a: bool, trans_b: bool, rows: int
              ) -> None:
    """``c = op(a) @ op(b) + beta c``, float32 or float64 row-major 2-D views with contiguous
    rows (``op(x)`` is ``x``, or ``x^T`` with its ``trans_``); one BLAS call per ``rows`` rows of
    ``c`` (numba only).

    numba's ``np.dot`` takes contiguous operands only and overwrites its output, so a transposed
    or strided operand needed a copy, an accumulator a buffer and a pass of its own; this calls
    the BLAS ``np.dot`` calls (SciPy's, through numba's ``numba_xxgemm``) with the views' leading
    dimensions, transposes and ``beta``. ``c`` must not overlap ``a`` or ``b``; ``beta`` is 0
    (``c`` is not read) or 1.
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
