"""CPU (numba) softmax kernels of the attention core, with the GPU kernels' boundaries.

Forward (:func:`forward`): one pass per row reads the raw scores once, observes their row
checksums (for the deferred check of the scores product), computes the masked softmax and, while
the row is in cache, checks the softmax invariants on what it stored. Backward (:func:`backward`):
one pass per row observes dP's row checksums (the deferred check of ``d_probs``), computes
``dS = P (dP - r)``, checks dS's two row checksums against closed forms recomputed from P and dP,
and scales dS. The visibility of a key is recomputed from the key-padding mask, causality and the
additive attention mask: no ``(batch*heads, seq_q, seq_k)`` mask is materialized.

When a fault hook must see the output between computing and checking (fault injection), the
same kernels run with ``check=False`` and the invariants are checked by
:func:`check_forward` / :func:`attention._cpu_checks.backward_ratio` afterwards. Invariants,
tolerances and NaN behaviour are those of :mod:`attention.softmax`; checks sum in float64.
"""
from __future__ import annotations

import math
from typing import Any

import numba
from numba.extending import overload
import numpy as np

from attention._cpu_checks import _worse, backward_row


def _like(x: Any, v: float) -> Any:
    """``v`` in the precision of ``x`` (float32 or float64), so that ``math.exp`` of it runs in
    that precision: the scalar float64 ``exp`` was most of the forward kernel's time (5.4 of
    9 ms of a (4, 4, 128, 32) float32 forward), where NumPy's float32 ``exp`` had been."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_like, inline="always")
def _like_impl(x, v):  # noqa: ANN001 (numba compares signatures)
    if x == numba.types.float32:
        return lambda x, v: np.float32(v)
    return lambda x, v: np.float64(v)


@numba.njit(cache=True, inline="always")
def _observe(s0: float, s1: float, s2: float, count: int, last: int, x: Any, j: int,
             inv_sk: float) -> tuple[float, float, float, int, int]:
    """Element ``j`` of a row folded into its row checksum fields (plain, location-weighted,
    absolute sums, non-finite count, last non-finite index), in float64."""
    v = np.float64(x)
    if not math.isfinite(v):
        count += 1
        last = j
    return s0 + v, s1 + (j + 1) * inv_sk * v, s2 + abs(v), count, last


@numba.njit(cache=True, inline="always")
def _visible(key_visible: Any, has_keys: bool, batch: int, causal: bool, i: int, j: int) -> bool:
    return (not has_keys or key_visible[batch, j]) and (not causal or j <= i)


@numba.njit(cache=True)
def forward(scores: Any, scale: Any, key_visible: Any, has_keys: bool, attn_add: Any,
            has_attn: bool, causal: bool, heads: int, check: bool, floor: float, probs: Any,
            stats: Any, errors: Any) -> None:
    """Masked softmax of ``scale * scores (+ attn_add)``, the scores' row checksums, and (with
    ``check``) the invariant errors.

    Parameters
    ----------
    scores : (batch*heads, seq_q, seq_k) float32/float64, raw ``Q_h K_h^T``
    scale : (1,) array of the scores' dtype (``1/sqrt(head_dim)``)
    key_visible : (batch, seq_k) bool, True = the key may be attended (ignored unless has_keys)
    attn_add : (1 or batch*heads, seq_q, seq_k) float64 added to the scaled scores (-inf: not
        allowed; ignored unless has_attn)
    causal : bool
        Key ``j`` is hidden from query ``i`` when ``j > i``.
    probs : (batch*heads, seq_q, seq_k), dtype of ``scores``: output
    stats : (batch*heads, seq_q, 5) float64: ``[sum, sum (j+1)/seq_k weighted, sum |.|,
        non-finite count, last non-finite index or -1]`` of every raw score row
    errors : (3,) float64: ``[worst row-sum error, worst log-identity error, largest |z| used]``
        are folded into it (start from zeros)
    """
    bh, sq, sk = scores.shape
    sc = scale[0]
    inv_sk = 1.0 / max(sk, 1)  # location weights (j+1)/sk within 2 ulp: divisions cost most
    for t in range(bh):
        batch = t // heads
        am = attn_add[min(t, attn_add.shape[0] - 1)]
        for i in range(sq):
            row, out = scores[t, i], probs[t, i]
            s0 = s1 = s2 = 0.0
            count, last = 0, -1
            top = -math.inf
            for j in range(sk):
                s0, s1, s2, count, last = _observe(s0, s1, s2, count, last, row[j], j, inv_sk)
                z = row[j] * sc
                if has_attn:
                    z = z + am[i, j]
                if _visible(key_visible, has_keys, batch, causal, i, j) and z != -math.inf:
                    out[j] = z
                    if z > top:
                        top = z
                else:
                    out[j] = -math.inf
            st = stats[t, i]
            st[0], st[1], st[2], st[3], st[4] = s0, s1, s2, count, last
            if top == -math.inf:
                top = 0.0  # no visible key: exp(-inf) = 0 everywhere
            total = 0.0
            for j in range(sk):
                out[j] = math.exp(_like(sc, out[j] - top))  # expf for 16/32-bit layers
                total += out[j]
            if total == 0:
                total = 1.0
            inv_total = 1.0 / total
            for j in range(sk):
                out[j] = out[j] * inv_total
            if check:
                _check_row(out, row, sc, am, has_attn, key_visible, has_keys, batch, causal, i,
                           floor, errors)


@numba.njit(cache=True)
def check_forward(probs: Any, scores: Any, scale: Any, key_visible: Any, has_keys: bool,
                  attn_add: Any, has_attn: bool, causal: bool, heads: int, floor: float,
                  errors: Any) -> None:
    """The invariant check of :func:`forward` alone (``probs`` as delivered, any float dtype
    numba reads: float32/float64)."""
    bh, sq, _ = scores.shape
    for t in range(bh):
        am = attn_add[min(t, attn_add.shape[0] - 1)]
        for i in range(sq):
            _check_row(probs[t, i], scores[t, i], scale[0], am, has_attn, key_visible, has_keys,
                       t // heads, causal, i, floor, errors)


@numba.njit(cache=True, inline="always")
def _check_row(p: Any, s: Any, sc: Any, am: Any, has_attn: bool, key_visible: Any,
               has_keys: bool, batch: int, causal: bool, i: int, floor: float,
               errors: Any) -> None:
    """Fold one row's invariant errors into ``errors`` (the forward check of
    :func:`check_forward`): z is recomputed from the raw scores, not taken from
    the softmax's own arithmetic."""
    finite = True
    any_visible = False
    top = -math.inf
    arg = 0
    total = 0.0
    for j in range(p.shape[0]):
        z = np.float64(s[j] * sc) + (am[i, j] if has_attn else 0.0)
        if _visible(key_visible, has_keys, batch, causal, i, j) and z != -math.inf:
            any_visible = True
            if not math.isfinite(z):
                finite = False
        v = np.float64(p[j])
        total += v
        if v > top or (v != v and top == top):
            top, arg = v, j
    if not finite:
        return
    errors[0] = _worse(errors[0], abs(total - (1.0 if any_visible else 0.0)))
    if top != top:
        return
    log_top = math.log(top) if top > 0 else 0.0
    z_top = np.float64(s[arg] * sc) + (am[i, arg] if has_attn else 0.0)
    for j in range(p.shape[0]):
        v = np.float64(p[j])
        if v > floor * top and _visible(key_visible, has_keys, batch, causal, i, j):
            zj = np.float64(s[j] * sc) + (am[i, j] if has_attn else 0.0)
            if zj == -math.inf:
                continue
            errors[1] = _worse(errors[1], abs(math.log(v) - log_top - (zj - z_top)))
            errors[2] = _worse(errors[2], abs(zj))


@numba.njit(cache=True)
def backward(dp: Any, p: Any, scale: Any, check: bool, u: float, tiny: float, ds: Any,
             stats: Any, result: Any) -> None:
    """``dS = scale * P (dP - rowsum(P dP))``, dP's row checksums and (with ``check``) the
    worst invariant ratio.

    Parameters
    ----------
    dp, p : (rows, seq_q, seq_k) float32/float64 (the accumulation dtype)
    scale : (1,) array of dp's dtype; with ``check=False`` pass 1 to get the unscaled dS
    ds : like dp: output
    stats : (rows, seq_q, 5) float64: dP's row checksums, as :func:`forward` gives the scores'
    result : (3,) float64: ``[worst ratio, its plain error, its plain tolerance]``, folded into
        (start from ``[-1, 0, 0]``; see :func:`attention._cpu_checks.backward_ratio`)
    """
    sc = scale[0]
    rows, sq, sk = dp.shape
    inv_sk = 1.0 / max(sk, 1)
    for t in range(rows):
        for i in range(sq):
            dpr, pr, out = dp[t, i], p[t, i], ds[t, i]
            s0 = s1 = s2 = 0.0
            count, last = 0, -1
            r = 0.0
            for j in range(sk):
                s0, s1, s2, count, last = _observe(s0, s1, s2, count, last, dpr[j], j, inv_sk)
                r += dpr[j] * pr[j]
            st = stats[t, i]
            st[0], st[1], st[2], st[3], st[4] = s0, s1, s2, count, last
            for j in range(sk):
                out[j] = pr[j] * (dpr[j] - r)
            if check:
                backward_row(out, dpr, pr, u, tiny, result)
                for j in range(sk):
                    out[j] = out[j] * sc


