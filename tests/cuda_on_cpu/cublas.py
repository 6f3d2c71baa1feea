"""The cuBLAS calls the CuPy backend makes (``cupy_backends.cuda.libs.cublas``), on the host.

``gemmStridedBatchedEx`` reads and writes emulated device memory with cuBLAS's column-major
op/ld/stride mapping, checks that every element it touches lies inside one allocation, computes
in the compute type (fp16/bf16 inputs widened exactly to float32, one rounding to the output
type) and honours alpha, beta (beta 0: C is not read) and the pointer mode. Beyond cuBLAS, it
refuses what the project's numerical model rules out: TF32 math for float32 data, and half-precision
outputs without CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION (split-K partial sums rounded to
the output type). ``calls`` records each product's handle state, for tests.
"""
from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from cuda_on_cpu import memory

CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_OP_C = 0, 1, 2
CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE = 0, 1
CUBLAS_DEFAULT_MATH, CUBLAS_TENSOR_OP_MATH, CUBLAS_PEDANTIC_MATH = 0, 1, 2
CUBLAS_TF32_TENSOR_OP_MATH = 3
CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16
CUBLAS_COMPUTE_16F, CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F = 64, 68, 70
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_GEMM_DEFAULT = -1

_TYPES = {2: np.dtype(np.float16), 14: np.dtype(ml_dtypes.bfloat16), 0: np.dtype(np.float32),
          1: np.dtype(np.float64)}


class CUBLASError(RuntimeError):
    """A cuBLAS status other than success (or a stand-in check)."""


@dataclass
class _Handle:
    pointer_mode: int = CUBLAS_POINTER_MODE_HOST
    math_mode: int = CUBLAS_DEFAULT_MATH
    stream: int = 0


@dataclass(frozen=True)
class GemmCall:
    handle: int
    dtype: str
    math_mode: int
    pointer_mode: int
    stream: int
    shape: tuple[int, int, int, int]  # batch, m, n, k (column-major, as cuBLAS sees them)


_handles: dict[int, _Handle] = {}
_ids = itertools.count(0x1000)
calls: list[GemmCall] = []


def _get(handle: int) -> _Handle:
    try:
        return _handles[handle]
    except KeyError:
        raise CUBLASError(f"CUBLAS_STATUS_NOT_INITIALIZED: no handle {handle:#x}") from None


def create() -> int:
    handle = next(_ids)
    _handles[handle] = _Handle()
    return handle


def destroy(handle: int) -> None:
    _get(handle)
    del _handles[handle]


def setPointerMode(handle: int, mode: int) -> None:  # noqa: N802 (cuBLAS names)
    if mode not in (CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE):
        raise CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: pointer mode {mode}")
    _get(handle).pointer_mode = mode


def getPointerMode(handle: int) -> int:  # noqa: N802
    return _get(handle).pointer_mode


def setMathMode(handle: int, mode: int) -> None:  # noqa: N802
    if mode & 0xF not in (0, 1, 2, 3) or mode & ~0x1F:
        raise CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: math mode {mode}")
    _get(handle).math_mode = mode


def getMathMode(handle: int) -> int:  # noqa: N802
    return _get(handle).math_mode


def setStream(handle: int, stream: int) -> None:  # noqa: N802
    _get(handle).stream = int(stream)


def getStream(handle: int) -> int:  # noqa: N802
    return _get(handle).stream


def _scalar(ptr: int, dtype: np.dtype, mode: int) -> float:
    if mode == CUBLAS_POINTER_MODE_HOST:
        ctype = ctypes.c_double if dtype == np.float64 else ctypes.c_float
        return float(ctype.from_address(ptr).value)
    alloc = memory.find(ptr)
    if alloc is None or not alloc.contains(ptr, dtype.itemsize):
        raise CUBLASError("device pointer mode: alpha/beta are not in device memory")
    return float(np.ndarray((), dtype, alloc.bytes, ptr - alloc.ptr))


def _matrices(ptr: int, dtype: np.dtype, rows: int, cols: int, ld: int, stride: int, batch: int,
              what: str) -> np.ndarray:
    """(batch, rows, cols) view of column-major matrices in device memory."""
    if ld < max(1, rows):
        raise CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: ld{what} = {ld} < {max(1, rows)}")
    isz = dtype.itemsize
    alloc = memory.find(ptr)
    extent = ((batch - 1) * stride + (cols - 1) * ld + rows) * isz
    if alloc is None or not alloc.contains(ptr, extent):
        where = "outside every device allocation" if alloc is None else (
            f"past the end of a {alloc.nbytes}-byte allocation (offset {ptr - alloc.ptr}, "
            f"{extent} bytes)")
        raise CUBLASError(f"gemmStridedBatchedEx: {what} spans memory {where} "
                          "(out-of-bounds access)")
    return np.ndarray((batch, rows, cols), dtype, alloc.bytes, ptr - alloc.ptr,
                      (stride * isz, isz, ld * isz))


def gemmStridedBatchedEx(handle: int, transa: int, transb: int, m: int, n: int, k: int,  # noqa: N802
                         alpha: int, A: int, Atype: int, lda: int, strideA: int,  # noqa: N803
                         B: int, Btype: int, ldb: int, strideB: int, beta: int,  # noqa: N803
                         C: int, Ctype: int, ldc: int, strideC: int, batchCount: int,  # noqa: N803
                         computeType: int, algo: int) -> None:  # noqa: N803
    """``C[i] = alpha op(A[i]) op(B[i]) + beta C[i]``, column-major, ``i < batchCount``."""
    h = _get(handle)
    if Atype != Btype or Btype != Ctype or Atype not in _TYPES:
        raise CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: types {Atype}, {Btype}, {Ctype}")
    dtype = _TYPES[Ctype]
    want = CUBLAS_COMPUTE_64F if dtype == np.float64 else CUBLAS_COMPUTE_32F
    if computeType != want:
        raise CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED here: compute type {computeType} for "
                          f"{dtype} (the stand-in models {want})")
    if min(m, n, k, batchCount) < 0 or transa not in (0, 1) or transb not in (0, 1):
        raise CUBLASError("CUBLAS_STATUS_INVALID_VALUE: sizes or ops")
    if dtype == np.float32 and h.math_mode & 0xF == CUBLAS_TF32_TENSOR_OP_MATH:
        raise CUBLASError("stand-in check: TF32 math would round float32 inputs to 10 bits")
    if dtype.itemsize == 2 and not h.math_mode & CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION:
        raise CUBLASError("stand-in check: a float16/bfloat16 product on a handle without "
                          "CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION (split-K partial sums "
                          "may be rounded to the output type)")
    calls.append(GemmCall(handle, dtype.name, h.math_mode, h.pointer_mode, h.stream,
                          (batchCount, m, n, k)))
    if m == 0 or n == 0 or batchCount == 0:
        return
    with np.errstate(all="ignore"):  # cuBLAS raises no floating-point warnings
        _multiply(h, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta, C,
                  ldc, strideC, batchCount, dtype)
    memory.find(C).mark_written()


def _multiply(h: _Handle, transa: int, transb: int, m: int, n: int, k: int, alpha: int, A: int,
              lda: int, strideA: int, B: int, ldb: int, strideB: int, beta: int, C: int, ldc: int,
              strideC: int, batch: int, dtype: np.dtype) -> None:  # noqa: N803
    acc = np.float64 if dtype == np.float64 else np.float32
    a_scale = _scalar(alpha, np.dtype(acc), h.pointer_mode)
    b_scale = _scalar(beta, np.dtype(acc), h.pointer_mode)
    c = _matrices(C, dtype, m, n, ldc, strideC, batch, "C")
    if k:
        a_rows, a_cols = (m, k) if transa == CUBLAS_OP_N else (k, m)
        b_rows, b_cols = (k, n) if transb == CUBLAS_OP_N else (n, k)
        a = _matrices(A, dtype, a_rows, a_cols, lda, strideA, batch, "A").astype(acc)
        b = _matrices(B, dtype, b_rows, b_cols, ldb, strideB, batch, "B").astype(acc)
        if transa != CUBLAS_OP_N:
            a = a.transpose(0, 2, 1)
        if transb != CUBLAS_OP_N:
            b = b.transpose(0, 2, 1)
        product = np.matmul(a, b) * acc(a_scale)
    else:
        product = np.zeros(c.shape, acc)
    if b_scale != 0:
        product = product + acc(b_scale) * c.astype(acc)
    c[...] = product.astype(dtype)
