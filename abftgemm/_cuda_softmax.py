"""CuPy launcher of the fused masked softmax + score checksum kernel (``kernels/softmax.cu``).

One read of the raw attention scores gives both the probabilities and the five row checksum
statistics that :func:`abftgemm._cuda.CupyBackend.row_reduce` would give with ``coef=None``
(DESIGN.md section 3: verifying the scores inside the softmax costs nothing extra). The CPU path
of the attention layer computes the same two results with NumPy.

Imports CuPy at the top: import it only once CuPy arrays are in play. bfloat16 arrays are CuPy
arrays of dtype ``ml_dtypes.bfloat16``; this module only copies their bits and runs its own kernel
on them, never CuPy arithmetic.
"""
from __future__ import annotations

import functools

import cupy
import numpy

from abftgemm import kernels
from abftgemm._cuda import _INT32_MAX, _bits, _cdiv

_BLOCK = 256  # 8 warps per block, one warp per score row


def softmax_rows(
    scores: cupy.ndarray,
    scale: float,
    key_mask: cupy.ndarray | None,
    causal: bool,
    heads: int,
    seq: int,
    *,
    probs: cupy.ndarray | None = None,
    stats: cupy.ndarray | None = None,
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Masked softmax of ``scale * scores`` and checksum statistics of the raw ``scores`` rows.

    Parameters
    ----------
    scores
        ``(batch*heads, seq, seq)`` raw attention scores ``Q_h K_h^T`` (not yet scaled), dtype
        float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or float64; matrix ``bh`` belongs to
        batch ``bh // heads``, row ``i`` is query ``i``, column ``j`` key ``j``. Copied to C order
        first if it is not C-contiguous.
    scale
        Positive factor applied to the scores before the softmax, ``1 / sqrt(head_dim)``. It is
        rounded to float32 for 16/32-bit scores (as ``float32_array * python_float`` is in NumPy)
        and used as is for float64.
    key_mask
        None, or ``(batch, seq)`` booleans (other dtypes are converted), True where the key is
        visible to every query of that batch element.
    causal
        If true, key ``j`` is hidden from query ``i`` when ``j > i``.
    heads, seq
        Number of heads and sequence length.
    probs, stats
        Optional outputs to overwrite instead of allocating: C-contiguous, of the shapes and
        dtypes returned.

    Returns
    -------
    probs
        ``(batch*heads, seq, seq)``, dtype of ``scores``, C-contiguous: softmax over the visible
        keys of each row (computed in float32, float64 for float64 scores), 0 at hidden keys, all
        0 in a row without a visible key. NaN scores are ignored by the row maximum and make every
        visible probability of their row NaN; a visible +INF gives NaN at that key and 0
        elsewhere (plain float arithmetic, see ``kernels/softmax.cu``).
    stats
        ``(batch*heads, seq, 5)`` float64, per raw score row ``v`` of length ``seq`` (every entry,
        hidden or not): ``[sum v, sum ((l+1)/seq) v, sum |v|, #non-finite v, last non-finite
        index or -1]``, exactly the fields of ``abft_row_reduce`` with ``coef=None``.
    """
    scores, key_mask, rows = _check(scores, key_mask, heads, seq)
    dtype = scores.dtype.name
    with scores.device:
        probs = _output(probs, scores.shape, scores.dtype, "probs")
        stats = _output(stats, scores.shape[:2] + (5,), numpy.dtype(numpy.float64), "stats")
        if rows == 0 or seq == 0:
            return probs, stats
        kernel = _kernel(scores.device.id, dtype)
        blocks = min(_cdiv(rows, _BLOCK // 32), _INT32_MAX)
        kernel((blocks,), (_BLOCK,),
               (scores, numpy.int64(rows), numpy.int32(seq), numpy.int32(seq),
                numpy.int32(heads), numpy.float64(scale), key_mask,
                numpy.int32(1 if causal else 0), probs, stats))
    return probs, stats


def _check(
    scores: cupy.ndarray, key_mask: cupy.ndarray | None, heads: int, seq: int
) -> tuple[cupy.ndarray, cupy.ndarray | None, int]:
    """Validated C-contiguous scores, bool C-contiguous key mask (or None), and the row count."""
    if scores.dtype.name not in kernels.CUDA_TYPES:
        raise TypeError(f"softmax_rows needs one of {sorted(kernels.CUDA_TYPES)} (bfloat16 as "
                        f"ml_dtypes.bfloat16), got {scores.dtype}")
    if heads < 1 or seq < 0 or seq > _INT32_MAX or heads > _INT32_MAX:
        raise ValueError(f"bad heads={heads} or seq={seq}")
    if scores.ndim != 3 or scores.shape[1:] != (seq, seq) or scores.shape[0] % heads:
        raise ValueError(f"scores must be (batch*heads, {seq}, {seq}) with heads={heads}, "
                         f"got {scores.shape}")
    batch = scores.shape[0] // heads
    if not scores.flags.c_contiguous:
        # Through unsigned bits: CuPy has no bfloat16 copy kernel to rely on.
        scores = cupy.ascontiguousarray(_bits(scores)).view(scores.dtype)
    if key_mask is not None:
        if key_mask.shape != (batch, seq):
            raise ValueError(f"key_mask must be ({batch}, {seq}), got {key_mask.shape}")
        with scores.device:
            key_mask = cupy.ascontiguousarray(cupy.asarray(key_mask, dtype=bool))
    return scores, key_mask, scores.shape[0] * seq


def _output(out: cupy.ndarray | None, shape: tuple[int, ...], dtype: numpy.dtype,
            name: str) -> cupy.ndarray:
    """``out`` after checking it, or a fresh array (on the current device)."""
    if out is None:
        return cupy.empty(shape, dtype=dtype)
    if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous {dtype} of shape {shape}, "
                         f"got {out.dtype} {out.shape}")
    return out


@functools.cache
def _softmax_module() -> cupy.RawModule:
    """The RawModule of softmax.cu; CuPy compiles it lazily and caches it per device.

    Same options and name expressions as ``scripts/compile_kernels.py`` checks in CI.
    """
    return cupy.RawModule(
        code=kernels.source(kernels.SOFTMAX_FILE),
        options=kernels.NVRTC_OPTIONS,
        name_expressions=kernels.MODULES[kernels.SOFTMAX_FILE],
    )


@functools.cache
def _kernel(device_id: int, dtype: str) -> cupy.RawKernel:
    """``abft_softmax_rows<T>`` for NumPy dtype name ``dtype`` on device ``device_id``."""
    with cupy.cuda.Device(device_id):
        return _softmax_module().get_function(kernels.instance(kernels.SOFTMAX_ROWS, dtype))
