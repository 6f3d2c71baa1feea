"""The fused attention core's rules shared by its backends (:mod:`attention.fused` on the CPU,
:mod:`attention._cuda_fused` on the GPU): the thresholds of every check (derived in
:mod:`attention.fused`'s docstring), the booking of the kernels' per-task records into
``ctx.report``, and the dropout arguments the kernels take.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np

from abftgemm.backend import astype, to_host
from abftgemm.checksums import SUPPORTED_DTYPES, accumulation_dtype, smallest_normal, \
    unit_roundoff
from abftgemm.report import Event, UncorrectableError, announce
from abftgemm.thresholds import (KAPPA, magnitude_coefficient, safe_magnitude,
                                 threshold_coefficients)
from attention import _cpu_fused as K
from attention._cpu_vmath import EXP_FLUSH
from attention.context import Context
from attention.dropout import keep_scale, probability
from attention.dropout_hash import check_seed, draw_seed, threshold

_U64 = 2.0 ** -53

#: The fault hook's sites (and the report's), forward then backward.
FUSED_SITES = K.SITES
FORWARD_SITES = K.SITES[:4]
BACKWARD_SITES = K.SITES[:2] + K.SITES[4:]

#: What a flag at each site recomputes, for the report.
_RECOMPUTES = {"fused:S": "the S tile", "fused:P": "the P tile",
               "fused:O_acc": "the query block (all its tiles)",
               "fused:rowsum": "the query block (all its tiles)", "fused:dP": "the dP tile",
               "fused:dS": "the dS tile", "fused:dQ_acc": "the query block's dQ (its key sweep)",
               "fused:dK_acc": "the key block's dK and dV (its query sweep)",
               "fused:dV_acc": "the key block's dK and dV (its query sweep)"}


def coefficients(k: int, length: int, dtype: np.dtype, roundings: int = 0,
                 block: int = 0) -> np.ndarray:
    """``(c_obs, c_pred, floor, c_mag, safe)`` of one checked vector (:func:`_cpu_fused._ratio`).

    Parameters
    ----------
    k : int
        Inner dimension summed over (for an accumulator: all the tiles' terms).
    length : int
        Length of the vector the checksums sum over.
    dtype : numpy dtype
        The tiles' dtype (float32 or float64: :func:`attention.fused.work_dtype`).
    roundings : int
        Roundings the tiling adds to every element (see the module docstring).
    block : int
        For an accumulator of BLAS tile products, their inner length: the accumulation term is
        at least its rigorous bound ``block u`` (rounding one-sided within a tile product, as
        with one dominant key, exceeds the statistical ``KAPPA sqrt(k) u`` where ``k`` is
        short; 0: the statistical term alone).
    """
    return np.array(_coefficients(k, length, np.dtype(dtype), roundings, block))


@functools.lru_cache(maxsize=512)
def _coefficients(k: int, length: int, dtype: np.dtype, roundings: int,
                  block: int) -> tuple[float, ...]:
    """:func:`coefficients` as numbers, computed once per shape (each call of the fused core
    takes seven)."""
    c_obs, c_pred, floor, _ = threshold_coefficients(k, length, dtype)
    u = unit_roundoff(accumulation_dtype(dtype))
    c_pred += max(0.0, 1.01 * block * u - KAPPA * u * math.sqrt(max(k, 1)))
    return (c_obs, c_pred + roundings * u, floor,
            magnitude_coefficient(k + roundings, length, dtype),
            safe_magnitude(k + roundings, dtype))


def probs_tolerance(dtype: np.dtype) -> np.ndarray:
    """``(base, slope, flush, tiny)`` of the ``P`` check per entry: ``|log P_j - x_j| <= base +
    slope |x_j|`` in the CUDA kernels (an entry below ``tiny``, the smallest normal number,
    needs ``x < flush``); ``|P_j - e_j| <= base e_j + tiny`` on the CPU, ``e_j`` the
    exponential made again from the same ``x_j`` (0 below ``flush``), which no slope needs:
    the two agree within 4 u for every float32 ``x_j``."""
    u = unit_roundoff(dtype)
    flush = EXP_FLUSH if np.dtype(dtype) == np.float32 else math.log(smallest_normal(dtype))
    return np.array([8 * u, 8 * u, flush, smallest_normal(dtype)])


def dscores_tolerance(dtype: np.dtype, length: int = K.BC) -> np.ndarray:
    """``(c, tiny)`` of the CUDA kernels' ``dS`` invariants: ``c`` times a row's magnitude
    (``length``: keys per tile) plus ``tiny``, the smallest normal number, twice per entry
    (weighted by ``|dP|`` in the weighted invariant): their float32 arithmetic flushes
    subnormal numbers to 0 (CuPy compiles with ``-ftz=true``)."""
    return np.array([4 * unit_roundoff(dtype) + 4 * length * _U64, smallest_normal(dtype)])


def dscores_entry_tolerance(dtype: np.dtype) -> np.ndarray:
    """``(c, tiny)`` of the CPU's ``dS`` check, entry by entry: ``|dS - (P g - P D)| <= c (|P
    g| + |P D|) + tiny`` (``g`` is ``dP``), ``c = 8 u``: ``dS = fl(P fl(g - D))`` and ``fl(fl(P
    g) - fl(P D))`` each lie within ``2 u`` of that magnitude of the exact value; ``tiny``,
    the smallest normal number, covers subnormal products."""
    return np.array([8 * unit_roundoff(dtype), smallest_normal(dtype)])


def check_causal(causal: bool, seq_q: int, seq_k: int) -> None:
    """``causal`` (query ``i`` sees keys ``j <= i``) only for a square product: the rule of both
    cores and of the PyTorch entry points, which check it before they change the shapes."""
    if causal and seq_q != seq_k:
        raise ValueError(f"causal=True needs seq_q == seq_k (got {seq_q} and {seq_k}); pass the "
                         "mask instead")


def check_inputs(q: Any, k: Any, v: Any, scale: float | None, causal: bool,
                 finite: Callable[[Any], bool]) -> float:
    """The input checks both backends share, after each checked its array type and dtypes:
    3-D, C-contiguous, matching shapes, ``causal`` only for square products, finite data
    (``finite(t)``) and a positive finite scale, which is returned (default ``1 / sqrt(d)``)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 3:
            raise ValueError(f"{name} must be 3-D (batch * heads, seq, head_dim), got {t.shape}")
        if not t.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} must be (n, seq_q, d), "
                         "(n, seq_k, d), (n, seq_k, d)")
    if min(q.shape) < 1 or k.shape[1] < 1:
        raise ValueError(f"every dimension must be at least 1, got q {q.shape}, k {k.shape}")
    check_causal(causal, q.shape[1], k.shape[1])
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not finite(t):
            raise ValueError(f"{name} holds INF or NaN; the fused core takes finite data only "
                             "(attention.core passes non-finite inputs through)")
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def trusted(x: Any) -> bool:
    """The ``finite`` of :func:`check_inputs` and :func:`check_gradient` that reads nothing: the
    caller judged the data's finiteness already, or defers it."""
    return True


def check_gradient(xp: Any, d_out: Any, q: Any, finite: Callable[[Any], bool]) -> None:
    """``d_out`` must be a C-contiguous, finite ``xp`` array of ``q``'s shape and dtype."""
    if not isinstance(d_out, xp.ndarray) or d_out.shape != q.shape or d_out.dtype != q.dtype:
        raise ValueError(f"d_out must be a {xp.__name__} array of shape {q.shape} and dtype "
                         f"{q.dtype}, got {type(d_out).__name__} {getattr(d_out, 'shape', None)} "
                         f"{getattr(d_out, 'dtype', None)}")
    if not d_out.flags.c_contiguous:
        raise ValueError("d_out must be C-contiguous")
    if not finite(d_out):
        raise ValueError("d_out holds INF or NaN; the fused core takes finite data only")


def key_visible_of(xp: Any, key_visible: Any, q: Any, k: Any) -> Any:
    """``key_visible`` as a C-contiguous ``(n, seq_k)`` bool array of ``xp``, checked."""
    key_visible = xp.asarray(key_visible)
    if key_visible.dtype != bool or key_visible.shape != (q.shape[0], k.shape[1]):
        raise ValueError(f"key_visible must be a bool array of shape {(q.shape[0], k.shape[1])},"
                         f" got {key_visible.dtype} {key_visible.shape}")
    return xp.ascontiguousarray(key_visible)


def mask_groups(shape: tuple[int, ...], rows: int, seq_q: int, seq_k: int) -> int:
    """The groups ``m`` of an ``attn_mask`` of ``shape``: 1 for ``(seq_q, seq_k)``, ``m`` for
    ``(m, seq_q, seq_k)`` with ``m`` dividing ``rows`` (one mask per row, or per group of rows:
    the ``rows / m`` consecutive rows ``b`` with ``b // (rows / m) = i`` read mask ``i``, as a
    batch item's heads share its mask); ``ValueError`` for any other shape."""
    if tuple(shape) == (seq_q, seq_k):
        return 1
    if len(shape) == 3 and tuple(shape[1:]) == (seq_q, seq_k) and shape[0] >= 1 \
            and rows % shape[0] == 0:
        return shape[0]
    raise ValueError(f"attn_mask must have shape {(seq_q, seq_k)} or (m, {seq_q}, {seq_k}) with "
                     f"m dividing {rows} (per row, or per group of rows: a batch item's heads), "
                     f"got {tuple(shape)}")


def additive_of(xp: Any, attn_mask: Any, q: Any, k: Any, read_values: bool = True) -> Any:
    """``attn_mask`` (float, ``(seq_q, seq_k)`` or ``(m, seq_q, seq_k)`` with ``m`` dividing
    ``n``: heads ``b`` with ``b // (n / m) = i`` read mask ``i``, as the heads of one batch item
    share its mask; added to the scaled scores, ``-inf`` = not allowed) as a C-contiguous
    float64 ``(m, seq_q, seq_k)`` array of ``xp`` (``m`` 1 for a 2-D mask), checked (its values
    by :func:`additive_ok` with ``read_values``)."""
    n, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    if not isinstance(attn_mask, xp.ndarray):
        raise TypeError(f"attn_mask must be a {xp.__name__} array, got "
                        f"{type(attn_mask).__name__}")
    if attn_mask.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"attn_mask must be a float array (added to the scores), got "
                        f"{attn_mask.dtype}")
    groups = mask_groups(attn_mask.shape, n, lq, lk)
    add = xp.ascontiguousarray(astype(attn_mask, np.float64).reshape((groups, lq, lk)))
    if read_values and not additive_ok(xp, add, q.dtype):
        raise ValueError(BAD_ADDITIVE)
    return add


def key_additive_of(xp: Any, key_add: Any, q: Any, k: Any, add: Any | None,
                    read_values: bool = True) -> tuple[Any, int]:
    """``(keys, heads)``: the per-key additive mask ``key_add`` (float, ``(m, seq_k)``, ``m``
    dividing ``n``: heads ``[h m', (h + 1) m')`` with ``m' = n / m`` share row ``h``, as the
    heads of one batch item share its key padding) as a C-contiguous float64 array of ``xp``,
    and ``m'``; its values checked with ``read_values``, alone and summed with ``add`` (the
    checked float64 additive mask ``(groups, seq_q, seq_k)``, or None) as the kernels sum them
    (:func:`key_additive_bad`)."""
    n, lk = q.shape[0], k.shape[1]
    if not isinstance(key_add, xp.ndarray):
        raise TypeError(f"key_add must be a {xp.__name__} array, got {type(key_add).__name__}")
    if key_add.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"key_add must be a float array (added to the scores), got "
                        f"{key_add.dtype}")
    if key_add.ndim != 2 or key_add.shape[1] != lk or not key_add.shape[0] \
            or n % key_add.shape[0]:
        raise ValueError(f"key_add must have shape (m, {lk}) with m dividing {n}, got "
                         f"{key_add.shape}")
    keys = xp.ascontiguousarray(astype(key_add, np.float64))
    if read_values and bool(to_host(key_additive_bad(xp, keys, add, q.dtype))):
        raise ValueError(BAD_ADDITIVE)
    return keys, n // keys.shape[0]


def key_additive_bad(xp: Any, keys: Any, add: Any | None, dtype: np.dtype) -> Any:
    """:func:`additive_bad` of the float64 per-key mask ``keys`` ``(m, seq_k)`` and of its sums
    with ``add`` ``(m', seq_q, seq_k)`` (None: none), the mask the kernels add, as a 0-d
    bool array of ``xp``, not read: each head's largest sum is its column maxima of ``add`` plus
    its row of ``keys`` (O(L) memory, no folded array)."""
    bad = additive_bad(xp, keys, dtype)
    if add is None or not add.size:
        return bad
    # the groups of heads: add's m_a and keys' m_k each divide n, and so does their lcm; head
    # b's rows are add[b // (n / m_a)] and keys[b // (n / m_k)], the same pairs as over lcm heads
    groups = math.lcm(add.shape[0], keys.shape[0])
    tops = xp.repeat(add.max(axis=1), groups // add.shape[0], axis=0)
    return bad | additive_bad(xp, tops + xp.repeat(keys, groups // keys.shape[0], axis=0), dtype)


#: Why an additive mask is refused (:func:`additive_ok`).
BAD_ADDITIVE = ("attn_mask holds NaN, +inf or values beyond the tile arithmetic's largest number "
                "(the fused core takes -inf for \"not allowed\" and finite values)")


def additive_ok(xp: Any, add: Any, dtype: np.dtype) -> bool:
    """Whether the float64 mask ``add`` holds no NaN and nothing above the largest number of the
    tile arithmetic of ``dtype`` data (float64 for float64, else float32): a score pushed to
    ``+inf`` would leave the softmax undefined."""
    return not bool(to_host(additive_bad(xp, add, dtype)))


def additive_bad(xp: Any, add: Any, dtype: np.dtype) -> Any:
    """``not additive_ok(...)`` as a 0-d bool array of ``xp``, not read."""
    top = np.finfo(np.float64 if dtype == np.float64 else np.float32).max
    return xp.any(xp.isnan(add) | (add > top))


def book(ctx: Context, rec: np.ndarray, status: np.ndarray, batch_of: Any,
          sites: tuple[str, ...], check: bool) -> None:
    """Turn the kernels' records ``rec`` ``(tasks, sites, FIELDS)`` (NumPy; fields of
    :mod:`attention._cpu_fused`) and per-task ``status`` into events of ``ctx.report`` (task ``t``
    is of batch ``batch_of(t)``); raise if any task failed (status < 0)."""
    if not check:
        return
    count_checked(ctx, sites)
    book_findings(ctx, rec, status, batch_of)


def count_checked(ctx: Context, sites: tuple[str, ...]) -> None:
    """One more check of each of ``sites`` in ``ctx.report``."""
    for site in sites:
        ctx.report.checked[site] = ctx.report.checked.get(site, 0) + 1


def book_findings(ctx: Context, rec: np.ndarray, status: np.ndarray, batch_of: Any) -> None:
    """:func:`book`'s events and its raise, without counting the checks."""
    report = ctx.report
    non_finite = False  # a tile still INF or NaN after its recomputation
    for t, s in zip(*np.nonzero(rec[:, :, K.FLAGS])):
        r = rec[t, s]
        site = K.SITES[s]
        row, col = int(r[K.ROW]), int(r[K.COL])
        located = r[K.FLAGS] == 1 and row >= 0 and col >= 0
        failed = bool(r[K.FAILED])
        if ctx.check == "detect":
            action, verified = "reported", "left in place (check='detect')"
        elif failed:
            non_finite = non_finite or not math.isfinite(r[K.AFTER])
            action = "reported"
            verified = (f"recomputed {_RECOMPUTES[site]}, which still failed its check: worst "
                        f"|d|/threshold {r[K.AFTER]:.3g}")
        else:
            action = "recomputed"
            verified = (f"recomputed {_RECOMPUTES[site]} and checked it again: worst "
                        f"|d|/threshold {r[K.AFTER]:.3g}")
        event = Event(site=site, batch=int(batch_of(t)), pattern="0D" if located else "2D",
                      rows=(row,) if row >= 0 else (), cols=(col,) if col >= 0 else (),
                      magnitude=float(r[K.MAG]), threshold=float(r[K.TAU]), action=action,
                      verified=verified)
        report.events.append(event)
        if ctx.check == "detect":
            announce(event)
    if (status < 0).any():
        raise UncorrectableError(
            "the fused attention core could not verify a recomputed tile" + (
                "; it still holds INF or NaN, which an overflow of the tile arithmetic (float32 "
                "for 16-bit data) also gives (the unfused core, core='unfused', passes an "
                "overflow through as plain math gives it)" if non_finite else ""), report)


def dropout_of(p: float, seed: int | None) -> tuple[float, int] | None:
    """``(p, seed)`` of a call's dropout, checked (None for ``p == 0``)."""
    p = probability(p)
    if p == 0.0:
        return None
    return p, int(check_seed(draw_seed(None) if seed is None else seed))


def kernel_dropout(drop: tuple[float, int] | None, dt: np.dtype) -> tuple[Any, Any, Any]:
    """The kernels' ``(seed, thr, ks)``: ``thr`` 0 for no dropout; ``ks`` the
    :func:`attention.dropout.keep_scale` of ``p`` in the data's dtype."""
    if drop is None:
        return np.uint64(0), np.uint64(0), dt.type(1)
    p, seed = drop
    return np.uint64(seed), threshold(p), dt.type(keep_scale(p))
