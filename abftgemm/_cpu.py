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
from numba.extending import overload

from abftgemm._cpu_triangles import complete_lower, lower_product, row_limits, triangular_matmul
from abftgemm.checksums import location_weights


#: Let LLVM reorder and fuse the float64 sums so they vectorize. Not ``fastmath=True``: that also
#: assumes no NaN/INF and would break the non-finite checks. Reordering is covered by the float64
#: checksum term of the threshold, which bounds any summation order.
_FAST = {"reassoc", "contract"}
_ROW_BLOCK = 64  # rows per cache-resident block of _both_reduce


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


# The kernels sweep the matrix row by row (sequential reads) and are single-threaded: right after
# a GEMM, OpenBLAS's worker threads spin on the other cores for ~0.1 s, and numba threads competing
# with them made the checks slower, not faster (bench/NOTES.md). On one core the passes are bound
# by memory bandwidth (~35 GB/s) plus arithmetic that overlaps it poorly, so the kernels keep the
# arithmetic and the loads per element low. Column sums live in float64 arrays of the row's
# length; updating them once per eight rows instead of once per row cut a 2048x2048 column
# reduction from 2.0 to 0.70 ms (from memory). The default coefficients (plain and absolute sums,
# location weights) load only the weight vector: loading three coefficient vectors per element had
# made the row pass 0.88 ms, against 0.53 ms.

_ROWS_PER_UPDATE = 8  # rows per column-sum step (the body of _add_eight_rows is written for 8)
_ROW_STEP = 4  # rows per row-sum step, each coefficient loaded once per step (written out for 4)


def _vector_coefficients(c: Any, l: int) -> tuple[float, float, float]:
    """Coefficients ``(plain, weighted, absolute)`` of position ``l``: ``c[:, l]`` for a
    ``(3, L)`` array, ``(1, c[l], 1)`` for the default location weights ``c`` ``(L,)`` (compiled
    per case by the overload below; the constant ones cost no loads)."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_vector_coefficients, inline="always")
def _vector_coefficients_impl(c, l):  # noqa: ANN001 (numba compares signatures)
    if c.ndim == 1:
        return lambda c, l: (1.0, c[l], 1.0)
    return lambda c, l: (c[0, l], c[1, l], c[2, l])


def _batch_item(coef: Any, b: int) -> Any:
    """``coef[b]`` (``coef[0]`` when it broadcasts); the default weights ``(L,)`` as they are."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_batch_item, inline="always")
def _batch_item_impl(coef, b):  # noqa: ANN001 (numba compares signatures)
    if coef.ndim == 1:
        return lambda coef, b: coef
    return lambda coef, b: coef[min(b, coef.shape[0] - 1)]


@numba.njit(cache=True, fastmath=_FAST)
def _col_reduce(x: Any, coef: Any, out: Any) -> None:
    """Column reduction of every batch item (see backend.py ``col_reduce``)."""
    p = np.empty((3, x.shape[2]))
    for b in range(out.shape[0]):
        xb = x[min(b, x.shape[0] - 1)]
        p[:] = 0.0
        _sum_columns(xb, _batch_item(coef, b), 0, xb.shape[0], p)
        _store_columns(xb, p, out[b])


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _sum_columns(x: Any, c: Any, i0: int, i1: int, p: Any) -> None:
    """``p[f, j] += sum over rows i0..i1 of c[f, i] * x[i, j]`` (``|x|`` for f = 2), every
    product and sum in float64, ``p`` ``(3, ncols)`` updated once per eight rows."""
    _sum_column_prefix(x, c, i0, i1, p, p.shape[1])


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _sum_column_prefix(x: Any, c: Any, i0: int, i1: int, p: Any, n: int) -> None:
    """:func:`_sum_columns` of the first ``n`` columns only (the others of these rows are
    zero, such as past the diagonal of a causal block)."""
    i = i0
    while i + _ROWS_PER_UPDATE <= i1:
        _add_eight_rows(x, c, i, p, n)
        i += _ROWS_PER_UPDATE
    p0, p1, p2 = p[0], p[1], p[2]
    for r in range(i, i1):  # the leftover rows, one at a time
        r0 = x[r]
        a0, w0, g0 = _vector_coefficients(c, r)
        for j in range(n):
            v0 = np.float64(r0[j])
            p0[j] += a0 * v0
            p1[j] += w0 * v0
            p2[j] += g0 * abs(v0)


@numba.njit(cache=True, fastmath=_FAST)
def _add_eight_rows(x: Any, c: Any, i: int, p: Any, n: int) -> None:
    """``p[f, j] += sum over rows i..i+8 of c[f, r] * x[r, j]`` (``|x|`` for f = 2, ``j < n``) in
    float64 (products of float32 data and float64 coefficients are exact). Compiled once per
    signature, not inlined into every caller (inlining doubled the cold compile time)."""
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


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _sum_rows(x: Any, c: Any, i0: int, i1: int, out: Any) -> None:
    """For rows ``i0..i1``: ``out[i] = [sum c0*row, sum c1*row, sum c2*|row|, non-finite count,
    last non-finite index]``, four rows at a time (each coefficient read once per four rows)."""
    i = i0
    while i + _ROW_STEP <= i1:
        r0, r1, r2, r3 = x[i], x[i + 1], x[i + 2], x[i + 3]
        s00 = s01 = s02 = s10 = s11 = s12 = 0.0
        s20 = s21 = s22 = s30 = s31 = s32 = 0.0
        for j in range(r0.shape[0]):
            a, w, g = _vector_coefficients(c, j)
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
        i += _ROW_STEP
    while i < i1:
        _sum_row(x[i], c, out[i])
        i += 1


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _sum_row(row: Any, c: Any, o: Any) -> None:
    """One row of :func:`_sum_rows`."""
    s0, s1, s2 = _row_sums(row, c)
    _store(row, s0, s1, s2, o)


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _row_sums(row: Any, c: Any) -> tuple[float, float, float]:
    """``(sum c0*row, sum c1*row, sum c2*|row|)`` of one row, in float64."""
    s0 = s1 = s2 = 0.0
    for j in range(row.shape[0]):
        a, w, g = _vector_coefficients(c, j)
        v = np.float64(row[j])
        s0 += a * v
        s1 += w * v
        s2 += g * abs(v)
    return s0, s1, s2


@numba.njit(cache=True, inline="always")
def _store(row: Any, s0: float, s1: float, s2: float, o: Any) -> None:
    """Write one vector's sums; count its non-finite elements only when a sum is not finite."""
    o[0], o[1], o[2], o[3], o[4] = s0, s1, s2, 0.0, -1.0
    if not (np.isfinite(s0) and np.isfinite(s1) and np.isfinite(s2)):
        _scan(row, o)


@numba.njit(cache=True, fastmath=_FAST)
def _row_reduce(x: Any, coef: Any, out: Any) -> None:
    """Row reduction of every batch item (see backend.py ``row_reduce``).

    With the default coefficients the rows are read one at a time: several concurrent row streams
    read from memory 1.5x slower on the machine measured (0.86 vs 0.56 ms for 2048x2048 float32),
    and without coefficient vectors to share there is nothing to gain.
    """
    for b in range(out.shape[0]):
        xb, cb = x[min(b, x.shape[0] - 1)], _batch_item(coef, b)
        if coef.ndim == 1:
            for i in range(xb.shape[0]):
                _sum_row(xb[i], cb, out[b, i])
        else:
            _sum_rows(xb, cb, 0, xb.shape[0], out[b])


@numba.njit(cache=True, fastmath=_FAST)
def _both_reduce(x: Any, ccoef: Any, rcoef: Any, out_col: Any, out_row: Any) -> None:
    """Column and row reductions of every batch item in one read of it from memory.

    ``ccoef``/``rcoef`` are ``(batch or 1, 3, L)`` (coefficient-major, so the inner loops read
    them contiguously) or the default location weights ``(L,)``. The rows go through in blocks of
    64 that stay in cache for their second use (2048x2048 float32, from memory). With default row
    coefficients a block's row sums stream it in one row at a time, then its column sums re-read
    it (0.83 ms, against 0.97 ms the other way round); with coefficient vectors the column sums
    stream it in, then its row sums re-read it four rows at a time, each coefficient loaded once
    per four rows (0.88 ms; one row at a time took 1.8 ms, eight-row blocks 0.94 ms).
    """
    nrows = x.shape[1]
    p = np.empty((3, x.shape[2]))
    for b in range(out_col.shape[0]):
        xb = x[min(b, x.shape[0] - 1)]
        cc, rc = _batch_item(ccoef, b), _batch_item(rcoef, b)
        p[:] = 0.0
        for i in range(0, nrows, _ROW_BLOCK):
            e = min(i + _ROW_BLOCK, nrows)
            if rcoef.ndim == 1:
                for r in range(i, e):
                    _sum_row(xb[r], rc, out_row[b, r])
                _sum_columns(xb, cc, i, e, p)
            else:
                _sum_columns(xb, cc, i, e, p)
                _sum_rows(xb, rc, i, e, out_row[b])
        _store_columns(xb, p, out_col[b])


@numba.njit(cache=True, inline="always")
def _store_columns(x: Any, p: Any, out: Any) -> None:
    """Write the column sums ``p`` ``(3, ncols)`` of ``x`` into ``out`` ``(ncols, 5)``; count a
    column's non-finite elements only when one of its sums is not finite."""
    for j in range(p.shape[1]):
        o = out[j]
        o[0], o[1], o[2], o[3], o[4] = p[0, j], p[1, j], p[2, j], 0.0, -1.0
        if not (np.isfinite(p[0, j]) and np.isfinite(p[1, j]) and np.isfinite(p[2, j])):
            _scan(x[:, j], o)


@numba.njit(cache=True, inline="always")
def judge(p0: float, p1: float, p2: float, o0: float, o1: float, o2: float, o3: float,
          c_obs: float, c_pred: float, floor: float, c_mag: float,
          safe: float) -> tuple[float, bool, bool]:
    """``(threshold, flagged, verifiable)`` of one vector from its predicted ``[plain, weighted,
    S = sum |A||B|]`` and observed ``[plain, weighted, sum |C|, non-finite count]`` checksums
    (the rule of backend.py ``flag``; reduce.cu's ``judge`` is the GPU's copy).

    A non-finite element, or finite ones whose sums overflow, make the observed ``|C|`` sum and
    so the threshold infinite: hence the separate finiteness test. Checksums judge a vector whose
    inputs are finite (finite prediction) unless it may overflow (``S`` at or above ``safe``) and
    did: that one is settled element by element on the rare path. A verifiable vector is flagged
    when a checksum difference exceeds the threshold or its ``sum |C|`` exceeds the rigorous
    bound ``c_mag * S + floor``.
    """
    t = c_obs * o2 + c_pred * p2 + floor
    observed_finite = np.isfinite(o2) & (o3 == 0)
    ok = np.isfinite(p0) & np.isfinite(p1) & np.isfinite(p2) & ((p2 < safe) | observed_finite)
    within = ((abs(p0 - o0) <= t) & (abs(p1 - o1) <= t) & observed_finite
              & (o2 <= c_mag * p2 + floor))
    return t, ok and not within, ok


@numba.njit(cache=True)
def _flag(pred: Any, obs: Any, c_obs: float, c_pred: float, floor: float, c_mag: float,
          safe: float, tau: Any, bad: Any, verifiable: Any, counts: Any) -> None:
    """Threshold, verifiability and disagreement of every vector (see backend.py ``flag``).

    Written without short-circuit branches and with the counts kept in registers, so the loop
    vectorizes (2048 vectors: 47 -> 12 us, run twice per product).
    """
    n_bad = 0
    n_unverifiable = 0
    for i in range(pred.shape[0]):
        t, flagged, ok = judge(pred[i, 0], pred[i, 1], pred[i, 2], obs[i, 0], obs[i, 1],
                               obs[i, 2], obs[i, 3], c_obs, c_pred, floor, c_mag, safe)
        tau[i] = t
        verifiable[i] = ok
        bad[i] = flagged
        n_bad += flagged
        n_unverifiable += not ok
    counts[0] += n_bad
    counts[1] += n_unverifiable


def _coef_major(coef: np.ndarray | None, length: int) -> np.ndarray:
    """Coefficients ``(batch or 1, length, 3)`` as a contiguous ``(batch or 1, 3, length)`` array,
    so the kernels' inner loops read each weight vector contiguously; None (the defaults) as the
    location weights alone, ``(length,)``."""
    if coef is None:
        return _default_weights(length)
    return np.ascontiguousarray(coef.transpose(0, 2, 1))


@lru_cache(maxsize=64)
def _default_weights(length: int) -> np.ndarray:
    """Location weights ``(l+1)/length`` (read-only, shared). They are data, not computed in the
    kernels: with ``(l+1) * (1/length)`` computed inline, LLVM's reassociation factored the
    ``1/length`` out of the sum, and ``sum (l+1) * x_l`` overflowed for near-INF float64 errors
    (the normalization exists to prevent exactly that)."""
    weights = location_weights(length)
    weights.setflags(write=False)
    return weights


def _kernel_view(x: np.ndarray) -> np.ndarray:
    """float32/float64 data as is (any strides); 16-bit data upcast to float32."""
    return x if x.dtype in (np.float32, np.float64) else _as_float32(x)


def _as_float32(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """16-bit data as float32, exactly as ``x.astype(np.float32)``, in ``out`` (a new array when
    None) and returned.

    The conversion goes through a table of all 65536 bit patterns: NumPy's own float16
    conversion runs a scalar loop (380 us for 512x512 here, against 58 us for the lookup).
    Without ``out`` a non-contiguous ``x`` is copied first; with it (a plan's workspace, which
    must not allocate) it is converted in place by NumPy.
    """
    if out is None:
        out = np.empty(x.shape, dtype=np.float32)
        x = np.ascontiguousarray(x)
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


@numba.njit(cache=True)
def add_bias(c: Any, bias: Any) -> None:
    """``c[t, i, :] += bias`` for every row (NumPy's broadcasting ``+=`` allocates a buffer)."""
    for t in range(c.shape[0]):
        for i in range(c.shape[1]):
            row = c[t, i]
            for j in range(row.shape[0]):
                row[j] += bias[j]


@numba.njit(cache=True, fastmath=_FAST)
def _predict_lower_rows(a: Any, b: Any, b_transposed: bool, weights_n: Any, limits: Any,
                        enc: Any, pred: Any) -> None:
    """Row checksums of every batch item of ``a @ b`` where row ``i`` covers columns
    ``j < limits[i]`` only (see :meth:`CpuBackend.predict_lower_rows`): the row encoding of
    ``b``'s leading columns grows block by block (one read of ``b``, by rows of ``b`` or, with
    ``b_transposed``, of its C-contiguous transpose), and each block's rows take it so far."""
    m = pred.shape[1]
    for t in range(pred.shape[0]):
        at, bt = a[min(t, a.shape[0] - 1)], b[min(t, b.shape[0] - 1)]
        enc[:] = 0.0
        done = i = 0
        while i < m:
            hi = limits[i]
            if b_transposed:  # column j of b is row j of bt
                _sum_columns(bt, weights_n, done, hi, enc)
            else:
                for c in range(bt.shape[0]):
                    s0, s1, s2 = _row_sums(bt[c, done:hi], weights_n[done:hi])
                    enc[0, c] += s0
                    enc[1, c] += s1
                    enc[2, c] += s2
            done, end = hi, i
            while end < m and limits[end] == hi:
                end += 1
            _sum_rows(at, enc, i, end, pred[t])
            i = end


def _rows_first(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(x, False)``, or ``(x^T, True)`` when only the transpose of the (batch, rows, cols)
    array ``x`` is C-contiguous: the kernels read it along its memory rows either way."""
    xt = x.transpose(0, 2, 1)
    if not x.flags.c_contiguous and xt.flags.c_contiguous:
        return xt, True
    return x, False


class CpuBackend:
    """NumPy + numba implementation of :class:`abftgemm.backend.Backend`."""

    name = "numpy"
    xp = np

    def flag(self, pred: np.ndarray, obs: np.ndarray,
             coefficients: tuple[float, float, float, float], safe: float, counts: np.ndarray,
             out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        shape = pred.shape[:-1]
        tau, bad, verifiable = out if out is not None else (
            np.empty(shape), np.empty(shape, bool), np.empty(shape, bool))
        _flag(pred.reshape(-1, 5), obs.reshape(-1, 5), *coefficients, safe, tau.reshape(-1),
              bad.reshape(-1), verifiable.reshape(-1), counts)
        return tau, bad, verifiable

    def gemm(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None,
             buffers: tuple[np.ndarray, ...] | None = None, triangle: str | None = None,
             out_triangle: str | None = None) -> None:
        """``out = a @ b (+ bias)`` (see backend.py). 16-bit products accumulate in float32 (as
        cuBLAS does with compute type 32F) and round once; ``buffers`` ``(a32, b32, c32,
        bias32)`` are float32 workspaces for that (a plan's; new arrays when None). With
        ``triangle``, ``a`` is zero outside it and only its triangle's blocks are multiplied;
        with ``out_triangle="lower"`` (no bias) row ``i`` is computed up to
        ``row_limits(m, n)[i]`` only, in float32/float64 (:mod:`abftgemm._cpu_triangles`)."""
        if a.dtype in (np.float32, np.float64):
            if out_triangle is not None and bias is None:
                lower_product(a, b, out)
                return
            triangular_matmul(a, b, out, triangle)
            if bias is not None:
                add_bias(out, bias)
            return
        a32, b32, c32, bias32 = buffers if buffers is not None else (None,) * 4
        if c32 is None:
            c32 = np.empty(out.shape, np.float32)
        acc = triangular_matmul(_as_float32(a, a32), _as_float32(b, b32), c32, triangle)
        if bias is not None:
            add_bias(acc, _as_float32(bias, bias32))
        out[...] = acc

    def row_limits(self, m: int, n: int, dtype: Any) -> np.ndarray | None:
        """How far each row of an ``out_triangle="lower"`` product is computed (see
        :func:`abftgemm._cpu_triangles.row_limits`); None when every row is whole (always for
        16-bit products)."""
        if np.dtype(dtype) not in (np.float32, np.float64):
            return None
        limits = row_limits(m, n)
        return None if (limits == n).all() else limits

    def complete_lower(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """Compute the part of ``out = a @ b`` an ``out_triangle`` product left out (there are
        :meth:`row_limits`, so float32/float64)."""
        complete_lower(a, b, out)

    def predict_lower_rows(self, a: np.ndarray, b: np.ndarray, limits: np.ndarray,
                           enc: np.ndarray, pred: np.ndarray) -> None:
        """The predicted row checksums ``pred`` ``(batch, m, 5)`` (the fields of ``row_reduce(a,
        coef)``) of an ``out_triangle`` product, row ``i`` over its first ``limits[i]`` columns,
        with the default location weights of the whole row; ``enc`` is a ``(3, k)`` float64
        workspace."""
        _predict_lower_rows(a, *_rows_first(b), _default_weights(b.shape[-1]), limits, enc,
                            pred)

    def synchronize(self) -> None:
        """Nothing runs asynchronously on the CPU."""

    def plan_workspace(self, op: Any, counters: Any, verify_columns: bool) -> Any:
        """Workspaces and launches of a planned product (:mod:`abftgemm._cpu_plan`)."""
        from abftgemm._cpu_plan import CpuWorkspace

        return CpuWorkspace(op, counters, verify_columns)

    def col_reduce(self, x: np.ndarray, coef: np.ndarray | None, out: np.ndarray) -> None:
        _col_reduce(_kernel_view(x), _coef_major(coef, x.shape[1]), out)

    def row_reduce(self, x: np.ndarray, coef: np.ndarray | None, out: np.ndarray) -> None:
        _row_reduce(_kernel_view(x), _coef_major(coef, x.shape[2]), out)

    def both_reduce(self, x: np.ndarray, col_coef: np.ndarray | None,
                    row_coef: np.ndarray | None, out_col: np.ndarray, out_row: np.ndarray) -> None:
        _both_reduce(_kernel_view(x), _coef_major(col_coef, x.shape[1]),
                     _coef_major(row_coef, x.shape[2]), out_col, out_row)


@lru_cache(maxsize=1)
def backend() -> CpuBackend:
    """The process-wide CPU backend."""
    return CpuBackend()
