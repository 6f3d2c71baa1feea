"""CuPy launchers of the attention core's softmax kernels (``kernels/softmax.cu``).

:func:`forward` and :func:`backward` each run one kernel over the rows of the
``(batch*heads, seq_q, seq_k)`` operands: the fused clean path reads its inputs once, writes the
output, the row checksums a :class:`abftgemm.ProtectedMatmul` consumer owes (``stats``) and
the invariant verdict (:class:`DeviceVerdict`), with no host synchronization and no
``(batch*heads, seq_q, seq_k)`` temporary. The visibility of a key is recomputed in the kernel from
the key-padding mask, causality and the additive attention mask.

Imports CuPy at the top: import it only once CuPy arrays are in play. bfloat16 arrays
(``ml_dtypes.bfloat16``) are only handed to the kernels, never to CuPy arithmetic.
"""
from __future__ import annotations

from typing import Any

import cupy
import numpy

from abftgemm.cuda_kernels import INT32_MAX, cdiv, typed_kernel
from abftgemm.verdicts import Slot
from attention import kernels
from attention.kernels import softmax_structs as S

_BLOCK = 256  # 8 warps per block, one warp per row
_UINT32_MAX = 2**32 - 1  # the verdict packs a row index into 32 bits


class DeviceVerdict:
    """The verdict of one invariant check, on the device until :meth:`read`.

    ``slot`` (one uint64 of a verdict ledger, :mod:`abftgemm.verdicts`) is 0 when every row
    passed, else ``(ratio rounded up to float32) << 32 | row`` of the worst failing row;
    ``details`` ``(rows, 2)`` float64 holds ``(error, tolerance)`` of each failing row (written
    by failing rows only).
    """

    def __init__(self, slot: Slot, details: cupy.ndarray):
        self.slot, self.details = slot, details
        self.worst = slot.device  # what the kernels write

    def reset(self) -> None:
        """Clear the verdict before a launch (an asynchronous memset, no kernel)."""
        self.slot.clear()

    def read(self) -> tuple[bool, float, float]:
        """``(ok, worst error, its tolerance)``: the slot as the ledger's last fetch copied it
        (the pass's settle), or fetched now when a launch came after it; the details of a failed
        check are one more host read (counted in the ledger's ``counters.host_reads``)."""
        key = int(self.slot.read()[0])
        if key == 0:
            return True, 0.0, 0.0
        self.slot.ledger.counters.host_reads += 1
        err, tol = (float(v) for v in self.details[key & _UINT32_MAX].get())
        return False, err, tol


def forward(scores: cupy.ndarray, probs: cupy.ndarray, *, scale: float, heads: int,
            key_visible: cupy.ndarray | None, attn_add: cupy.ndarray | None, causal: bool,
            compute: bool, check: bool, floor: float, p_min: float,
            tolerances: tuple[float, float, float],
            stats: cupy.ndarray | None, verdict: DeviceVerdict) -> None:
    """Masked softmax of ``scale * scores (+ attn_add)`` into ``probs`` and/or its check.

    Parameters
    ----------
    scores, probs : (batch*heads, seq_q, seq_k), C-contiguous, one dtype (float16, bfloat16,
        float32, float64)
        Raw scores ``Q_h K_h^T`` and the probabilities (output when ``compute``, input otherwise).
    scale : float
        ``1 / sqrt(head_dim)``, rounded to the arithmetic type (float32 below float64).
    heads : int
        Matrix ``t`` belongs to batch element ``t // heads``.
    key_visible : (batch, seq_k) bool, optional
        True = the key may be attended.
    attn_add : (1 or batch*heads, seq_q, seq_k) float64, optional
        Added to the scaled scores; -inf hides the key.
    causal : bool
        Key ``j`` is hidden from query ``i`` when ``j > i``.
    compute, check : bool
        Compute ``probs``; judge the invariants on what ``probs`` holds (at least one).
    floor, p_min : float
        Entries at or below ``max(floor * top, p_min)`` skip the log identity (``top`` the row's
        largest probability, ``p_min`` the smallest normal number of the probabilities' dtype).
    tolerances : (row_tol, log_base, log_slope)
        See :func:`attention.softmax.forward_tolerances`.
    stats : (batch*heads, seq_q, 5) float64, optional
        Receives the raw scores' row checksums.
    verdict : DeviceVerdict
        Reset and filled when ``check``.
    """
    bh, seq_q, seq_k = scores.shape
    _check_rows(scores, probs, bh * seq_q, seq_k, stats)
    if key_visible is not None:
        _need(key_visible, (bh // heads, seq_k), numpy.dtype(bool), "key_visible")
    stride = 0
    if attn_add is not None:
        _need(attn_add, (attn_add.shape[0], seq_q, seq_k), numpy.dtype(numpy.float64), "attn_add")
        stride = 0 if attn_add.shape[0] == 1 else seq_q * seq_k
    if check:
        verdict.reset()
    rows = bh * seq_q
    if rows == 0 or seq_k == 0:
        return
    row_tol, log_base, log_slope = tolerances
    tol = S.FORWARD_TOLERANCES(floor=floor, p_min=p_min, row_tol=row_tol, log_base=log_base,
                               log_slope=log_slope)
    with scores.device:
        _kernel(scores.device.id, kernels.SOFTMAX_FORWARD, scores.dtype.name)(
            (_blocks(rows),), (_BLOCK,),
            (scores, probs, key_visible, attn_add, stats, verdict.worst, verdict.details,
             _rows(scores, causal), S.MASK_INDEX(attn_stride=stride, heads=heads),
             numpy.float64(scale), S.MODE(compute=compute, check=check), tol))


def backward(dp: cupy.ndarray, p: cupy.ndarray, *, scale: float, compute: bool, check: bool,
             u: float, tiny: float, ds: cupy.ndarray | None, ds_acc: cupy.ndarray | None,
             stats: cupy.ndarray | None, verdict: DeviceVerdict, causal: bool = False,
             keep: cupy.ndarray | None = None, keep_scale: float = 1.0) -> None:
    """``dS = P (dP - rowsum(P dP))``, dP's row checksums, the invariants, the scaling.

    Parameters
    ----------
    dp, p : (rows, seq_q, seq_k), C-contiguous, one dtype
    scale : float
        ``ds`` receives ``scale * dS``.
    compute : bool
        Compute dS from ``dp`` and ``p`` (storing it unscaled into ``ds_acc`` if given), or take
        it from ``ds_acc``.
    check : bool
        Judge the invariants on the unscaled dS.
    u, tiny : float
        A row's tolerance is ``u * (its terms' magnitudes) + tiny``
        (:func:`attention.softmax.backward_tolerance`).
    ds : like ``dp``, optional
        Receives ``scale * dS``.
    ds_acc : like ``dp`` in the arithmetic dtype (float32, float64 for float64), optional
        The unscaled dS: output when ``compute``, input otherwise.
    stats : (rows, seq_q, 5) float64, optional
        Receives dP's row checksums.
    verdict : DeviceVerdict
        Reset and filled when ``check``.
    causal : bool
        Row ``i`` of ``P`` is zero from key ``i + 1`` on: computed ``dS`` is 0 there, whatever
        ``dP`` holds, and those entries stay out of ``r``; the check takes ``P`` and ``dP`` there
        as 0 (unread) and ``dS`` in its plain sums only.
    keep : (rows, seq_q, seq_k) bool, optional
        Attention dropout's mask (True = kept): ``dp`` is then the gradient of the dropped
        probabilities (its row checksums are those observed) and dS and its invariants take the
        gradient of the probabilities before dropout, ``dp * keep * keep_scale``.
    keep_scale : float
        ``1 / (1 - dropout)``.
    """
    rows, seq_q, seq_k = dp.shape
    _check_rows(dp, p, rows * seq_q, seq_k, stats)
    if keep is not None:
        _need(keep, dp.shape, numpy.dtype(bool), "keep")
    acc = numpy.dtype(numpy.float64 if dp.dtype == numpy.float64 else numpy.float32)
    if ds is not None or not compute:
        _need(ds, dp.shape, dp.dtype, "ds")
    if ds_acc is not None or not compute:
        _need(ds_acc, dp.shape, acc, "ds_acc")
    if ds is None and ds_acc is None:
        raise ValueError("backward needs an output: ds, ds_acc or both")
    if check:
        verdict.reset()
    n = rows * seq_q
    if n == 0 or seq_k == 0:
        return
    with dp.device:
        _kernel(dp.device.id, kernels.SOFTMAX_BACKWARD, dp.dtype.name)(
            (_blocks(n),), (_BLOCK,),
            (dp, p, keep, ds_acc, ds, stats, verdict.worst, verdict.details, _rows(dp, causal),
             numpy.float64(scale), numpy.float64(keep_scale), S.MODE(compute=compute, check=check),
             S.BACKWARD_TOLERANCE(u=u, tiny=tiny)))


def _check_rows(x: cupy.ndarray, y: cupy.ndarray, rows: int, length: int,
                stats: cupy.ndarray | None) -> None:
    """The two row operands, the stats output and the index ranges the kernels assume."""
    if x.dtype.name not in kernels.CUDA_TYPES:
        raise TypeError(f"softmax kernels need one of {sorted(kernels.CUDA_TYPES)} (bfloat16 as "
                        f"ml_dtypes.bfloat16), got {x.dtype}")
    if x.ndim != 3:
        raise ValueError(f"softmax kernels take (batch*heads, seq_q, seq_k), got {x.shape}")
    _need(x, x.shape, x.dtype, "scores/dP")
    _need(y, x.shape, x.dtype, "probs/P")
    if stats is not None:
        _need(stats, x.shape[:2] + (5,), numpy.dtype(numpy.float64), "stats")
    if rows > _UINT32_MAX or length > INT32_MAX or max(x.shape) > INT32_MAX:
        raise ValueError(f"softmax kernels index rows in 32 bits, got {x.shape}")


def _rows(x: cupy.ndarray, causal: bool) -> numpy.ndarray:
    """The kernels' ``softmax::Rows`` of the ``(matrices, seq_q, seq_k)`` row operand ``x``."""
    matrices, seq_q, seq_k = x.shape
    return S.ROWS(n=matrices * seq_q, seq_q=seq_q, len=seq_k, causal=causal)


def _need(x: Any, shape: tuple[int, ...], dtype: numpy.dtype, name: str) -> None:
    if x is None or x.shape != tuple(shape) or x.dtype != dtype or not x.flags.c_contiguous:
        got = "None" if x is None else f"{x.dtype} {x.shape}"
        raise ValueError(f"{name} must be C-contiguous {dtype} of shape {tuple(shape)}, got {got}")


def _blocks(rows: int) -> int:
    return min(cdiv(rows, _BLOCK // 32), INT32_MAX)


def _kernel(device_id: int, name: str, dtype: str) -> cupy.RawKernel:
    """Template ``name`` of softmax.cu instantiated for NumPy dtype ``dtype`` on device
    ``device_id``."""
    return typed_kernel(kernels, kernels.SOFTMAX_FILE, name, dtype, device_id)
