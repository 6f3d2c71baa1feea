"""CuPy backend: the primitives of :mod:`abftgemm.backend` as direct cuBLAS strided-batched GEMM
and checksum reduction kernels. Imports CuPy at the top: :func:`abftgemm.backend.get_backend`
imports it only once CuPy arrays are in play.

Why not ``cupy.matmul``: batched fp16 ``cupy.matmul`` runs many times slower than cuBLAS called
directly and batched bf16 raises (bench/NOTES.md). bfloat16 arrays are CuPy 14 arrays whose dtype
is ``ml_dtypes.bfloat16``; this module never runs CuPy arithmetic on them, only bit-level copies,
cuBLAS and its own kernels.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import cupy
import numpy

from abftgemm import kernels
from abftgemm._cuda_plan import CudaWorkspace
from abftgemm.cuda_kernels import (DATA_TYPES, INT32_MAX, cdiv, gemm, matrices, plain_math,
                                   raw_module, split_rows)

if TYPE_CHECKING:
    from abftgemm.backend import ColumnThresholds

_ROW_BLOCK = 256  # abft_row_reduce: 8 warps per block, one warp per vector
_COL_BLOCK = (32, 8)  # abft_col_reduce: must match ROWS in reduce.cu
_COL_MIN_ROWS = 256  # shortest column chunk worth a block of its own
_BLOCKS_PER_SM = 8  # resident 256-thread blocks per SM that keep memory busy


def _check_dtype(*arrays: cupy.ndarray) -> str:
    """The common dtype name of ``arrays``; TypeError unless they share a supported one."""
    names = {x.dtype.name for x in arrays}
    if len(names) != 1 or not names <= DATA_TYPES.keys():
        raise TypeError(f"CuPy backend needs one dtype among {sorted(DATA_TYPES)} (bfloat16 as "
                        f"ml_dtypes.bfloat16), got {sorted(names)}")
    return names.pop()


def _check_batch(name: str, nb: int, batch: int) -> None:
    """ValueError unless operand ``name`` has the full batch or broadcasts one matrix."""
    if nb not in (1, batch):
        raise ValueError(f"{name} has batch {nb}; expected 1 or {batch}")


def _check_gemm(a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray,
                bias: cupy.ndarray | None) -> str:
    """Validate :meth:`CupyBackend.gemm` operands; return the dtype name."""
    if a.ndim != 3 or b.ndim != 3 or out.ndim != 3:
        raise ValueError("gemm takes 3-D a, b and out")
    batch, m, n = out.shape
    if a.shape[1] != m or b.shape[2] != n or a.shape[2] != b.shape[1]:
        raise ValueError(f"gemm shapes do not match: {a.shape} @ {b.shape} -> {out.shape}")
    _check_batch("a", a.shape[0], batch)
    _check_batch("b", b.shape[0], batch)
    if not out.flags.c_contiguous:
        raise ValueError("gemm needs a C-contiguous out")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias has shape {bias.shape}; expected ({n},)")
    return _check_dtype(a, b, out, *(() if bias is None else (bias,)))


def _check_reduce(x: cupy.ndarray, coef: cupy.ndarray | None, out: cupy.ndarray, length: int,
                  vectors: int) -> None:
    """Validate reduction operands for vectors of ``length`` elements, ``vectors`` per matrix."""
    _check_dtype(x)
    batch = out.shape[0]
    if out.dtype != numpy.float64 or out.shape != (batch, vectors, 5):
        raise ValueError(f"out must be float64 of shape (batch, {vectors}, 5), got {out.shape}")
    if not out.flags.c_contiguous:
        raise ValueError("reductions need a C-contiguous out")
    _check_batch("x", x.shape[0], batch)
    if max(batch, vectors, length) > INT32_MAX:
        raise ValueError("reduction dimensions must fit in int32")
    if coef is not None:
        if (coef.dtype != numpy.float64 or coef.ndim != 3 or coef.shape[0] != 3
                or coef.shape[2] != length):
            raise ValueError(f"coef must be float64 of shape (3, batch or 1, {length})")
        if length > 1 and coef.strides[2] != 8:
            raise ValueError("coef must be an encoding whose field vectors are contiguous")
        _check_batch("coef", coef.shape[1], batch)


class CupyBackend:
    """The :class:`abftgemm.backend.Backend` primitives on one CUDA device."""

    name = "cupy"
    xp = cupy

    def __init__(self, device_id: int) -> None:
        self._sm_count = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
        self._kernels: dict[str, cupy.RawKernel] = {}

    def gemm(
        self, a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray, bias: cupy.ndarray | None,
        triangle: str | None = None, out_triangle: str | None = None,
    ) -> None:
        """Through ``cublasGemmStridedBatchedEx`` (:func:`abftgemm.cuda_kernels.gemm`).
        ``triangle`` and ``out_triangle`` are not used yet: the whole product runs (block-skipping
        launches are for when they can be measured on a GPU), and :meth:`row_limits` says so."""
        dtype = _check_gemm(a, b, out, bias)
        if out.size == 0:
            return
        handle = cupy.cuda.device.get_cublas_handle()  # shared: its modes restored after
        with plain_math(handle):
            gemm(handle, a, b, out, bias, dtype)

    def row_limits(self, m: int, n: int, dtype: Any) -> None:
        """None: an ``out_triangle`` product is computed whole here (see :meth:`gemm`), so
        nothing calls the CPU's ``predict_lower_rows`` or ``complete_lower`` here."""
        return None

    def synchronize(self) -> None:
        """Wait for the current stream (where every launch of this backend goes)."""
        cupy.cuda.get_current_stream().synchronize()

    def plan_workspace(self, op: Any, counters: Any, thresholds: ColumnThresholds | None,
                       verdicts: Any) -> CudaWorkspace:
        """Workspaces and launches of a planned product (:mod:`abftgemm._cuda_plan`)."""
        return CudaWorkspace(self, op, counters, thresholds, verdicts)

    def col_reduce(self, x: cupy.ndarray, coef: cupy.ndarray | None, out: cupy.ndarray) -> None:
        """See :mod:`abftgemm.backend`: ``x`` ``(batch or 1, r, c)``, ``out`` ``(batch, c, 5)``."""
        self._reduce(x, coef, out, along_rows=False)

    def row_reduce(self, x: cupy.ndarray, coef: cupy.ndarray | None, out: cupy.ndarray) -> None:
        """See :mod:`abftgemm.backend`: ``x`` ``(batch or 1, r, c)``, ``out`` ``(batch, r, 5)``."""
        self._reduce(x, coef, out, along_rows=True)

    def both_reduce(self, x: cupy.ndarray, col_coef: cupy.ndarray | None,
                    row_coef: cupy.ndarray | None, out_col: cupy.ndarray,
                    out_row: cupy.ndarray) -> None:
        """Column and row reductions of ``x`` (two kernel launches, each reading ``x`` once)."""
        self.col_reduce(x, col_coef, out_col)
        self.row_reduce(x, row_coef, out_row)

    def flag(self, pred: cupy.ndarray, obs: cupy.ndarray,
             coefficients: tuple[float, float, float, float], safe: float, counts: cupy.ndarray,
             out: tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray] | None = None,
             ) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
        """One launch of abft_flag (reduce.cu); ``counts`` is int64 ``(bad, unverifiable)`` and
        the arrays of ``out`` contiguous."""
        if pred.shape != obs.shape or pred.shape[-1] != 5:
            raise ValueError(f"pred {pred.shape} and obs {obs.shape} must match, (..., 5)")
        pred, obs = cupy.ascontiguousarray(pred), cupy.ascontiguousarray(obs)
        shape = pred.shape[:-1]
        tau, bad, verifiable = out if out is not None else (
            cupy.empty(shape, dtype=numpy.float64), cupy.empty(shape, dtype=bool),
            cupy.empty(shape, dtype=bool))
        n = tau.size
        if n:
            c_obs, c_pred, floor, c_mag = (numpy.float64(c) for c in coefficients)
            kernel = self._kernel(kernels.FLAG)
            kernel((min(cdiv(n, 256), 4096),), (256,),
                   (pred, obs, c_obs, c_pred, floor, c_mag, numpy.float64(safe), numpy.int64(n),
                    tau, bad, verifiable, counts))
        return tau, bad, verifiable

    def _reduce(self, x: cupy.ndarray, coef: cupy.ndarray | None, out: cupy.ndarray,
                along_rows: bool) -> None:
        """Launch the kernel that suits ``x``'s storage: abft_row_reduce for vectors contiguous
        in memory (one warp each), abft_col_reduce for vectors strided by ``ld`` (long ones
        split across blocks)."""
        if x.ndim != 3:
            raise ValueError("reductions take a 3-D x")
        _, r, c = x.shape
        length, vectors = (c, r) if along_rows else (r, c)
        _check_reduce(x, coef, out, length, vectors)
        if out.size == 0:
            return
        mats = matrices(x)
        # the encoding read in place: its batch and field strides in elements
        coef_stride, coef_fstride = (0, 0) if coef is None else (
            0 if coef.shape[1] == 1 else coef.strides[1] // 8, coef.strides[0] // 8)
        args = (mats.array, numpy.int64(mats.batch_stride), numpy.int64(mats.ld),
                coef, numpy.int64(coef_stride), numpy.int64(coef_fstride), out)
        batch, dtype = out.shape[0], x.dtype.name
        if along_rows != mats.transposed:
            blocks = min(cdiv(batch * vectors, _ROW_BLOCK // 32), INT32_MAX)
            kernel = self._kernel(kernels.instance(kernels.ROW_REDUCE, dtype))
            kernel((blocks,), (_ROW_BLOCK,),
                   args + (numpy.int32(batch), numpy.int32(vectors), numpy.int32(length)))
            return
        col_blocks = cdiv(vectors, _COL_BLOCK[0])
        chunks, chunk_rows = split_rows(batch * col_blocks, length,
                                        _BLOCKS_PER_SM * self._sm_count, _COL_MIN_ROWS)
        if chunks > 1:
            total = batch * vectors
            init = self._kernel(kernels.REDUCE_INIT)
            init((min(cdiv(total, 256), INT32_MAX),), (256,), (out, numpy.int64(total)))
        kernel = self._kernel(kernels.instance(kernels.COL_REDUCE, dtype))
        kernel((batch * chunks * col_blocks,), _COL_BLOCK,
               args + (numpy.int32(vectors), numpy.int32(length), numpy.int32(col_blocks),
                       numpy.int32(chunks), numpy.int32(chunk_rows)))

    def _kernel(self, name: str) -> cupy.RawKernel:
        """Kernel ``name`` of reduce.cu on this device (compiled on first use, then cached)."""
        if name not in self._kernels:
            self._kernels[name] = raw_module(kernels.REDUCE_FILE).get_function(name)
        return self._kernels[name]


_backend_for = functools.cache(CupyBackend)  # one backend per device id


def backend() -> CupyBackend:
    """The backend of the current CUDA device (one instance per device, cached)."""
    return _backend_for(cupy.cuda.runtime.getDevice())
