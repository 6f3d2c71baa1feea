"""CPU (numba) softmax kernels of the attention core, with the GPU kernels' boundaries.

Forward (:func:`forward`): row by row, it reads the raw scores, observes their row checksums
(for the deferred check of the scores product), computes the masked softmax and, while the row is
in cache, checks the softmax invariants on what it stored. Backward (:func:`backward`): row by
row, it observes dP's row checksums (the deferred check of ``d_probs``), computes
``dS = P (dP - r)``, checks dS's two row checksums against closed forms recomputed from P and dP,
and scales dS. The visibility of a key is recomputed from the key-padding mask, causality and the
additive attention mask: no ``(batch*heads, seq_q, seq_k)`` mask is materialized.

The loops are written for LLVM's vectorizer: one compiled row per mask combination (no flag
tested per element), float32 ``exp``/``log`` inlined from :mod:`attention._cpu_vmath`, counts
instead of boolean flags, and maxima of the check taken as integer maxima of bit patterns.

When a fault hook must see the output between computing and checking (fault injection), the
same kernels run with ``check=False`` and the invariants are checked by
:func:`check_forward` / :func:`attention._cpu_checks.backward_ratio` afterwards. Invariants,
tolerances and NaN behaviour are those of :mod:`attention.softmax`; checks sum in float64.
"""
from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from abftgemm.cpu_kernels import (FAST, ROWS_PER_UPDATE, fields, row_sums, sum_column_prefix,
                                  sum_row)
from attention._cpu_checks import _worse, backward_row
from attention._cpu_vmath import exp_like, from_ordered_key, like, log_like, ordered_key

@numba.njit(cache=True, fastmath=FAST)
def forward(scores: Any, scale: Any, key_visible: Any, has_keys: bool, attn_add: Any,
            has_attn: bool, causal: bool, heads: int, check: bool, floor: float, p_min: float,
            probs: Any, stats: Any, limits: Any, errors: Any, cols: Any, rows: Any) -> None:
    """Masked softmax of ``scale * scores (+ attn_add)``, the scores' row checksums, and (with
    ``check``) the invariant errors.

    Parameters
    ----------
    scores : (batch*heads, seq_q, seq_k) float32/float64, raw ``Q_h K_h^T``
    scale : (1,) array of the scores' dtype (``1/sqrt(head_dim)``)
    key_visible : (batch, seq_k) bool, True = the key may be attended (ignored unless has_keys)
    attn_add : (1 or batch*heads, 1 or seq_q, seq_k) float64 added to the scaled scores (-inf:
        not allowed; ignored unless has_attn)
    causal : bool
        Key ``j`` is hidden from query ``i`` when ``j > i``.
    floor, p_min : float
        The log identity skips entries at or below ``max(floor * top, p_min)``, ``top`` the
        row's largest probability and ``p_min`` the smallest normal number of the dtype the
        probabilities are delivered in (below it they lose relative precision).
    probs : (batch*heads, seq_q, seq_k), dtype of ``scores``: output
    stats : (batch*heads, seq_q, 5) float64: ``[sum, sum (j+1)/seq_k weighted, sum |.|,
        non-finite count, last non-finite index or -1]`` of every raw score row; an empty array
        (first dimension 0) when nothing reads them
    limits : (seq_q,) int64: observe row ``i``'s first ``limits[i]`` scores only (all that the
        scores product computed, :attr:`abftgemm.ProtectedMatmul.row_limits`); an empty
        array for whole rows
    errors : (3,) float64: ``[worst row-sum error, worst log-identity spread, largest
        |z| + |log P| used]`` are folded into it (start from zeros)
    cols, rows : (3, batch*heads, seq_k) and (3, batch*heads, seq_q) float64, or empty arrays
        (second dimension 0) for none: the column encodings of ``probs`` and of its transpose
        (:mod:`abftgemm.checksums`), as a planned product of either would compute them
        (``abftgemm.cpu_kernels.row_sums``, :func:`_fold_columns`)
    """
    bh, sq, sk = scores.shape
    weights, row_weights = _location_weights(sk), _location_weights(sq)
    encode = cols.shape[1] == bh
    observe = stats.shape[0] == bh
    for t in range(bh):
        am = attn_add[min(t, attn_add.shape[0] - 1)]
        keys = key_visible[min(t // heads, key_visible.shape[0] - 1)]
        for i in range(sq):
            row, out = scores[t, i], probs[t, i]
            if observe:  # the raw row's checksums, as abftgemm's row reduction takes them
                sum_row(row[:limits[i]] if limits.shape[0] else row, weights, stats[t, i])
            visible = min(i + 1, sk) if causal else sk
            add = am[min(i, am.shape[0] - 1)]
            # one compiled row per mask combination: the loops test no flag per element
            if has_attn and has_keys:
                _softmax_row(row, scale[0], add, True, keys, True, visible, out)
            elif has_attn:
                _softmax_row(row, scale[0], add, True, keys, False, visible, out)
            elif has_keys:
                _softmax_row(row, scale[0], add, False, keys, True, visible, out)
            else:
                _softmax_row(row, scale[0], add, False, keys, False, visible, out)
            if check:
                # what it stored past `visible` is the zeros it wrote: only the rest is checked
                _check_row_masked(out[:visible], row[:visible], scale[0], add, has_attn, keys,
                                  has_keys, visible, floor, p_min, errors)
            if encode:
                # the row's sums as stored: the column encoding of P^T (entries past `visible`
                # are exact zeros, hidden by causality: nothing to add)
                rows[0, t, i], rows[1, t, i], rows[2, t, i] = row_sums(out[:visible], weights)
                _fold_columns(probs[t], row_weights, i, fields(cols, t), causal)


@numba.njit(cache=True, fastmath=FAST)
def check_forward(probs: Any, scores: Any, scale: Any, key_visible: Any, has_keys: bool,
                  attn_add: Any, has_attn: bool, causal: bool, heads: int, floor: float,
                  p_min: float, errors: Any) -> None:
    """The invariant check of :func:`forward` alone (``probs`` as delivered, any float dtype
    numba reads: float32/float64)."""
    bh, sq, sk = scores.shape
    for t in range(bh):
        am = attn_add[min(t, attn_add.shape[0] - 1)]
        keys = key_visible[min(t // heads, key_visible.shape[0] - 1)]
        for i in range(sq):
            _check_row_masked(probs[t, i], scores[t, i], scale[0], am[min(i, am.shape[0] - 1)],
                              has_attn, keys, has_keys, min(i + 1, sk) if causal else sk, floor,
                              p_min, errors)


@numba.njit(cache=True)
def _location_weights(sk: int) -> Any:
    """The location weights ``(j+1)/seq_k`` of a row, as the planned products compute them."""
    return (np.arange(sk) + 1.0) / max(sk, 1)


@numba.njit(cache=True, inline="always")
def _fold_columns(x: Any, row_weights: Any, i: int, col: Any, causal: bool) -> None:
    """Row ``i`` of ``x`` ``(n_rows, L)`` is final: fold each completed block of eight rows (and
    the last rows) into its column encoding ``col`` (three ``(L,)`` field vectors: plain, weighted by
    ``row_weights``, absolute; zeroed first), as a planned product reading ``x`` would make it
    (``abftgemm.cpu_kernels.sum_columns``, which updates ``col`` once per eight rows, while they are
    still in cache). ``causal``: rows up to ``i`` are zero past column ``i``, which is skipped."""
    if (i + 1) % ROWS_PER_UPDATE and i + 1 < x.shape[0]:
        return
    start = i - i % ROWS_PER_UPDATE
    if start == 0:
        col[0][:] = 0.0
        col[1][:] = 0.0
        col[2][:] = 0.0
    n = min(i + 1, x.shape[1]) if causal else x.shape[1]
    sum_column_prefix(x, row_weights, start, i + 1, col, n)


@numba.njit(cache=True, fastmath=FAST, inline="always")
def _softmax_row(row: Any, sc: Any, add: Any, has_attn: bool, keys: Any, has_keys: bool,
                 visible: int, out: Any) -> None:
    """One masked softmax row into ``out``: keys ``j < visible`` (and ``keys[j]``) are seen; from
    ``visible`` on (hidden by causality) 0 is stored without reading the row. The row's maximum
    is that of the stored ``z`` (the precision of ``sc``), taken as an integer max
    (:func:`ordered_key`): NaN rows take the scalar path whatever it is."""
    ninf = like(sc, -math.inf)
    top_key = ordered_key(ninf)
    nan = False
    for j in range(visible):
        z = row[j] * sc
        if has_attn:
            z = z + add[j]
        seen = z != ninf
        if has_keys:
            seen = seen & keys[j]
        z = like(sc, z if seen else ninf)
        out[j] = z
        top_key = max(top_key, ordered_key(z))
        nan |= z != z
    top = from_ordered_key(top_key)
    if top == ninf:
        top = like(sc, 0.0)  # no visible key: exp(-inf) = 0 everywhere
    total = 0.0
    if nan or not math.isfinite(top):  # NaN or +inf: the exact scalar path propagates them
        for j in range(visible):
            out[j] = math.exp(like(sc, out[j] - top))
            total += out[j]
    else:
        for j in range(visible):
            e = exp_like(out[j] - top)
            out[j] = e
            total += e
    if total == 0:
        total = 1.0
    inv_total = 1.0 / total
    for j in range(visible):
        out[j] = out[j] * inv_total
    out[visible:] = 0  # hidden by causality: exp(-inf) = 0, unread


@numba.njit(cache=True, fastmath=FAST, inline="always")
def _z(s: Any, j: int, sc: Any, add: Any, has_attn: bool) -> Any:
    """Entry ``j``'s ``z``, rounded as :func:`_softmax_row` rounds it (the precision of ``sc``)."""
    z = s[j] * sc
    return like(sc, z + add[j]) if has_attn else z


@numba.njit(cache=True, fastmath=FAST, inline="always")
def _check_row_masked(p: Any, s: Any, sc: Any, add: Any, has_attn: bool, keys: Any,
                      has_keys: bool, visible: int, floor: float, p_min: float,
                      errors: Any) -> None:
    """:func:`_check_row` compiled once per mask combination (no flag tested per element)."""
    if has_attn and has_keys:
        _check_row(p, s, sc, add, True, keys, True, visible, floor, p_min, errors)
    elif has_attn:
        _check_row(p, s, sc, add, True, keys, False, visible, floor, p_min, errors)
    elif has_keys:
        _check_row(p, s, sc, add, False, keys, True, visible, floor, p_min, errors)
    else:
        _check_row(p, s, sc, add, False, keys, False, visible, floor, p_min, errors)


@numba.njit(cache=True, fastmath=FAST, inline="always")
def _check_row(p: Any, s: Any, sc: Any, add: Any, has_attn: bool, keys: Any, has_keys: bool,
               visible: int, floor: float, p_min: float, errors: Any) -> None:
    """Fold one row's invariant errors into ``errors`` (the forward check of
    :func:`check_forward`): z is recomputed from the raw scores, not taken from the softmax's
    own arithmetic. Two passes: the row sum and largest probability, then the log identity as
    the spread ``max D - min D`` of ``D_j = log P_j - z_j`` over the entries it uses, with
    ``max(|z_j| + |log P_j|)`` (what the arithmetic's rounding scales with), in ``p``'s
    precision (eight float32 lanes), maxima as integer maxima of order-preserving keys."""
    n_bad = 0
    n_seen = 0
    total = 0.0
    top_key = ordered_key(like(sc, 0.0))
    for j in range(p.shape[0]):  # one loop over the row: keys j >= visible are hidden
        z = _z(s, j, sc, add, has_attn)
        seen = (j < visible) & (z != -math.inf)
        if has_keys:
            seen = seen & keys[j]
        n_seen += np.int64(seen)
        n_bad += np.int64(seen & (not abs(z) < math.inf))  # INF or NaN; counts vectorize
        total += np.float64(p[j])
        top_key = max(top_key, ordered_key(p[j]))
    if n_bad:
        return
    errors[0] = _worse(errors[0], abs(total - (1.0 if n_seen else 0.0)))
    top = np.float64(from_ordered_key(top_key))
    if not math.isfinite(total) or top <= 0:
        return
    ninf, zero = like(sc, -math.inf), like(sc, 0.0)
    threshold = like(sc, max(floor * top, p_min))
    none = ordered_key(ninf)
    hi = lo = none
    size = ordered_key(zero)
    for j in range(visible):  # finite z here; p above the threshold is a positive normal
        z = _z(s, j, sc, add, has_attn)
        pj = p[j]
        use = (pj > threshold) & (z != ninf)
        if has_keys:
            use = use & keys[j]
        lp = log_like(pj)
        d = lp - z
        hi = max(hi, ordered_key(d if use else ninf))
        lo = max(lo, ordered_key(-d if use else ninf))
        size = max(size, ordered_key(abs(z) + abs(lp) if use else zero))
    if hi == none:
        return
    errors[1] = _worse(errors[1], np.float64(from_ordered_key(hi)) + from_ordered_key(lo))
    errors[2] = _worse(errors[2], np.float64(from_ordered_key(size)))


@numba.njit(cache=True, fastmath=FAST)
def backward(dp: Any, p: Any, scale: Any, causal: bool, check: bool, u: float, tiny: float,
             ds: Any, stats: Any, limits: Any, result: Any, cols: Any, rows: Any, keep: Any,
             keep_scale: float) -> None:
    """``dS = scale * P (dP - rowsum(P dP))``, dP's row checksums and (with ``check``) the
    worst invariant ratio.

    Parameters
    ----------
    dp, p : (n, seq_q, seq_k) float32/float64 (the accumulation dtype)
        With attention dropout, ``dp`` is the gradient of the dropped probabilities (the product
        ``dCL V^T``, whose row checksums are observed as read) and ``p`` the probabilities
        before dropout.
    scale : (1,) array of dp's dtype; pass 1 to get the unscaled dS
    causal : bool
        Row ``i`` of ``P`` is zero from key ``i + 1`` on: those entries of ``dS`` are stored as 0
        without reading ``dP`` (whatever it holds there) or ``P``
    ds : like dp: output
    stats : (n, seq_q, 5) float64: dP's row checksums, as :func:`forward` gives the scores'
        (an empty array for none)
    limits : as :func:`forward`'s, for dP
    result : (3,) float64: ``[worst ratio, its plain error, its plain tolerance]``, folded into
        (start from ``[-1, 0, 0]``; see :func:`attention._cpu_checks.backward_ratio`)
    cols, rows : the column encodings of the (scaled) ``ds`` and of its transpose, as
        :func:`forward` gives those of ``probs`` (with ``check`` only; empty arrays for none)
    keep, keep_scale : (n, seq_q, seq_k) bool and float: attention dropout's mask (True = kept)
        and ``1 / (1 - dropout)``; the gradient of the probabilities is then
        ``dp * keep * keep_scale``, which dS and its invariants use. An empty ``keep`` (first
        dimension 0) for none.
    """
    sc = scale[0]
    n, sq, sk = dp.shape
    weights, row_weights = _location_weights(sk), _location_weights(sq)
    encode = check and cols.shape[1] == n
    observe = stats.shape[0] == n
    dropping = keep.shape[0] == n
    undropped = np.empty(sk if dropping else 0, dp.dtype)
    ks = like(scale[0], keep_scale)
    for t in range(n):
        for i in range(sq):
            dpr, pr, out = dp[t, i], p[t, i], ds[t, i]
            if observe:
                sum_row(dpr[:limits[i]] if limits.shape[0] else dpr, weights, stats[t, i])
            v = min(i + 1, sk) if causal else sk
            if dropping:  # the gradient w.r.t. the probabilities before dropout
                kr = keep[t, i]
                for j in range(v):
                    undropped[j] = dpr[j] * ks if kr[j] else like(ks, 0.0)
                dpr = undropped
            r = 0.0
            for j in range(v):
                r += dpr[j] * pr[j]
            if not check:  # scaled before it is stored: one rounding
                for j in range(v):
                    out[j] = pr[j] * (dpr[j] - r) * sc
                out[v:] = 0
                continue
            for j in range(v):  # the check reads the unscaled dS as stored
                out[j] = pr[j] * (dpr[j] - r)
            backward_row(out[:v], dpr, pr, v, u, tiny, result)
            for j in range(v):
                out[j] = out[j] * sc
            out[v:] = 0
            if encode:
                rows[0, t, i], rows[1, t, i], rows[2, t, i] = row_sums(out[:v], weights)
                _fold_columns(ds[t], row_weights, i, fields(cols, t), causal)
