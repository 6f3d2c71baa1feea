"""CPU (numba) softmax kernels of the attention core, with the GPU kernels' boundaries.

Forward (:func:`forward`): row by row, it reads the raw scores, observes their row checksums
(for the deferred check of the scores product), computes the masked softmax and, while the row is
in cache, checks the softmax invariants on what it stored. Backward (:func:`backward`): row by
row, it observes dP's row checksums (the deferred check of ``d_probs``), computes
``dS = P (dP - r)``, checks dS's two row checksums against closed forms recomputed from P and dP,
and scales dS. The visibility of a key is recomputed from the key-padding mask, causality and the
additive attention mask: no ``(batch*heads, seq_q, seq_k)`` mask is materialized.

The loops are written for LLVM's vectorizer: one compiled kernel per mask combination (no flag
tested per element; see below), float32 ``exp``/``log`` inlined from :mod:`attention._cpu_vmath`, counts
instead of boolean flags, and maxima of the check taken as integer maxima of bit patterns.

The kernels' arguments come in groups (named tuples): the masks (:class:`Masks`), the row
checksums to observe (:class:`Observe`), the check with the encodings it makes
(:class:`ForwardCheck`, :class:`BackwardCheck`) and attention dropout (:class:`Dropout`). An absent
group, or an absent mask in :class:`Masks`, is ``None``: numba compiles one kernel per
combination of present parts, so no loop tests a flag per element and no placeholder array is
passed.

When a fault hook must see the output between computing and checking (fault injection), the
same kernels run without a check group and the invariants are checked by
:func:`check_forward` / :func:`attention._cpu_checks.backward_ratio` afterwards. Invariants,
tolerances and NaN behaviour are those of :mod:`attention.softmax`; checks sum in float64.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from abftgemm.cpu_kernels import (FAST, ROWS_PER_UPDATE, fields, row_sums, sum_column_prefix,
                                  sum_row)
from attention._cpu_checks import _worse, backward_row
from attention._cpu_vmath import exp_like, from_ordered_key, like, log_like, ordered_key


class Masks(NamedTuple):
    """Which keys each query sees."""

    key_visible: Any
    """(batch, seq_k) bool, True = the key may be attended; None for all."""
    attn_add: Any
    """(1 or batch*heads, 1 or seq_q, seq_k) float64 added to the scaled scores (-inf: not
    allowed); None for none."""
    causal: bool
    """Key ``j`` is hidden from query ``i`` when ``j > i``."""
    heads: int
    """Heads per batch item (row ``t`` of the scores is batch item ``t // heads``)."""


class Observe(NamedTuple):
    """The row checksums a kernel observes for the deferred check of the product it reads."""

    stats: Any
    """(n, seq_q, 5) float64: ``[sum, sum (j+1)/seq_k weighted, sum |.|, non-finite count, last
    non-finite index or -1]`` of every row read."""
    limits: Any
    """(seq_q,) int64: observe row ``i``'s first ``limits[i]`` entries only (all that the product
    computed, :attr:`abftgemm.ProtectedMatmul.row_limits`); None for whole rows."""


class ForwardCheck(NamedTuple):
    """The forward's invariant check, and the encodings it makes of what it checked."""

    floor: float
    """With ``p_min``: the log identity skips entries at or below ``max(floor * top, p_min)``,
    ``top`` the row's largest probability."""
    p_min: float
    """The smallest normal number of the dtype the probabilities are delivered in (below it they
    lose relative precision)."""
    errors: Any
    """(3,) float64: ``[worst row-sum error, worst log-identity spread, largest |z| + |log P|
    used]`` are folded into it (start from zeros)."""
    cols: Any
    """(3, n, seq_k) float64: the column encoding of the output (:mod:`abftgemm.checksums`), as
    a planned product reading it would compute it (:func:`_fold_columns`)."""
    rows: Any
    """(3, n, seq_q) float64: that of its transpose (``abftgemm.cpu_kernels.row_sums``)."""


class BackwardCheck(NamedTuple):
    """The backward's invariant check (:func:`attention._cpu_checks.backward_row`), and the
    encodings it makes of the scaled ``dS`` (as :class:`ForwardCheck`'s ``cols``, ``rows``)."""

    u: float
    tiny: float
    result: Any
    """(3,) float64: ``[worst ratio, its plain error, its plain tolerance]``, folded into (start
    from ``[-1, 0, 0]``)."""
    cols: Any
    rows: Any


class Dropout(NamedTuple):
    """Attention dropout of the backward's probabilities."""

    keep: Any
    """(n, seq_q, seq_k) bool, True = kept."""
    scale: float
    """``1 / (1 - dropout)``."""


@numba.njit(cache=True, fastmath=FAST)
def forward(scores: Any, scale: Any, probs: Any, masks: Masks, observe: Observe | None,
            check: ForwardCheck | None) -> None:
    """Masked softmax of ``scale * scores (+ attn_add)`` into ``probs``, the scores' row
    checksums (with ``observe``), and (with ``check``) the invariant errors and the encodings of
    ``probs``.

    Parameters
    ----------
    scores : (batch*heads, seq_q, seq_k) float32/float64, raw ``Q_h K_h^T``
    scale : scalar of the scores' dtype (``1/sqrt(head_dim)``)
    probs : (batch*heads, seq_q, seq_k), dtype of ``scores``: output
    masks : Masks
    observe : Observe, optional
    check : ForwardCheck, optional
    """
    bh, sq, sk = scores.shape
    weights, row_weights = _location_weights(sk), _location_weights(sq)
    for t in range(bh):
        am = _broadcast_row(masks.attn_add, t)
        keys = _broadcast_row(masks.key_visible, t // masks.heads)
        for i in range(sq):
            row, out = scores[t, i], probs[t, i]
            if observe is not None:  # the raw row's checksums, as abftgemm's row reduction
                sum_row(_observed(row, observe.limits, i), weights, observe.stats[t, i])
            visible = min(i + 1, sk) if masks.causal else sk
            add = _broadcast_row(am, i)
            _softmax_row(row, scale, add, keys, visible, out)
            if check is not None:
                # what it stored past `visible` is the zeros it wrote: only the rest is checked
                _check_row(out[:visible], row[:visible], scale, add, keys, visible, check.floor,
                           check.p_min, check.errors)
                # the row's sums as stored: the column encoding of P^T (entries past `visible`
                # are exact zeros, hidden by causality: nothing to add)
                rows = check.rows
                rows[0, t, i], rows[1, t, i], rows[2, t, i] = row_sums(out[:visible], weights)
                _fold_columns(probs[t], row_weights, i, fields(check.cols, t), masks.causal)


@numba.njit(cache=True, fastmath=FAST)
def check_forward(probs: Any, scores: Any, scale: Any, masks: Masks, floor: float,
                  p_min: float, errors: Any) -> None:
    """The invariant check of :func:`forward` alone (``probs`` as delivered, any float dtype
    numba reads: float32/float64; ``floor``, ``p_min``, ``errors`` as in
    :class:`ForwardCheck`)."""
    bh, sq, sk = scores.shape
    for t in range(bh):
        am = _broadcast_row(masks.attn_add, t)
        keys = _broadcast_row(masks.key_visible, t // masks.heads)
        for i in range(sq):
            _check_row(probs[t, i], scores[t, i], scale, _broadcast_row(am, i), keys,
                       min(i + 1, sk) if masks.causal else sk, floor, p_min, errors)


def _broadcast_row(x: Any, i: int) -> Any:
    """``x[i]``, or its last row past its end (a first axis of 1 broadcasts); None for None."""


# The overloads below carry no annotations: numba inlines an overload only when its signature
# equals that of the implementation it returns (a lambda).
@overload(_broadcast_row, inline="always")
def _broadcast_row_impl(x, i):  # type: ignore[no-untyped-def]
    if isinstance(x, types.NoneType):
        return lambda x, i: None
    return lambda x, i: x[min(i, x.shape[0] - 1)]


def _observed(row: Any, limits: Any, i: int) -> Any:
    """The part of ``row`` (row ``i``) that the product computed: its first ``limits[i]``
    entries, or all of it for no limits (None)."""


@overload(_observed, inline="always")
def _observed_impl(row, limits, i):  # type: ignore[no-untyped-def]
    if isinstance(limits, types.NoneType):
        return lambda row, limits, i: row
    return lambda row, limits, i: row[:limits[i]]


def _plus_mask(z: Any, add: Any, j: int) -> Any:
    """``z + add[j]``, or ``z`` without an additive mask (None)."""


@overload(_plus_mask, inline="always")
def _plus_mask_impl(z, add, j):  # type: ignore[no-untyped-def]
    if isinstance(add, types.NoneType):
        return lambda z, add, j: z
    return lambda z, add, j: z + add[j]


def _shown(seen: Any, keys: Any, j: int) -> Any:
    """``seen & keys[j]``, or ``seen`` without a key mask (None)."""


@overload(_shown, inline="always")
def _shown_impl(seen, keys, j):  # type: ignore[no-untyped-def]
    if isinstance(keys, types.NoneType):
        return lambda seen, keys, j: seen
    return lambda seen, keys, j: seen & keys[j]


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
def _softmax_row(row: Any, sc: Any, add: Any, keys: Any, visible: int, out: Any) -> None:
    """One masked softmax row into ``out``: keys ``j < visible`` (and ``keys[j]``, and
    ``add[j] > -inf``; ``keys`` and ``add`` each a row or None) are seen; from
    ``visible`` on (hidden by causality) 0 is stored without reading the row. The row's maximum
    is that of the stored ``z`` (the precision of ``sc``), taken as an integer max
    (:func:`ordered_key`): NaN rows take the scalar path whatever it is."""
    ninf = like(sc, -math.inf)
    top_key = ordered_key(ninf)
    nan = False
    for j in range(visible):
        z = _plus_mask(row[j] * sc, add, j)
        seen = _shown(z != ninf, keys, j)
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
def _z(s: Any, j: int, sc: Any, add: Any) -> Any:
    """Entry ``j``'s ``z``, rounded as :func:`_softmax_row` rounds it (the precision of ``sc``)."""
    return like(sc, _plus_mask(s[j] * sc, add, j))


@numba.njit(cache=True, fastmath=FAST, inline="always")
def _check_row(p: Any, s: Any, sc: Any, add: Any, keys: Any, visible: int, floor: float,
               p_min: float, errors: Any) -> None:
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
        z = _z(s, j, sc, add)
        seen = _shown((j < visible) & (z != -math.inf), keys, j)
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
        z = _z(s, j, sc, add)
        pj = p[j]
        use = _shown((pj > threshold) & (z != ninf), keys, j)
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
def backward(dp: Any, p: Any, scale: Any, causal: bool, ds: Any, observe: Observe | None,
             check: BackwardCheck | None, dropout: Dropout | None) -> None:
    """``dS = scale * P (dP - rowsum(P dP))``, dP's row checksums (with ``observe``) and (with
    ``check``) the worst invariant ratio and the encodings of the scaled ``dS``.

    Parameters
    ----------
    dp, p : (n, seq_q, seq_k) float32/float64 (the accumulation dtype)
        With attention dropout, ``dp`` is the gradient of the dropped probabilities (the product
        ``dCL V^T``, whose row checksums are observed as read) and ``p`` the probabilities
        before dropout.
    scale : scalar of dp's dtype; 1 for the unscaled dS
    causal : bool
        Row ``i`` of ``P`` is zero from key ``i + 1`` on: those entries of ``dS`` are stored as 0
        without reading ``dP`` (whatever it holds there) or ``P``
    ds : like dp: output
    observe : Observe, optional
        dP's row checksums, as :func:`forward` observes the scores'.
    check : BackwardCheck, optional
        (see :func:`attention._cpu_checks.backward_ratio`)
    dropout : Dropout, optional
        The gradient of the probabilities is then ``dp * keep * scale``, which dS and its
        invariants use.
    """
    n, sq, sk = dp.shape
    weights, row_weights = _location_weights(sk), _location_weights(sq)
    undropped = np.empty(sk, dp.dtype)
    for t in range(n):
        for i in range(sq):
            dpr, pr, out = dp[t, i], p[t, i], ds[t, i]
            if observe is not None:
                sum_row(_observed(dpr, observe.limits, i), weights, observe.stats[t, i])
            v = min(i + 1, sk) if causal else sk
            if dropout is not None:  # the gradient w.r.t. the probabilities before dropout
                kr, ks = dropout.keep[t, i], like(scale, dropout.scale)
                for j in range(v):
                    undropped[j] = dpr[j] * ks if kr[j] else like(ks, 0.0)
                dpr = undropped
            r = 0.0
            for j in range(v):
                r += dpr[j] * pr[j]
            if check is None:  # scaled before it is stored: one rounding
                for j in range(v):
                    out[j] = pr[j] * (dpr[j] - r) * scale
                out[v:] = 0
                continue
            for j in range(v):  # the check reads the unscaled dS as stored
                out[j] = pr[j] * (dpr[j] - r)
            backward_row(out[:v], dpr, pr, v, check.u, check.tiny, check.result)
            for j in range(v):
                out[j] = out[j] * scale
            out[v:] = 0
            rows = check.rows
            rows[0, t, i], rows[1, t, i], rows[2, t, i] = row_sums(out[:v], weights)
            _fold_columns(ds[t], row_weights, i, fields(check.cols, t), causal)
