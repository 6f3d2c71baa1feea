"""GPU workspaces and launches of a planned product (abftgemm/kernels/plan.cu).

Everything is allocated when the plan is made: the accumulators and counters of the two verification
kernels (which leave them zeroed for the next execute), the observed checksums, the cumulative
verdict in a slot of the plan's verdict ledger (:mod:`abftgemm.verdicts`), and a cuBLAS handle of
the plan's own under :data:`abftgemm.cuda_kernels.PLAIN_MATH`, so that no shared handle state is
read or changed per call. An execute is the GEMM (a bias adds one broadcast copy before it) and two
kernel launches, with no allocation and no synchronization. Operands that cuBLAS cannot read in
place are copied (an allocation per execute, as for an unplanned product).
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import cupy
import numpy
from cupy_backends.cuda.libs import cublas

from abftgemm import kernels
from abftgemm.checksums import encoding_of
from abftgemm.cuda_kernels import PLAIN_MATH, cdiv, gemm, matrices, raw_module, split_rows

if TYPE_CHECKING:
    from abftgemm._cuda import CupyBackend
    from abftgemm.backend import ColumnThresholds

_THREADS = 256  # PLAN_THREADS in plan.cu
_SLAB = 32  # SLAB in plan.cu
_MIN_CHUNK_ROWS = 64  # shortest row chunk worth a block of its own
_BLOCKS_PER_SM = 4  # blocks per SM the grids aim for


class CudaWorkspace:
    """Device workspaces, kernels and cuBLAS handle of one planned product."""

    def __init__(self, backend: CupyBackend, op: Any, counters: Any,
                 thresholds: ColumnThresholds | None, verdicts: Any):
        self._backend = backend
        self._counters = counters
        self._dtype = op.dtype.name
        self._handle = cublas.create()
        # destroyed by release(), or when the workspace is collected without one (not at
        # interpreter exit, where the CUDA context may be gone first and takes it along)
        self._destroy_handle = weakref.finalize(self, cublas.destroy, self._handle)
        self._destroy_handle.atexit = False
        cublas.setPointerMode(self._handle, cublas.CUBLAS_POINTER_MODE_HOST)
        cublas.setMathMode(self._handle, PLAIN_MATH)
        self._stream = cupy.cuda.get_current_stream()  # where the last execute ran
        if thresholds is None:
            return
        self._coefficients, self._safe = thresholds
        batch, m, k, n = op.batch, op.m, op.k, op.n
        target = _BLOCKS_PER_SM * cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._slabs = cdiv(k, _SLAB)
        # One a for every batch item is encoded once: batch blocks fewer, so more row chunks.
        self._a_items = 1 if op.a.shape[0] == 1 else batch
        self._a_chunks, self._a_chunk_rows = split_rows(self._a_items * self._slabs, m, target,
                                                        _MIN_CHUNK_ROWS)
        self._tiles = cdiv(n, 32 * (16 // op.dtype.itemsize))  # TILE in plan.cu
        self._c_chunks, self._c_chunk_rows = split_rows(batch * self._tiles, m, target,
                                                        _MIN_CHUNK_ROWS)
        self._enc_acc = self._zeros((self._a_items, self._slabs, 3, _SLAB), numpy.float64)
        self._slab_count = self._zeros((self._a_items, self._slabs), numpy.uint32)
        self._pred = self._zeros((batch, 3, n), numpy.float64)
        self._acc = self._zeros((batch, 3, n), numpy.float64)
        self._bad_count = self._zeros((batch, n), numpy.int32)
        self._tile_count = self._zeros((batch, self._tiles), numpy.uint32)
        self._obs = self._zeros((3, batch, n), numpy.float64)
        self._verdict = verdicts.reserve(2)  # cumulative (flagged, unverifiable) columns
        self._verdict_seen = numpy.zeros(2, numpy.uint64)
        self._enc_given: cupy.ndarray | None = None
        self._enc_used: cupy.ndarray | None = None  # the whole encoding the last predict read
        self._bias: cupy.ndarray | None = None
        self._predict, self._observe_flag = (
            raw_module(kernels.PLAN_FILE).get_function(kernels.instance(name, self._dtype))
            for name in (kernels.PLAN_PREDICT, kernels.PLAN_OBSERVE_FLAG))

    def _zeros(self, shape: tuple[int, ...], dtype: Any) -> cupy.ndarray:
        self._counters.allocations += 1
        return cupy.zeros(shape, dtype=dtype)

    def release(self) -> None:
        """Destroy the plan's cuBLAS handle (the arrays go with the workspace object)."""
        self._destroy_handle()  # once; later calls do nothing
        self._handle = None

    def gemm(self, op: Any, c: cupy.ndarray, triangle: str | None = None) -> None:
        """On the plan's handle and the current stream; the whole product, whatever ``triangle``
        promises (as the backend's ``gemm``)."""
        self._stream = cupy.cuda.get_current_stream()
        cublas.setStream(self._handle, self._stream.ptr)
        self._counters.launches += gemm(self._handle, op.a, op.b, c, op.bias, self._dtype,
                                        self._matrices)

    def _matrices(self, x: cupy.ndarray) -> Any:
        """:func:`abftgemm.cuda_kernels.matrices`, a copy (an unusable layout) counted."""
        mats = matrices(x)
        self._counters.allocations += mats.array is not x
        return mats

    def encode(self, a: cupy.ndarray) -> None:
        """The column reduction of ``a``, then the encoding out of it (a counted copy)."""
        self._counters.launches += 1
        self._counters.allocations += 2
        self._counters.copies += 1
        full = cupy.empty((a.shape[0], a.shape[2], 5), dtype=numpy.float64)
        self._backend.col_reduce(a, None, full)
        self._enc_given = encoding_of(full)

    def set_encoding(self, cols: cupy.ndarray) -> None:
        """Read ``cols`` in place (its field vectors contiguous)."""
        self._enc_given = cols

    def predict(self, op: Any, encode_a: bool) -> None:
        """None for an empty product or inner dimension: ``pred`` stays zero, and the observation
        adds the bias terms."""
        self._bias = op.bias
        self._enc_used = None if encode_a else self._enc_given
        if self._slabs == 0 or self._pred.size == 0:
            return
        self._counters.launches += 1
        a, b = self._matrices(op.a), self._matrices(op.b)
        enc, batch = self._enc_used, self._pred.shape[0]
        if enc is not None:
            enc_args = (enc, numpy.int64(enc.strides[1] // 8), numpy.int64(enc.strides[0] // 8),
                        numpy.int32(enc.shape[1]))
            items, chunks, chunk_rows = batch, 1, op.m
        else:
            enc_args = (None, numpy.int64(0), numpy.int64(0), numpy.int32(0))
            items, chunks, chunk_rows = self._a_items, self._a_chunks, self._a_chunk_rows
        self._predict(
            (items * self._slabs * chunks,), (_THREADS,),
            (a.array, numpy.int64(a.batch_stride), numpy.int64(a.ld), numpy.int32(a.transposed),
             numpy.int32(op.a.shape[0]),
             b.array, numpy.int64(b.batch_stride), numpy.int64(b.ld), numpy.int32(b.transposed),
             numpy.int32(op.b.shape[0]), *enc_args, self._enc_acc, self._slab_count, self._pred,
             numpy.int32(op.m), numpy.int32(op.k), numpy.int32(op.n), numpy.int32(self._slabs),
             numpy.int32(chunks), numpy.int32(chunk_rows), numpy.int32(batch)))

    def observe_flag(self, c: cupy.ndarray) -> None:
        """Adds to the cumulative verdict (no launch for a product without columns)."""
        batch, m, n = c.shape
        if batch == 0 or n == 0:
            return
        self._counters.launches += 1
        c_obs, c_pred, floor, c_mag = (numpy.float64(x) for x in self._coefficients)
        vector = n % (16 // c.itemsize) == 0 and c.data.ptr % 16 == 0
        self._observe_flag(
            (batch * self._tiles * self._c_chunks,), (_THREADS,),
            (c, self._bias, self._acc, self._bad_count, self._tile_count,
             self._pred, c_obs, c_pred, floor, c_mag, numpy.float64(self._safe), self._obs,
             self._verdict.device, numpy.int32(batch), numpy.int32(m), numpy.int32(n),
             numpy.int32(self._tiles),
             numpy.int32(self._c_chunks), numpy.int32(self._c_chunk_rows), numpy.int32(vector)))

    def abandon(self) -> None:
        """The cumulative counts restart from zero (an asynchronous memset on the current stream,
        after the abandoned execute's kernels)."""
        self._verdict.clear()
        self._verdict_seen[...] = 0

    def ready_verdict(self) -> None:
        """Make the current stream wait for the execute's when they differ."""
        current = cupy.cuda.get_current_stream()
        if current.ptr != self._stream.ptr:
            current.wait_event(self._stream.record())

    def verdict_flagged(self) -> bool:
        """Whether the cumulative verdict's host copy changed since its previous read."""
        host = self._verdict.host
        changed = bool((host != self._verdict_seen).any())
        self._verdict_seen[...] = host
        return changed

    def a_encoding(self) -> cupy.ndarray | None:
        """None when the predict kernel encoded ``a`` itself (it keeps only partial sums)."""
        return self._enc_used

    def observed_cols(self) -> cupy.ndarray:
        """The workspace the observation wrote."""
        return self._obs
