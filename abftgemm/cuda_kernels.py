"""What the CUDA modules of the packages share: operand layouts, the GEMM call, kernel loading.

:mod:`abftgemm._cuda` (the backend), :mod:`abftgemm._cuda_plan` (a planned product's launches)
and :mod:`attention._cuda_softmax` launch their kernels with these. Imports CuPy at the top, as
they do: import it only once CuPy arrays are in play.

Matrix layouts accepted without a copy, per matrix of a ``(batch or 1, rows, cols)`` operand:
row-major (unit stride along columns, any row pitch ``ld >= cols``) and transposed (unit stride
along rows, any column pitch ``ld >= rows``, e.g. ``y.transpose(0, 2, 1)`` of a contiguous ``y``),
with any non-negative batch stride. Anything else is copied to C order first (:func:`matrices`).
"""
from __future__ import annotations

import contextlib
import functools
from types import ModuleType
from typing import Callable, Iterator, NamedTuple

import cupy
import numpy
from cupy_backends.cuda.libs import cublas

from abftgemm import kernels

#: cudaDataType_t of each supported element type.
DATA_TYPES = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
#: Unsigned integer dtypes of each item size, for bit copies that work for every element type.
_BITS = {2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}

# cuBLAS reads alpha/beta through host pointers; module-level arrays outlive every call.
_ONE32, _ZERO32 = numpy.ones((), numpy.float32), numpy.zeros((), numpy.float32)
_ONE64, _ZERO64 = numpy.ones((), numpy.float64), numpy.zeros((), numpy.float64)
# cublasMath_t values, spelled out (not every cupy_backends release exports them).
_TF32_TENSOR_OP_MATH = 3
_MATH_MODE_MASK = 0xF  # low bits: the mode; higher bits are flags
#: The math mode of every product: CUBLAS_DEFAULT_MATH | DISALLOW_REDUCED_PRECISION_REDUCTION, so
#: that reductions (split-K included) accumulate in the compute type, never in a float16/bfloat16
#: output type (the thresholds assume one rounding of each product to the output type).
PLAIN_MATH = 16
#: Largest count the kernels index with a 32-bit int (grid sizes, vector lengths).
INT32_MAX = 2**31 - 1


class Matrices(NamedTuple):
    """A batch of matrices in the form cuBLAS and the kernels take.

    ``array`` owns the data (a C-order copy when the input layout was unusable). With
    ``transposed`` False, element (i, j) of matrix b sits at ``b*batch_stride + i*ld + j``;
    with ``transposed`` True at ``b*batch_stride + i + j*ld``. ``batch_stride`` 0 broadcasts.
    """

    array: cupy.ndarray
    transposed: bool
    ld: int
    batch_stride: int


def _layout(x: cupy.ndarray) -> tuple[bool, int, int] | None:
    """``(transposed, ld, batch_stride)`` of 3-D ``x`` in elements, or None if it needs a copy."""
    isz = x.itemsize
    nb, r, c = x.shape
    if x.size == 0:  # CuPy may give empty arrays zero strides; no element is ever read
        return False, max(c, 1), 0
    if any(s % isz for s in x.strides):
        return None
    s0, s1, s2 = (s // isz for s in x.strides)
    batch_stride = 0 if nb == 1 else s0
    if batch_stride < 0:
        return None
    # Strides of length-1 dimensions are arbitrary, so they decide nothing.
    ld = s1 if r > 1 else max(c, 1)
    if (c == 1 or s2 == 1) and ld >= max(c, 1):
        return False, ld, batch_stride
    ld = s2 if c > 1 else max(r, 1)
    if (r == 1 or s1 == 1) and ld >= max(r, 1):
        return True, ld, batch_stride
    return None


def matrices(x: cupy.ndarray) -> Matrices:
    """``x`` as :class:`Matrices`, copying it to C order only if its layout is unusable."""
    layout = _layout(x)
    if layout is None:
        x = cupy.ascontiguousarray(x)
        layout = _layout(x)
    return Matrices(x, *layout)


def bits(x: cupy.ndarray) -> cupy.ndarray:
    """View of ``x`` as unsigned integers of the same size (copies without bf16 arithmetic)."""
    return x.view(_BITS[x.itemsize])


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for non-negative ints."""
    return -(-a // b)


def split_rows(blocks: int, rows: int, target: int, min_rows: int) -> tuple[int, int]:
    """``(chunks, rows per chunk)``: ``rows`` split into chunks of at least ``min_rows`` until
    ``blocks * chunks`` reaches ``target`` blocks (the grid fills the device)."""
    if blocks == 0 or blocks >= target or rows < 2 * min_rows:
        return 1, max(rows, 1)
    chunk_rows = cdiv(rows, min(cdiv(target, blocks), rows // min_rows))
    return cdiv(rows, chunk_rows), chunk_rows


def gemm(handle: int, a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray,
         bias: cupy.ndarray | None, dtype: str,
         as_matrices: Callable[[cupy.ndarray], Matrices] = matrices) -> int:
    """``out[i] = a[i or 0] @ b[i or 0] (+ bias)`` into the C-contiguous ``(batch, m, n)``
    ``out`` on ``handle``, which must be in host pointer mode under :data:`PLAIN_MATH` (no TF32,
    no reduced-precision reductions); returns the launches. The bias is broadcast into ``out``
    and cuBLAS accumulates onto it (beta = 1); with ``k == 0`` the product is the bias, or
    zeros."""
    m, n, k = out.shape[1], out.shape[2], a.shape[2]
    launches = 0
    if bias is not None:
        bits(out)[...] = bits(bias)
        launches = 1
    elif k == 0 and out.size:
        bits(out).fill(0)  # all-zero bits are +0.0 in every float format
        launches = 1
    if out.size == 0 or k == 0:
        return launches
    a, b = as_matrices(a), as_matrices(b)
    if dtype == "float64":
        compute, one, zero = cublas.CUBLAS_COMPUTE_64F, _ONE64, _ZERO64
    else:
        # 32F, never a FAST_* type: fp32 data must not be rounded to TF32.
        compute, one, zero = cublas.CUBLAS_COMPUTE_32F, _ONE32, _ZERO32
    beta = zero if bias is None else one
    # Row-major out = a @ b is column-major out^T = b^T a^T. A row-major matrix read column-major
    # is its transpose, which is what the swapped product wants (OP_N); a transposed one is the
    # matrix itself, hence OP_T.
    op_b = cublas.CUBLAS_OP_T if b.transposed else cublas.CUBLAS_OP_N
    op_a = cublas.CUBLAS_OP_T if a.transposed else cublas.CUBLAS_OP_N
    data_type = DATA_TYPES[dtype]
    cublas.gemmStridedBatchedEx(
        handle, op_b, op_a, n, m, k,
        one.ctypes.data,
        b.array.data.ptr, data_type, b.ld, b.batch_stride,
        a.array.data.ptr, data_type, a.ld, a.batch_stride,
        beta.ctypes.data,
        out.data.ptr, data_type, n, m * n,
        out.shape[0], compute, cublas.CUBLAS_GEMM_DEFAULT,
    )
    return launches + 1


@contextlib.contextmanager
def plain_math(handle: int) -> Iterator[None]:
    """Within the block, ``handle`` is in host pointer mode, without TF32 and with
    reduced-precision reductions disallowed; its modes are restored after. CuPy's per-device
    handle is shared with other code, which may have left it in device pointer mode (our
    alpha/beta are host pointers), in TF32 math (which would round fp32 inputs) or allowing
    float16/bfloat16 split-K reductions in the output type (which would round partial sums)."""
    pointer = cublas.getPointerMode(handle)
    math = cublas.getMathMode(handle)
    plain = (math & ~_MATH_MODE_MASK if (math & _MATH_MODE_MASK) == _TF32_TENSOR_OP_MATH
             else math) | PLAIN_MATH
    if pointer != cublas.CUBLAS_POINTER_MODE_HOST:
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    if plain != math:
        cublas.setMathMode(handle, plain)
    try:
        yield
    finally:
        if pointer != cublas.CUBLAS_POINTER_MODE_HOST:
            cublas.setPointerMode(handle, pointer)
        if plain != math:
            cublas.setMathMode(handle, math)


def raw_module(filename: str) -> cupy.RawModule:
    """The RawModule of ``filename`` (a key of :data:`abftgemm.kernels.MODULES`); CuPy compiles
    it lazily and caches it per device."""
    return _module(kernels, filename, kernels.MODULES[filename])


@functools.cache
def _module(registry: ModuleType, filename: str, names: tuple[str, ...]) -> cupy.RawModule:
    """The RawModule of ``registry``'s ``filename`` with the name expressions ``names``."""
    return cupy.RawModule(code=registry.source(filename), options=registry.NVRTC_OPTIONS,
                          name_expressions=names)


@functools.cache
def typed_kernel(registry: ModuleType, filename: str, name: str, dtype: str,
                 device_id: int) -> cupy.RawKernel:
    """Template ``name`` of ``registry``'s ``filename`` (a kernel registry such as
    :mod:`abftgemm.kernels`: ``MODULES``, ``CUDA_TYPES``, ``NVRTC_OPTIONS``, ``source``,
    ``instance``) instantiated for NumPy dtype ``dtype`` on device ``device_id``; compiled with
    the source and options that ``scripts/compile_kernels.py`` checks in CI."""
    # Only this element type's templates: NVRTC compiles them on first use, not every type's.
    suffix = f"<{registry.CUDA_TYPES[dtype]}>"
    names = tuple(n for n in registry.MODULES[filename] if n.endswith(suffix))
    with cupy.cuda.Device(device_id):
        return _module(registry, filename, names).get_function(registry.instance(name, dtype))
