"""numba kernels of the fused protected attention core (CPU); see :mod:`attention.fused`.

Two drivers hold the loops, :func:`_forward_block` (one query block of one head) and
:func:`_backward_head` (one head); everything elementwise, every tile product and every check
is a leaf ``njit`` function they call. Each driver is a plain Python function compiled as well:
the compiled one runs inside the ``prange`` kernels (:func:`forward`, :func:`backward`) with
:func:`no_hook` as the global ``_HOOK``, and the Python one (:func:`python_drivers`) runs,
block after block, when a fault hook must see the internal tiles (it calls the same compiled
leaves, so both paths share every check).

Sites (indices into the per-task records ``rec[task, site, field]``): see :data:`SITES`.
Record fields: ``FLAGS`` detections, ``FAILED`` recomputation did not verify, ``RATIO`` the worst
``|d| / tau`` found, ``MAG`` and ``TAU`` its difference and threshold, ``ROW``/``COL`` the
located element (global indices; -1 where none), ``AFTER`` the worst ratio after recomputation.
"""
from __future__ import annotations

import math
import types
from collections import namedtuple
from typing import Any

import numba
import numpy as np

from abftgemm.cpu_kernels import (blas_gemm, row_sums_into, sum_column_prefix, sum_columns,
                                  twins, wide_vectors)
from attention._cpu_vmath import exp_like, exp_unflushed, from_ordered_key, like, ordered_key
from attention.dropout_hash import GAMMA, MIX1, MIX2, SHIFT

#: Query rows and keys per tile.
BR = 128
BC = 128

SITES = ("fused:S", "fused:P", "fused:O_acc", "fused:rowsum", "fused:dP", "fused:dS",
         "fused:dQ_acc", "fused:dK_acc", "fused:dV_acc")
S_, P_, O_, L_, DP_, DS_, DQ_, DK_, DV_ = range(len(SITES))
#: The fault hook's sites: the checked ones, and the dropped probabilities ``P * keep / (1 - p)``
#: (forward and backward), which the ``O_acc`` and ``dV_acc`` checks cover (:mod:`attention.fused`).
HOOK_SITES = SITES + ("fused:dropout",)
DROP_ = len(SITES)
FLAGS, FAILED, RATIO, MAG, TAU, ROW, COL, AFTER = range(8)
FIELDS = 8

#: The kernels' arguments, grouped (numba takes named tuples of arrays and scalars). ``kt``:
#: :func:`transpose_blocks` of ``k``; ``ve``: the row encodings ``(n, 3, L)`` of ``v``
#: (:func:`encode_rows`; an empty ``(n, 3, 0)`` unchecked); ``o``, ``lse`` and ``lse_lo``: the
#: forward's output and log-sum-exp as two numbers (:func:`_finish`). The backward makes what it
#: needs of each head itself, where the head reads it anyway: the key blocks' transposes
#: (:func:`_key_block`), ``rowsum(dO * O)`` and the row encodings of ``q``, ``k`` and ``dO``
#: (:func:`_head_rows`).
ForwardOperands = namedtuple("ForwardOperands", "q k kt v ve")
BackwardOperands = namedtuple("BackwardOperands", "q k v do o lse lse_lo")
#: ``visible`` ``(n, Lk)`` bool or an empty ``(1, 0)``; ``add`` ``(m, Lq, Lk)`` float64 (``m``
#: divides ``n``; head ``b`` reads ``add[b // add_heads]``) or an empty ``(1, 0, 0)``, ``hidden``
#: its :func:`hidden_tiles` (or an empty ``(1, 0, 0)``); ``keys`` a per-key additive mask ``(m',
#: Lk)`` float64 (head ``b`` reads row ``b // key_heads``) or an empty ``(1, 0)``;
#: ``hidden_keys`` ``(n, key blocks)`` bool, the key blocks that ``visible`` and ``keys`` hide
#: throughout from head ``b`` (or an empty ``(1, 0)``); ``scale`` in the data's dtype.
Mask = namedtuple("Mask", "visible add add_heads hidden keys key_heads hidden_keys scale causal")
#: Whether to check and correct, the sites' coefficients (:func:`attention.fused_rules.
#: coefficients`) and tolerances, and the rows of a tile product per BLAS call
#: (:func:`attention._cpu_tile_gemm.gemm_rows`).
ForwardRules = namedtuple("ForwardRules", "check correct c_s c_o c_l tol_p rows")
BackwardRules = namedtuple("BackwardRules", "check correct c_s c_kv c_q tol_p tol_ds rows")
#: :func:`_keep_tile`'s ``seed`` and ``thr`` (0: no dropout), ``ks = 1 / (1 - p)``.
Dropout = namedtuple("Dropout", "seed thr ks")
ForwardOutputs = namedtuple("ForwardOutputs", "out lse lse_lo sums")
Gradients = namedtuple("Gradients", "dq dk dv dqc kvc")

#: Reassociation and contraction let LLVM vectorize the sums (not ``fastmath=True``: the checks
#: must see NaN and INF).
_FAST = {"reassoc", "contract"}


@numba.njit(cache=True)
def no_hook(site: int, tile: Any) -> None:
    """The compiled path's hook: nothing."""


# ------------------------------------------------------------------ tile products


@numba.njit(cache=True, fastmath=_FAST)
def _rescale(acc: Any, alpha: Any) -> None:
    """``acc = alpha[:, None] * acc``: the forward's output rows, before a tile's ``P V`` adds to
    them (:func:`abftgemm.cpu_kernels.blas_gemm`, ``beta`` 1)."""
    for r in range(acc.shape[0]):
        s = alpha[r]
        o = acc[r]
        for c in range(acc.shape[1]):
            o[c] *= s


@numba.njit(cache=True, fastmath=_FAST)
def _carry(a: Any, keep: Any, ks: Any, enc: Any, off: int, alpha: Any, acc: Any,
           transpose: bool) -> None:
    """The checksum columns beside a product, float64: ``acc = alpha * acc + a_d @ E`` with ``E =
    enc[:, off:off + cols]^T`` (``acc`` rows x 3; a fourth column, if any, also receives the row
    sums of ``a``: the forward's independent ``sum p``, and a fifth those of ``a_d``: the sums of
    the kept probabilities), or with ``transpose`` ``acc^T += a_d^T @
    E``, ``E = enc[:, off:off + rows]^T`` (``acc`` 3 x at least cols). ``enc`` ``(3, L)``: row
    encodings of the other operand, one contiguous row per checksum, so the loops over ``a``'s
    rows vectorize. ``a_d`` is ``a``, or with dropout (``keep`` a non-empty 0/1 tile of ``a``'s
    shape) ``fl(a ks) keep``, made here from ``a`` and ``keep`` entry by entry exactly as
    :func:`_drop` makes the tile the product reads, never read from that tile."""
    rows, cols = a.shape
    drop = keep.shape[0] > 0
    if transpose and not drop:
        sum_column_prefix(a, (enc[0, off:off + rows], enc[1, off:off + rows],
                              enc[2, off:off + rows]), 0, rows, acc, cols)
        return
    if transpose:
        a0, a1, a2 = acc[0], acc[1], acc[2]
        for r in range(rows):
            e0, e1, e2 = enc[0, off + r], enc[1, off + r], enc[2, off + r]
            ar = a[r]
            if drop:
                kr = keep[r]
                for j in range(cols):
                    x = np.float64(ar[j] * ks) * np.float64(kr[j])
                    a0[j] += x * e0
                    a1[j] += x * e1
                    a2[j] += abs(x) * e2
            else:
                for j in range(cols):
                    x = np.float64(ar[j])
                    a0[j] += x * e0
                    a1[j] += x * e1
                    a2[j] += abs(x) * e2
        return
    width = acc.shape[1]
    e0, e1, e2 = enc[0, off:off + cols], enc[1, off:off + cols], enc[2, off:off + cols]
    if alpha.size:
        for r in range(rows):
            s = np.float64(alpha[r])
            for f in range(width):
                acc[r, f] *= s
    for r in range(0, rows, 2):
        r2 = min(r + 1, rows - 1)  # an odd last row pairs with itself, its twin's sums unused
        sums = _pair_sums(a, keep, ks, drop, r, r2, e0, e1, e2)
        t0, t1, t2, t3, t4, u0, u1, u2, u3, u4 = sums
        acc[r, 0] += t0
        acc[r, 1] += t1
        acc[r, 2] += t2
        if width > 3:
            acc[r, 3] += t3
        if width > 4:
            acc[r, 4] += t4 if drop else t3
        if r2 > r:
            acc[r2, 0] += u0
            acc[r2, 1] += u1
            acc[r2, 2] += u2
            if width > 3:
                acc[r2, 3] += u3
            if width > 4:
                acc[r2, 4] += u4 if drop else u3


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _pair_sums(a: Any, keep: Any, ks: Any, drop: bool, r: int, r2: int, e0: Any, e1: Any,
               e2: Any) -> tuple:
    """:func:`_carry`'s float64 sums of rows ``r`` and ``r2`` of ``a`` (``a_d . e0``, ``a_d .
    e1``, ``|a_d| . e2``, ``sum a`` and, with ``drop``, ``sum a_d``; 0 without) in one pass: two
    rows share the loads of ``E`` (faster than one, three or four rows a pass:
    bench/NOTES.md)."""
    ar, br = a[r], a[r2]
    t0 = t1 = t2 = t3 = t4 = u0 = u1 = u2 = u3 = u4 = 0.0
    for j in range(a.shape[1]):
        x, y = np.float64(ar[j]), np.float64(br[j])
        t3 += x
        u3 += y
        if drop:
            x = np.float64(ar[j] * ks) * np.float64(keep[r, j])
            y = np.float64(br[j] * ks) * np.float64(keep[r2, j])
            t4 += x
            u4 += y
        t0 += x * e0[j]
        u0 += y * e0[j]
        t1 += x * e1[j]
        u1 += y * e1[j]
        t2 += abs(x) * e2[j]
        u2 += abs(y) * e2[j]
    return t0, t1, t2, t3, t4, u0, u1, u2, u3, u4


# ------------------------------------------------------------------ encodings and observation


@numba.njit(cache=True, parallel=True)
def encode_rows(x: Any, out: Any) -> None:
    """Row encodings ``(n, 3, L)`` of every head of ``x`` ``(n, L, d)`` (weights over ``d``)."""
    for b in numba.prange(x.shape[0]):
        _observe_rows(x[b], out[b].T)


@numba.njit(cache=True, parallel=True)
def transpose_blocks(x: Any, out: Any) -> None:
    """``out[b, d j0 : d j1]`` = ``x[b, j0:j1]^T`` as a C-contiguous ``(d, j1 - j0)`` block, for
    every key block ``[j0, j1)`` of :data:`BC` keys of every head of ``x`` ``(n, L, d)`` (``out``
    ``(n, L d)``): the right operand of the forward's ``S = Q K^T``, which every query block of
    a head reads."""
    for b in numba.prange(x.shape[0]):
        _transpose_head(x, out, b)


def _hidden_tiles(add: Any, out: Any) -> None:
    """``out[g, i, j]``: whether the additive mask ``add[g]`` is ``-inf`` throughout the tile of
    query block ``i`` and key block ``j`` (``out`` ``(m, query blocks, key blocks)``). Such a
    tile adds nothing to any result (its probabilities are exactly 0: the running max, the
    denominators, the outputs and their carried checksums stay as they were, and so do the
    gradients), so the kernels skip it, as the causal triangle's upper tiles: the tiles a
    sliding window or packed sequences hide cost nothing."""
    for g in numba.prange(add.shape[0]):
        for i in range(out.shape[1]):
            for j in range(out.shape[2]):
                out[g, i, j] = _all_minus_inf(add[g, i * BR:(i + 1) * BR, j * BC:(j + 1) * BC])


@numba.njit(cache=True)
def _all_minus_inf(tile: Any) -> bool:
    """Every entry of ``tile`` is ``-inf`` (the first other one ends the scan)."""
    for r in range(tile.shape[0]):
        for c in range(tile.shape[1]):
            if tile[r, c] != -np.inf:
                return False
    return True


#: :func:`_hidden_tiles` over numba's pool (its masks in parallel), and its serial twin.
hidden_tiles, _hidden_tiles_serial = twins(_hidden_tiles, cache=True)


@numba.njit(cache=True, inline="always")
def _skipped(hidden: Any, add_heads: int, hidden_keys: Any, b: int, i0: int, j0: int) -> bool:
    """Whether head ``b``'s tile of query block ``i0`` and key block ``j0`` adds nothing: its
    additive mask's tile is ``-inf`` throughout (:func:`hidden_tiles`), or its keys are all
    hidden (``hidden_keys``: key padding). The kernels skip it."""
    return (hidden.shape[1] > 0 and hidden[b // add_heads, i0 // BR, j0 // BC]) or (
        hidden_keys.shape[1] > 0 and hidden_keys[b, j0 // BC])


@numba.njit(cache=True)
def _transpose_head(x: Any, out: Any, b: int) -> None:
    """Head ``b`` of :func:`transpose_blocks`."""
    L, d = x.shape[1], x.shape[2]
    for j0 in range(0, L, BC):
        j1 = min(j0 + BC, L)
        _transpose_block(x[b, j0:j1], _block_t(out, b, j0, j1, d))


@numba.njit(cache=True)
def _transpose_block(src: Any, out: Any) -> None:
    """``out`` ``(d, w)`` = ``src^T`` (``src`` ``(w, d)``), C-contiguous: a key block as the right
    operand of ``S = Q K^T`` or ``dP = dO V^T`` in the layout BLAS multiplies fastest (a
    transposed view runs OpenBLAS's slower ``NT`` kernels: bench/NOTES.md)."""
    for c in range(src.shape[1]):  # rows of the block written in order, faster than columns
        row = out[c]
        for j in range(src.shape[0]):
            row[j] = src[j, c]


@numba.njit(cache=True, inline="always")
def _block_t(xt: Any, b: int, j0: int, j1: int, d: int) -> Any:
    """The block ``x[b, j0:j1]^T`` of :func:`transpose_blocks`' output ``xt``."""
    return xt[b, d * j0:d * j1].reshape((d, j1 - j0))


@numba.njit(cache=True)
def _weights(n: int) -> Any:
    """The location weights ``(r + 1) / n`` of ``n`` vectors."""
    w = np.empty(n)
    for r in range(n):
        w[r] = (r + 1) / n
    return w


@numba.njit(cache=True)
def _col_sums(x: Any, w: Any, out: Any) -> None:
    """``out`` ``(3, cols)`` = the column sums of ``x`` (rows x cols) over its rows: plain,
    weighted by ``w`` (:func:`_weights` of the rows), of ``|x|``, in float64 (the column encoding
    of an operand block, and the observed column checksums of a tile): the GEMM checks' kernel
    (:func:`abftgemm.cpu_kernels.sum_columns`, eight rows per update of the sums)."""
    out[:] = 0.0
    sum_columns(x, w, 0, x.shape[0], out)


@numba.njit(cache=True, fastmath=_FAST)
def _predict(x: Any, enc: Any, out: Any) -> None:
    """``out[v] = (x_v . enc_0, x_v . enc_1, |x_v| . enc_2)`` for each row ``x_v`` of ``x``: the
    predicted checksums of the vectors of ``x @ B^T`` (or ``A @ x^T``) whose other operand's
    encoding is ``enc`` ``(3, d)``."""
    row_sums_into(x, enc, out)


@numba.njit(cache=True, fastmath=_FAST)
def _observe_rows(t: Any, out: Any) -> None:
    """``out[r] = (sum_j t_rj, sum_j w_j t_rj, sum_j |t_rj|)``, ``w_j = (j + 1) / cols``: the
    observed row checksums of a tile, and the row encoding of an operand block (the weights
    made once, not a division per entry)."""
    row_sums_into(t, _weights(t.shape[1]), out)


# ------------------------------------------------------------------ judging


@numba.njit(cache=True)
def _ratio(p0: float, p1: float, p2: float, o0: float, o1: float, o2: float,
           coef: Any) -> tuple[float, float, float]:
    """``(|d| / tau, |d|, tau)`` of one vector: predicted ``(p0, p1, p2)`` (plain, weighted,
    ``S``) against observed ``(o0, o1, o2)`` (plain, weighted, ``sum |.|``), ``coef = (c_obs,
    c_pred, floor, c_mag, safe)`` (:func:`attention.fused.coefficients`). Inputs that are not
    finite make the vector unverifiable (ratio 0); a non-finite observation is a fault unless
    ``S`` reaches ``safe``; the magnitude bound ``sum |.| <= c_mag S + floor`` catches errors that
    cancel in both sums."""
    if not (math.isfinite(p0) and math.isfinite(p1) and math.isfinite(p2)):
        return 0.0, 0.0, 1.0
    tau = coef[0] * o2 + coef[1] * p2 + coef[2]
    if not (math.isfinite(o0) and math.isfinite(o1) and math.isfinite(o2)):
        return (0.0, 0.0, 1.0) if p2 >= coef[4] else (math.inf, math.inf, tau)
    d = max(abs(p0 - o0), abs(p1 - o1))
    mag = o2 / (coef[3] * p2 + coef[2])
    return max(d / tau, mag), d, tau


@numba.njit(cache=True)
def _judge(pred: Any, obs: Any, n: int, coef: Any, info: Any) -> float:
    """The worst ratio over ``n`` vectors; ``info = (ratio, |d|, tau, vector, position)`` of the
    worst, ``position`` located from the two sums (``len * d_w / d - 1``; -1 when it is not
    within 0.25 of an integer, or the vector's length ``info[5]`` is unknown)."""
    worst = 0.0
    info[0], info[3], info[4] = 0.0, -1.0, -1.0
    for v in range(n):
        r, d, tau = _ratio(pred[v, 0], pred[v, 1], pred[v, 2], obs[v, 0], obs[v, 1], obs[v, 2],
                           coef)
        if r > worst or (r != r):
            worst = r if r == r else math.inf
            info[0], info[1], info[2], info[3] = worst, d, tau, v
            d0 = pred[v, 0] - obs[v, 0]
            pos = info[5] * (pred[v, 1] - obs[v, 1]) / d0 - 1 if d0 != 0 else -1.0
            info[4] = round(pos) if math.isfinite(pos) and abs(pos - round(pos)) <= 0.25 \
                and 0 <= round(pos) < info[5] else -1.0
    return worst


@numba.njit(cache=True)
def _rowsum_ratio(oc: Any, l: Any, coef: Any, info: Any) -> float:
    """The running softmax denominators ``l`` (summed in the data's dtype, tile by tile, and
    rescaled) against ``sum p`` carried in float64 beside the output's checksums (``oc[:, 3]``):
    a fault in ``l`` or in the rescaling shows here. Returns the worst ratio; ``info`` as
    :func:`_judge` (vector = row)."""
    worst = 0.0
    info[0], info[3], info[4] = 0.0, -1.0, -1.0
    for r in range(l.shape[0]):
        x, y = np.float64(l[r]), oc[r, 3]
        e, d, tau = _ratio(y, y, y, x, x, x, coef)
        if not e <= worst:
            worst = e if e == e else np.inf
            info[0], info[1], info[2], info[3] = worst, d, tau, r
    return worst


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _probs_excess(pv: Any, x: Any, t0: Any, flush: Any, tiny: Any, half: Any,
                  zero: Any) -> tuple:
    """``(excess, tol)`` of one entry of the softmax check, ``pv`` the stored ``P``, ``x = z -
    m``: ``excess = |pv - e| - tol`` (at most 0 when it holds; NaN for a NaN ``pv`` or ``x``)
    with ``e = exp(x / 2)^2``, 0 below the flush (where :func:`exp_like` flushes too), and
    ``tol = t0 e + tiny``. The exponential made again at half the argument shares no
    intermediate value with the one it checks, and lies within 4 u of it for every float32
    ``x`` above the flush (float64: 2.5 u), half of ``t0`` (bench/NOTES.md). Selects and
    arithmetic, no branch, so the tile's loop vectorizes."""
    h = exp_unflushed(max(x, flush) * half)  # a NaN x stays NaN (Python's max), and so does e
    e = zero if x < flush else h * h
    tol = t0 * e + tiny
    return abs(pv - e) - tol, tol


@numba.njit(cache=True, inline="always")
def _measured(ex: Any, t: Any, tiny: float) -> tuple:
    """``(ratio, |d|, tau)`` for the report of an entry whose check gave ``(excess, tol)`` =
    ``(ex, t)`` (:func:`_probs_excess`, :func:`_dscores_excess`): ratio 0 when it holds; a NaN
    excess (a NaN entry, or a NaN argument) is ratio and ``|d|`` INF, as :func:`_ratio`
    reports every non-finite observation (``|d| = nan`` said nothing), against ``t`` or, where
    a NaN argument made ``t`` NaN too, ``tiny``, the least tolerance of an entry."""
    tau = np.float64(t)
    if ex <= 0:
        return 0.0, np.float64(ex) + tau, tau
    if ex > 0:
        mag = np.float64(ex) + tau
        return mag / tau, mag, tau
    return np.inf, np.inf, tiny if math.isnan(tau) else tau


@numba.njit(cache=True, fastmath=_FAST)
def _probs_ratio(z: Any, p: Any, m: Any, tol: Any, info: Any) -> float:
    """The softmax check of a tile, judged on what was stored, entry by entry: ``p_ij =
    exp(z_ij - m_i)`` within ``tol[0]`` of it, relatively, plus ``tol[3]``, the smallest
    normal number (``m`` the running max forward, ``lse_lo``
    backward, where ``z`` holds ``z - lse``); below the exponential's flush ``tol[2]`` the
    entry must be at most ``tol[3]``; a row with ``m_i = -inf`` (no visible key) must be 0.
    The exponential is made again at half the argument and squared (:func:`_probs_excess`),
    one float32 pass of the tile for float32 data. Returns 0 when every entry holds, else the
    worst ratio ``|p_ij - e_ij|`` to its tolerance (at least 1; INF for NaN) with ``info`` as
    :func:`_judge` (vector = row, position = key)."""
    wide_vectors()
    rows, cols = p.shape
    t0, flush, tiny = like(p, tol[0]), like(p, tol[2]), like(p, tol[3])
    half, zero = like(p, 0.5), like(p, 0.0)
    bad = zero
    for r in range(rows):
        mr, zr, pr = m[r], z[r], p[r]
        if mr == -np.inf:
            for j in range(cols):
                bad += like(p, pr[j] != 0)
            continue
        for j in range(cols):
            ex, _ = _probs_excess(pr[j], zr[j] - mr, t0, flush, tiny, half, zero)
            bad += zero if zero > ex else ex  # one vmaxps(0, ex): a NaN ex stays
    if bad == 0:
        return 0.0
    worst = 0.0
    info[0], info[1], info[2], info[3], info[4] = 0.0, 0.0, 1.0, -1.0, -1.0
    for r in range(rows):  # rare: locate and measure for the report
        mr = m[r]
        for j in range(cols):
            pv = p[r, j]
            if mr == -np.inf:  # a NaN entry: |d| INF, as every non-finite observation (_ratio)
                mag = abs(np.float64(pv)) if pv == pv else np.inf
                e, tau = (0.0 if pv == 0 else np.inf), 0.0
            else:
                ex, t = _probs_excess(pv, z[r, j] - mr, t0, flush, tiny, half, zero)
                e, mag, tau = _measured(ex, t, tol[3])
            if e > worst:
                worst = max(e, 1.0 + 2.0 ** -20)
                info[0], info[1], info[2], info[3], info[4] = worst, mag, tau, r, j
    return worst


@numba.njit(cache=True, fastmath=_FAST, inline="always")
def _dscores_excess(dsv: Any, pv: Any, g: Any, x: Any, c: Any, tiny: Any, zero: Any) -> tuple:
    """``(excess, tol)`` of one entry of the ``dS`` check: ``dS = p (g - D)`` made again as ``p
    g - p D`` (another rounding, no intermediate value shared), ``excess = |dS - (p g - p D)| -
    tol`` with ``tol = c (|p g| + |p D|) + tiny`` (NaN for a NaN entry)."""
    pg = pv * g
    pd = pv * x
    d = dsv - (pg - pd)
    tol = c * (abs(pg) + abs(pd)) + tiny
    return abs(d) - tol, tol


@numba.njit(cache=True, fastmath=_FAST)
def _dscores_ratio(ds: Any, p: Any, dp: Any, dd: Any, keep: Any, ks: Any, tol: Any,
                   info: Any) -> float:
    """The ``dS`` check of a tile, entry by entry: each ``dS_ij = p_ij (g_ij - D_i)`` (made by
    :func:`_dscores`) lies within ``tol[0] (|p_ij g_ij| + |p_ij D_i|) + tol[1]`` of ``p_ij g_ij
    - p_ij D_i`` (both roundings are at most ``2 u`` of that magnitude; ``tol[0]`` is ``8 u``).
    ``g`` is ``dP``, or with dropout (``keep`` non-empty) ``fl(dP' ks)`` where kept, else 0, of
    the product ``dP'`` (made here as :func:`_dscores` makes it). Returns 0 when every entry
    holds, else the worst ratio to its tolerance (at least 1; INF for NaN) with ``info`` as
    :func:`_judge` (vector = row, position = key). A tile the first pass flags is judged again
    in float64, which also decides entries whose products ``P g`` and ``P D`` overflow the
    data's dtype while ``dS`` does not (``P`` a little above 1, ``g`` and ``D`` near its
    largest number)."""
    wide_vectors()
    rows, cols = ds.shape
    drop = keep.shape[0] > 0
    c, tiny, zero = like(ds, tol[0]), like(ds, tol[1]), like(ds, 0.0)
    bad = zero
    for r in range(rows):
        x = dd[r]
        for j in range(cols):
            g = (dp[r, j] * ks if keep[r, j] else zero) if drop else dp[r, j]
            ex, _ = _dscores_excess(ds[r, j], p[r, j], g, x, c, tiny, zero)
            bad += zero if zero > ex else ex
    if bad == 0:
        return 0.0
    worst = 0.0
    info[0], info[1], info[2], info[3], info[4] = 0.0, 0.0, 1.0, -1.0, -1.0
    for r in range(rows):  # rare: locate and measure for the report, in float64
        for j in range(cols):
            g = (dp[r, j] * ks if keep[r, j] else zero) if drop else dp[r, j]
            ex, t = _dscores_excess(np.float64(ds[r, j]), np.float64(p[r, j]), np.float64(g),
                                    np.float64(dd[r]), tol[0], tol[1], 0.0)
            e, mag, tau = _measured(ex, t, tol[1])
            if e > worst:
                worst = max(e, 1.0 + 2.0 ** -20)
                info[0], info[1], info[2], info[3], info[4] = worst, mag, tau, r, j
    return worst


# ------------------------------------------------------------------ softmax steps


@numba.njit(cache=True, fastmath=_FAST)
def _mask(s: Any, scale: Any, i0: int, j0: int, causal: bool, visible: Any, add: Any,
          keys: Any) -> None:
    """``s = scale * s (+ add + keys)`` in place, ``-inf`` where masked: keys ``j > i``
    (``causal``) and keys that ``visible`` (empty: all) hides. ``add`` ``(seq_q, seq_k)``
    float64 (or an empty ``(0, 0)``: none) and ``keys`` ``(seq_k,)`` float64, the per-key mask
    every query row adds (or empty: none), are summed in float64 first (:func:`_mask_row`), that
    sum added to the scaled score in float64 and the result rounded to the data's dtype, as the
    unfused softmax does with both folded into one float64 mask (:mod:`attention._cpu_softmax`):
    bit for bit the same scores."""
    rows, cols = s.shape
    ninf = like(scale, -np.inf)
    both = np.empty(cols if add.shape[1] and keys.size else 0)
    for r in range(rows):  # s[r, j], not a view of the row: a view costs two NRT calls
        lim = min(cols, i0 + r - j0 + 1) if causal else cols
        lim = max(lim, 0)
        for j in range(lim):
            s[r, j] *= scale
        if add.shape[1] or keys.size:
            extra = _mask_row(add, keys, i0 + r, j0, cols, both)
            for j in range(lim):
                s[r, j] = like(scale, s[r, j] + extra[j])
        for j in range(lim, cols):
            s[r, j] = ninf
        if visible.size:
            for j in range(lim):
                if not visible[j0 + j]:
                    s[r, j] = ninf


@numba.njit(cache=True)
def _mask_row(add: Any, keys: Any, i: int, j0: int, cols: int, both: Any) -> Any:
    """The float64 mask query row ``i`` adds to keys ``[j0, j0 + cols)``: ``add[i]``'s, or
    ``keys``', or (both given) their sum ``add[i, j] + keys[j]`` written into ``both`` (no
    ``fastmath``: the sum is rounded once, before the score is added, as a folded mask's)."""
    if not keys.size:
        return add[i, j0:j0 + cols]
    if not add.shape[1]:
        return keys[j0:j0 + cols]
    for j in range(cols):
        both[j] = add[i, j0 + j] + keys[j0 + j]
    return both


@numba.njit(cache=True, fastmath=_FAST)
def _new_max(z: Any, m: Any, alpha: Any) -> None:
    """Online softmax: ``m = max(m, rowmax z)`` and ``alpha = exp(m_old - m)`` (1 while a row
    has seen no visible key). The max is taken over :func:`ordered_key` integers, a reduction
    LLVM vectorizes (a float max with NaN's rules it does not); a NaN ``z`` (a fault after the
    scores' check) makes ``m`` NaN, which the probabilities' check then flags."""
    for r in range(z.shape[0]):
        top = ordered_key(m[r])
        row = z[r]
        for j in range(z.shape[1]):
            top = max(top, ordered_key(row[j]))
        mx = from_ordered_key(top)
        alpha[r] = exp_like(m[r] - mx) if mx > -np.inf else like(mx, 1.0)
        m[r] = mx


@numba.njit(cache=True, fastmath=_FAST)
def _exp_rows(z: Any, m: Any, p: Any) -> None:
    """``p = exp(z - m[:, None])``; 0 in rows with ``m = -inf`` (no visible key)."""
    wide_vectors()
    zero = like(m, 0.0)
    for r in range(z.shape[0]):
        mr = m[r]
        row, out = z[r], p[r]
        if mr == -np.inf:
            for j in range(z.shape[1]):
                out[j] = zero
        else:
            for j in range(z.shape[1]):
                out[j] = exp_like(row[j] - mr)


@numba.njit(cache=True, fastmath=_FAST)
def _sum_rows(p: Any, alpha: Any, l: Any) -> None:
    """``l = alpha * l + rowsum(p)`` (in ``p``'s dtype, as the softmax needs it)."""
    for r in range(p.shape[0]):
        t = like(l, 0.0)
        for j in range(p.shape[1]):
            t += p[r, j]
        l[r] = alpha[r] * l[r] + t


@numba.njit(cache=True, fastmath=_FAST)
def _finish(acc: Any, oc: Any, m: Any, l: Any, out: Any, lse: Any, lse_lo: Any) -> None:
    """``out = acc / l``, the carried checksums and kept sums (``oc[:, :3]``, ``oc[:, 4]``)
    likewise, and the log-sum-exp ``m + log l`` as
    two numbers of the data's dtype: ``lse``, it rounded, and ``lse_lo``, the rest (an exact
    two-sum in float64). Where ``m`` dwarfs ``log l`` (a row that an additive mask lowers at
    every key) ``lse`` alone loses ``log l``; the backward's ``P = exp((z - lse) - lse_lo)``
    keeps it. 0 and ``-inf`` (both) for rows without a visible key."""
    for r in range(acc.shape[0]):
        if l[r] > 0 and m[r] > -np.inf:  # m = -inf: no visible key, whatever a fault made l
            inv = l[r]
            for c in range(acc.shape[1]):
                out[r, c] = acc[r, c] / inv
            for f in (0, 1, 2, 4):
                oc[r, f] /= np.float64(inv)
            mr, ll = np.float64(m[r]), math.log(np.float64(l[r]))
            lse[r] = mr + ll
            hi = np.float64(lse[r])
            lse_lo[r] = (mr - hi) + ll if abs(mr) >= abs(ll) else (ll - hi) + mr
        else:
            out[r, :] = 0
            oc[r, :3] = 0.0
            oc[r, 4] = 0.0
            lse[r] = -np.inf
            lse_lo[r] = -np.inf


@numba.njit(cache=True, fastmath=_FAST)
def _shift_rows(z: Any, lse: Any) -> None:
    """``z -= lse[:, None]`` in the rows that see a key (``lse`` finite): the backward's
    ``z - lse``, exact where it matters (``z`` near ``lse``), before ``exp(. - lse_lo)``. The
    tile indexed, as in :func:`_mask`: a view of a row inside the branch costs two NRT calls."""
    for r in range(z.shape[0]):
        hr = lse[r]
        if hr > -np.inf:
            for j in range(z.shape[1]):
                z[r, j] -= hr


@numba.njit(cache=True, fastmath=_FAST)
def _dscores(p: Any, dp: Any, dd: Any, keep: Any, ks: Any, ds: Any) -> None:
    """``dS = P (dP - D[:, None])`` (unscaled); with dropout (``keep`` non-empty) ``dP`` is
    ``fl(dP' ks)`` where kept, else 0, of the product ``dP'``, made entry by entry, never
    stored."""
    if keep.shape[0] > 0:
        zero = like(ks, 0.0)
        for r in range(p.shape[0]):
            x = dd[r]
            for j in range(p.shape[1]):
                g = dp[r, j] * ks if keep[r, j] else zero  # a select: INF * 0 is NaN
                ds[r, j] = p[r, j] * (g - x)
        return
    for r in range(p.shape[0]):
        x = dd[r]
        for j in range(p.shape[1]):
            ds[r, j] = p[r, j] * (dp[r, j] - x)


@numba.njit(cache=True, inline="always")
def _mix64(z: Any) -> Any:
    """SplitMix64's finalizer (:func:`attention.dropout_hash.mix64`), wrapping ``uint64``."""
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True)
def _keep_tile(seed: Any, b: int, i0: int, j0: int, lq: int, lk: int, thr: Any,
               keep: Any) -> None:
    """``keep`` (rows x cols, uint8) = the dropout decisions of the elements ``(b, i0 + r, j0 +
    c)`` of an ``(n, lq, lk)`` product (:mod:`attention.dropout_hash`: 1 = kept)."""
    rows, cols = keep.shape
    for r in range(rows):
        base = np.uint64((b * lq + i0 + r) * lk + j0 + 1)
        for c in range(cols):
            h = _mix64(seed + (base + np.uint64(c)) * GAMMA)
            keep[r, c] = np.uint8((h >> SHIFT) >= thr)


@numba.njit(cache=True, fastmath=_FAST)
def _drop(p: Any, keep: Any, ks: Any, out: Any) -> None:
    """``out = fl(p ks) keep``: the dropped, rescaled probabilities the products read (as
    :class:`attention.dropout.DropoutStep` makes them: ``p * scale`` where kept, else 0)."""
    for r in range(p.shape[0]):
        for j in range(p.shape[1]):
            out[r, j] = p[r, j] * ks * like(ks, keep[r, j])


@numba.njit(cache=True)
def _settle(rec: Any, site: int, attempt: int, ratio: float, correct: bool, info: Any,
            row0: int, col0: int, by_rows: bool) -> int:
    """Book one check: 0 go on, 1 recompute and check again, -1 give up (recomputation did not
    verify). ``row0``/``col0`` offset the located element to global indices; ``by_rows``: the
    vectors are rows (else columns)."""
    if attempt > 0:
        rec[site, AFTER] = max(rec[site, AFTER], ratio)
    if ratio <= 1:
        return 0
    if attempt > 0:
        rec[site, FAILED] = 1
        return -1
    rec[site, FLAGS] += 1
    if ratio > rec[site, RATIO] or rec[site, FLAGS] == 1:
        v, pos = int(info[3]), int(info[4])
        rec[site, RATIO], rec[site, MAG], rec[site, TAU] = ratio, info[1], info[2]
        r, c = (v, pos) if by_rows else (pos, v)
        rec[site, ROW] = row0 + r if r >= 0 else -1
        rec[site, COL] = col0 + c if c >= 0 else -1
    return 1 if correct else 0


@numba.njit(cache=True)
def _settle_product(x: Any, enc: Any, t: Any, coef: Any, check: bool, correct: bool, work: Any,
                    rec: Any, site: int, attempt: int, row0: int, col0: int) -> int:
    """:func:`_settle` a tile product ``t = x @ B^T`` (its vectors are rows) at ``site``; when
    ``check``, judged by its observed row checksums against those predicted from ``x`` and
    ``enc``, ``B``'s column encoding. ``work``: a head's buffers (:func:`_backward_tile`)."""
    _, _, pred, obs, info = work
    ratio = 0.0
    if check:
        _predict(x, enc, pred)
        _observe_rows(t, obs)
        info[5] = t.shape[1]
        ratio = _judge(pred, obs, t.shape[0], coef, info)
    return _settle(rec, site, attempt, ratio, correct, info, row0, col0, True)


# ------------------------------------------------------------------ forward


def _forward_block(ops: ForwardOperands, mask: Mask, rules: ForwardRules, drop: Dropout,
                   outs: ForwardOutputs, b: int, i0: int, rec: Any) -> int:
    """One query block ``[i0, i0 + BR)`` of head ``b``: online softmax over the key tiles with
    every check; writes ``out[b, block]``, ``lse[b, block]`` and (when checking) the output rows'
    carried checksums ``sums[b, block, :3]`` (``P [V1, Vw, |V|1] / l``, float64, of the product's
    probabilities) and the sums of its kept probabilities ``sums[b, block, 3]`` (``P_d 1 / l``,
    which is ``P 1 / l`` without dropout). Dropout when ``thr`` > 0 (:func:`_keep_tile`'s
    ``seed`` and ``thr``, ``ks = 1 / (1 - p)`` in the data's dtype): the product reads the
    dropped tile, the softmax denominator the tile before dropout. Returns 0, or -1 when a
    recomputation did not verify."""
    q, k, kt, v, ve = ops
    visible, add, add_heads, hidden, keys, key_heads, hidden_keys, scale, causal = mask
    check, correct, c_s, c_o, c_l, tol_p, g_rows = rules
    seed, thr, ks = drop
    out, lse, lse_lo, sums = outs
    lq, d = q.shape[1], q.shape[2]
    lk = k.shape[1]
    i1 = min(i0 + BR, lq)
    rows = i1 - i0
    qb = q[b, i0:i1]
    vis = visible[b] if visible.shape[1] else visible[0]
    addh = add[b // add_heads]
    keysh = keys[b // key_heads] if keys.shape[1] else keys[0]
    dt = q.dtype
    qenc = np.zeros((3, d))
    if check:
        _col_sums(qb, _weights(rows), qenc)
    sbuf = np.empty(rows * BC, dt)
    pbuf = np.empty(rows * BC, dt)
    dropping = thr > 0
    dbuf = np.empty(rows * BC if dropping else 0, dt)
    kbuf = np.empty(rows * BC if dropping else 0, np.uint8)
    nokeep = np.empty((0, 0), np.uint8)
    acc = np.empty((rows, d), dt)
    oc = np.empty((rows, 5))
    m = np.empty(rows, dt)
    l = np.empty(rows, dt)
    alpha = np.empty(rows, dt)
    pred = np.empty((max(rows, BC), 3))
    obs = np.empty((max(rows, BC), 3))
    obs_buf = np.empty(3 * BC)
    w_rows = _weights(rows)
    info = np.zeros(6)
    jend = min(lk, i1) if causal else lk
    for attempt in range(2):
        acc[:] = 0
        oc[:] = 0.0
        m[:] = -np.inf
        l[:] = 0
        for j0 in range(0, jend, BC):
            if _skipped(hidden, add_heads, hidden_keys, b, i0, j0):
                continue
            j1 = min(j0 + BC, lk)  # a whole key block (transpose_blocks' layout); causal masks
            cols = j1 - j0
            s = sbuf[:rows * cols].reshape(rows, cols)
            p = pbuf[:rows * cols].reshape(rows, cols)
            # C-contiguous, not a column slice of a (3, BC) array: the sums' loops vectorize
            obs_cols = obs_buf[:3 * cols].reshape(3, cols)
            for a in range(2):
                blas_gemm(qb, _block_t(kt, b, j0, j1, d), s, 0.0, False, False, g_rows)
                _HOOK(S_, s)
                ratio = 0.0
                if check:
                    _predict(k[b, j0:j1], qenc, pred)
                    _col_sums(s, w_rows, obs_cols)
                    info[5] = rows
                    ratio = _judge(pred, obs_cols.T, cols, c_s, info)
                st = _settle(rec, S_, a, ratio, correct, info, i0, j0, False)
                if st != 1:
                    break
            if st < 0:
                return -1
            _mask(s, scale, i0, j0, causal, vis, addh, keysh)
            _new_max(s, m, alpha)
            for a in range(2):
                _exp_rows(s, m, p)
                _HOOK(P_, p)
                ratio = _probs_ratio(s, p, m, tol_p, info) if check else 0.0
                st = _settle(rec, P_, a, ratio, correct, info, i0, j0, True)
                if st != 1:
                    break
            if st < 0:
                return -1
            _sum_rows(p, alpha, l)
            _HOOK(L_, l.reshape((rows, 1)))
            _rescale(acc, alpha)
            if dropping:
                keep = kbuf[:rows * cols].reshape(rows, cols)
                pd = dbuf[:rows * cols].reshape(rows, cols)
                _keep_tile(seed, b, i0, j0, lq, lk, thr, keep)
                _drop(p, keep, ks, pd)
                _HOOK(DROP_, pd)
                blas_gemm(pd, v[b, j0:j1], acc, 1.0, False, False, g_rows)
            else:
                keep = nokeep
                blas_gemm(p, v[b, j0:j1], acc, 1.0, False, False, g_rows)
            if check:
                _carry(p, keep, ks, ve[b], j0, alpha, oc, False)
            _HOOK(O_, acc)
        ob = out[b, i0:i1]
        st = _settle(rec, L_, attempt, _rowsum_ratio(oc, l, c_l, info) if check else 0.0,
                     correct, info, i0, -1, True)
        if st < 0:
            return -1
        if st == 1:
            continue
        _finish(acc, oc, m, l, ob, lse[b, i0:i1], lse_lo[b, i0:i1])
        ratio = 0.0
        if check:
            _observe_rows(ob, obs)
            info[5] = d
            ratio = _judge(oc, obs, rows, c_o, info)
            sums[b, i0:i1, :3] = oc[:, :3]
            sums[b, i0:i1, 3] = oc[:, 4]
        st = _settle(rec, O_, attempt, ratio, correct, info, i0, 0, True)
        if st != 1:
            return st
    return -1


# ------------------------------------------------------------------ backward


def _backward_tile(ops: BackwardOperands, mask: Any, rules: BackwardRules, drop: Dropout,
                   b: int, i0: int, j0: int, j1: int, keys: Any, head: Any, work: Any,
                   blocks: Any, dq_acc: Any, do_kv: bool, do_q: bool, rec: Any) -> int:
    """One tile (query block ``i0``, keys ``[j0, j1)``) of head ``b``: ``S`` and ``P``
    recomputed and checked, then ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P (dP - D)``,
    ``dK += dS^T Q`` (``do_kv``) and ``dQ += dS K`` (``do_q``), unscaled, each accumulator with
    its checksum columns carried beside it. With dropout (``thr`` > 0; ``kbuf`` a buffer of the
    tile's keep decisions) FlashAttention-2's: ``dV += (P keep ks)^T dO`` and ``dS = P (dP keep
    ks - D)``. ``mask``: this head's ``(visible, add, keys, scale, causal)``; ``keys``: the key
    block's transposes and column encodings ``(kt, vt, kenc, venc)`` (:func:`_key_block`);
    ``head``: the head's ``(dd, qe, ke, doe)`` (:func:`_head_rows`); ``work``: the head's
    buffers ``(bufs, kbuf, pred, obs, info)``; ``blocks``: the key block's accumulators ``(dkb,
    dvb, dkc, dvc)``; ``dq_acc``: ``(dq, dqc)``. Returns 0, or -1 when a recomputation did not
    verify."""
    q, k, v, do, _, lse, lse_lo = ops
    dd, qe, ke, doe = head
    vis, addh, keysh, scale, causal = mask
    check, correct, c_s, _, _, tol_p, tol_ds, g_rows = rules
    seed, thr, ks = drop
    kt, vt, kenc, venc = keys
    bufs, kbuf, _, _, info = work
    dkb, dvb, dkc, dvc = blocks
    dq, dqc = dq_acc
    i1 = min(i0 + BR, q.shape[1])
    rows, cols = i1 - i0, j1 - j0
    qi, doi, dd_i = q[b, i0:i1], do[b, i0:i1], dd[i0:i1]
    lse_i, lo_i = lse[b, i0:i1], lse_lo[b, i0:i1]
    s = bufs[0, :rows * cols].reshape(rows, cols)
    p = bufs[1, :rows * cols].reshape(rows, cols)
    dp = bufs[2, :rows * cols].reshape(rows, cols)
    ds = bufs[3, :rows * cols].reshape(rows, cols)
    none = np.empty(0, q.dtype)
    dropping = thr > 0
    keep = kbuf[:rows * cols].reshape(rows, cols) if dropping else kbuf[:0].reshape(0, 0)
    if dropping:
        _keep_tile(seed, b, i0, j0, q.shape[1], k.shape[1], thr, keep)
    for a in range(2):
        blas_gemm(qi, kt, s, 0.0, False, False, g_rows)
        _HOOK(S_, s)
        st = _settle_product(qi, kenc, s, c_s, check, correct, work, rec, S_, a, i0, j0)
        if st != 1:
            break
    if st < 0:
        return -1
    _mask(s, scale, i0, j0, causal, vis, addh, keysh)
    _shift_rows(s, lse_i)  # z - lse; P = exp((z - lse) - lse_lo), checked against it
    for a in range(2):
        _exp_rows(s, lo_i, p)
        _HOOK(P_, p)
        ratio = _probs_ratio(s, p, lo_i, tol_p, info) if check else 0.0
        st = _settle(rec, P_, a, ratio, correct, info, i0, j0, True)
        if st != 1:
            break
    if st < 0:
        return -1
    if do_kv:
        if dropping:
            pd = bufs[4, :rows * cols].reshape(rows, cols)
            _drop(p, keep, ks, pd)
            _HOOK(DROP_, pd)
            blas_gemm(pd, doi, dvb, 1.0, True, False, g_rows)
        else:
            blas_gemm(p, doi, dvb, 1.0, True, False, g_rows)
        if check:
            _carry(p, keep, ks, doe, i0, none, dvc, True)
        _HOOK(DV_, dvb)
    for a in range(2):
        blas_gemm(doi, vt, dp, 0.0, False, False, g_rows)
        _HOOK(DP_, dp)
        st = _settle_product(doi, venc, dp, c_s, check, correct, work, rec, DP_, a, i0, j0)
        if st != 1:
            break
    if st < 0:
        return -1
    for a in range(2):
        _dscores(p, dp, dd_i, keep, ks, ds)
        _HOOK(DS_, ds)
        ratio = _dscores_ratio(ds, p, dp, dd_i, keep, ks, tol_ds, info) if check else 0.0
        st = _settle(rec, DS_, a, ratio, correct, info, i0, j0, True)
        if st != 1:
            break
    if st < 0:
        return -1
    if do_kv:
        blas_gemm(ds, qi, dkb, 1.0, True, False, g_rows)
        if check:
            _carry(ds, keep[:0], ks, qe, i0, none, dkc, True)
        _HOOK(DK_, dkb)
    if do_q:
        dqi = dq[b, i0:i1]
        blas_gemm(ds, k[b, j0:j1], dqi, 1.0, False, False, g_rows)
        if check:
            _carry(ds, keep[:0], ks, ke, j0, none, dqc[b, i0:i1], False)
        _HOOK(DQ_, dqi)
    return 0


def _backward_head(ops: BackwardOperands, mask: Mask, rules: BackwardRules, drop: Dropout,
                   grads: Gradients, b: int, rec: Any) -> int:
    """Head ``b``, FlashAttention-2 order: key blocks outside, query blocks inside; ``dK`` and
    ``dV`` of a key block accumulate in the block, ``dQ`` in ``dq[b]`` (this head's alone, so
    heads run in parallel without races). A flagged ``dK``/``dV`` block is recomputed (its
    query sweep again, without ``dQ``), a flagged ``dQ`` block likewise (its key sweep). Writes
    the scaled gradients and, when checking, the verified carried row checksums of each key's
    ``dK`` (scaled) and ``dV`` into ``kvc[b]`` ``(L_k, 6)`` (:mod:`attention.fused_final`
    checks the returned arrays against them); returns 0, or -1 when a recomputation did not
    verify."""
    q, k, v = ops.q, ops.k, ops.v
    visible, add, add_heads, hidden, keys, key_heads, hidden_keys, scale, causal = mask
    check, correct, _, c_kv, c_q, _, _, _ = rules
    dq, dk, dv, dqc, kvc = grads
    lq, d = q.shape[1], q.shape[2]
    lk = k.shape[1]
    dt = q.dtype
    vis = visible[b] if visible.shape[1] else visible[0]
    addh = add[b // add_heads]
    keysh = keys[b // key_heads] if keys.shape[1] else keys[0]
    head_mask = (vis, addh, keysh, scale, causal)
    kenc, venc = np.zeros((3, d)), np.zeros((3, d))
    kvt = np.empty((2, d * BC), dt)
    bufs = np.empty((5, BR * BC), dt)
    kbuf = np.empty(BR * BC, np.uint8)
    dkb, dvb = np.empty((BC, d), dt), np.empty((BC, d), dt)
    dkc, dvc = np.empty((3, BC)), np.empty((3, BC))
    pred, obs = np.empty((max(BR, BC), 3)), np.empty((max(BR, BC), 3))
    info = np.zeros(6)
    work = (bufs, kbuf, pred, obs, info)
    head = _head_rows(q[b], k[b], ops.do[b], ops.o[b], check)
    dq[b, :, :] = 0
    dqc[b, :, :] = 0.0
    for j0 in range(0, lk, BC):
        j1 = min(j0 + BC, lk)
        cols = j1 - j0
        keys = _key_block(k[b, j0:j1], v[b, j0:j1], kvt, kenc, venc, check)
        first = (j0 // BR) * BR if causal else 0
        for attempt in range(2):
            dkb[:cols] = 0
            dvb[:cols] = 0
            dkc[:] = 0.0
            dvc[:] = 0.0
            for i0 in range(first, lq, BR):
                if _skipped(hidden, add_heads, hidden_keys, b, i0, j0):
                    continue
                if _TILE(ops, head_mask, rules, drop, b, i0, j0, j1, keys, head, work,
                         (dkb[:cols], dvb[:cols], dkc, dvc), (dq, dqc), True, attempt == 0,
                         rec) < 0:
                    return -1
            st = 0
            if check:
                info[5] = d
                _observe_rows(dkb[:cols], obs)
                st_k = _settle(rec, DK_, attempt, _judge(dkc.T, obs, cols, c_kv, info), correct,
                               info, j0, 0, True)
                _observe_rows(dvb[:cols], obs)
                st_v = _settle(rec, DV_, attempt, _judge(dvc.T, obs, cols, c_kv, info), correct,
                               info, j0, 0, True)
                st = min(st_k, st_v) if min(st_k, st_v) < 0 else max(st_k, st_v)
            if st < 0:
                return -1
            if st == 0:
                break
        dk[b, j0:j1] = dkb[:cols] * scale
        dv[b, j0:j1] = dvb[:cols]
        if check:  # the verified carried row checksums of dK (scaled) and dV, for the final check
            s64 = np.float64(scale)
            for j in range(cols):
                for f in range(3):
                    kvc[b, j0 + j, f] = dkc[f, j] * s64
                    kvc[b, j0 + j, 3 + f] = dvc[f, j]
    for i0 in range(0, lq, BR):
        i1 = min(i0 + BR, lq)
        rows = i1 - i0
        for attempt in range(2):
            if attempt > 0:  # the query block's key sweep again, dQ alone
                dq[b, i0:i1, :] = 0
                dqc[b, i0:i1, :] = 0.0
                for j0 in range(0, min(lk, i1) if causal else lk, BC):
                    if _skipped(hidden, add_heads, hidden_keys, b, i0, j0):
                        continue
                    j1 = min(j0 + BC, lk)
                    keys = _key_block(k[b, j0:j1], v[b, j0:j1], kvt, kenc, venc, True)
                    if _TILE(ops, head_mask, rules, drop, b, i0, j0, j1, keys, head, work,
                             (dkb[:j1 - j0], dvb[:j1 - j0], dkc, dvc), (dq, dqc), False, True,
                             rec) < 0:
                        return -1
            if not check:
                break
            info[5] = d
            _observe_rows(dq[b, i0:i1], obs)
            st = _settle(rec, DQ_, attempt, _judge(dqc[b, i0:i1], obs, rows, c_q, info),
                         correct, info, i0, 0, True)
            if st < 0:
                return -1
            if st == 0:
                break
    dq[b, :, :] *= scale
    return 0


@numba.njit(cache=True, fastmath=_FAST)
def _head_rows(qh: Any, kh: Any, doh: Any, oh: Any, check: bool) -> tuple:
    """``(dd, qe, ke, doe)`` of one head: ``dd = rowsum(dO * O)`` (float64 sums, rounded to the
    data's dtype) and, when ``check``, the row encodings ``(3, L)`` of ``q``, ``k`` and ``dO``
    (:func:`_observe_rows`; empty ``(3, 0)`` arrays otherwise)."""
    lq = qh.shape[0]
    dd = np.empty(lq, qh.dtype)
    for r in range(lq):
        t = 0.0
        for c in range(qh.shape[1]):
            t += np.float64(doh[r, c]) * np.float64(oh[r, c])
        dd[r] = t
    n_q, n_k = (lq, kh.shape[0]) if check else (0, 0)
    qe, ke, doe = np.empty((3, n_q)), np.empty((3, n_k)), np.empty((3, n_q))
    if check:
        _observe_rows(qh, qe.T)
        _observe_rows(kh, ke.T)
        _observe_rows(doh, doe.T)
    return dd, qe, ke, doe


@numba.njit(cache=True)
def _key_block(kb: Any, vb: Any, kvt: Any, kenc: Any, venc: Any, check: bool) -> tuple:
    """``(kt, vt, kenc, venc)`` of a key block ``kb``, ``vb`` (``cols x d``): the transposes
    (:func:`_transpose_block`, into the head's buffer ``kvt`` ``(2, d BC)``) and, when
    ``check``, the column encodings (into ``kenc`` and ``venc``)."""
    cols, d = kb.shape
    kt = kvt[0, :d * cols].reshape((d, cols))
    vt = kvt[1, :d * cols].reshape((d, cols))
    _transpose_block(kb, kt)
    _transpose_block(vb, vt)
    if check:
        w = _weights(cols)
        _col_sums(kb, w, kenc)
        _col_sums(vb, w, venc)
    return kt, vt, kenc, venc


#: The drivers' globals: the hook, and the tile the head calls. Compiled, they are ``no_hook`` and
#: the compiled tile, frozen at compile time; :func:`python_drivers` runs the same code with
#: others.
_HOOK = no_hook
_TILE = numba.njit(cache=True)(_backward_tile)
_forward_block_jit = numba.njit(cache=True)(_forward_block)
_backward_head_jit = numba.njit(cache=True)(_backward_head)


def python_drivers(hook: Any) -> tuple[Any, Any]:
    """``(forward_block, backward_head)``: :func:`_forward_block` and :func:`_backward_head` as
    Python functions calling ``hook(site, tile)`` (the leaves stay compiled)."""
    def rebound(fn: Any, **names: Any) -> Any:
        return types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__)

    tile = rebound(_backward_tile, _HOOK=hook)
    return rebound(_forward_block, _HOOK=hook), rebound(_backward_head, _HOOK=hook, _TILE=tile)


@numba.njit(cache=True, parallel=True)
def forward(ops: ForwardOperands, mask: Mask, rules: ForwardRules, drop: Dropout,
            outs: ForwardOutputs, rec: Any, status: Any) -> None:
    """Every (head, query block) in parallel (:func:`_forward_block`); ``rec`` and ``status``
    per task."""
    q = ops.q
    nqb = (q.shape[1] + BR - 1) // BR
    for t in numba.prange(q.shape[0] * nqb):
        status[t] = _forward_block_jit(ops, mask, rules, drop, outs, t // nqb, (t % nqb) * BR,
                                       rec[t])


@numba.njit(cache=True, parallel=True)
def backward(ops: BackwardOperands, mask: Mask, rules: BackwardRules, drop: Dropout,
             grads: Gradients, rec: Any, status: Any) -> None:
    """Every head in parallel (:func:`_backward_head`); ``rec`` and ``status`` per head."""
    for b in numba.prange(ops.q.shape[0]):
        status[b] = _backward_head_jit(ops, mask, rules, drop, grads, b, rec[b])


# ------------------------------------------------------------------ outside numba's pool


def _forward_serial(ops: ForwardOperands, mask: Mask, rules: ForwardRules, drop: Dropout,
                    outs: ForwardOutputs, rec: Any, status: Any) -> None:
    nqb = (ops.q.shape[1] + BR - 1) // BR
    for t in range(ops.q.shape[0] * nqb):
        status[t] = _forward_block_jit(ops, mask, rules, drop, outs, t // nqb, (t % nqb) * BR,
                                       rec[t])


def _backward_serial(ops: BackwardOperands, mask: Mask, rules: BackwardRules, drop: Dropout,
                     grads: Gradients, rec: Any, status: Any) -> None:
    for b in range(ops.q.shape[0]):
        status[b] = _backward_head_jit(ops, mask, rules, drop, grads, b, rec[b])


def _encode_rows_serial(x: Any, out: Any) -> None:
    for b in range(x.shape[0]):
        _observe_rows(x[b], out[b].T)


def _transpose_blocks_serial(x: Any, out: Any) -> None:
    for b in range(x.shape[0]):
        _transpose_head(x, out, b)


#: :func:`forward`, :func:`backward`, :func:`encode_rows`, :func:`transpose_blocks` and
#: :func:`hidden_tiles` for a process that cannot enter numba's pool
#: (:func:`abftgemm.threads.numba_pool_usable`): their loops in Python, each task the compiled
#: function the parallel kernel runs for it (:func:`hidden_tiles`: its serial twin).
SERIAL = types.SimpleNamespace(forward=_forward_serial, backward=_backward_serial,
                               encode_rows=_encode_rows_serial,
                               transpose_blocks=_transpose_blocks_serial,
                               hidden_tiles=_hidden_tiles_serial)
