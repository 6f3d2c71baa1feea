"""Masked softmax, forward and backward, each checked by an invariant that does not share its work.

Softmax is not linear, so GEMM checksums cannot pass through it. Instead:

- forward: every row with a visible key sums to 1 (hidden rows to 0), and the log-domain identity
  ``log P_ij - log P_i,max = z_ij - z_i,max`` holds for every visible entry that is not negligible.
  The forward pass computes ``exp(z - max) / sum``; the check takes logarithms of what was
  delivered, so a fault in the exponential, the sum or the division cannot cancel out;
- backward: ``dS = P * (dP - r)``, ``r = rowsum(dP * P)``, has rows summing to 0 (exactly
  ``r (1 - sum P)`` for a P whose rows sum to 1 only up to rounding) and rows whose dP-weighted
  sum is the variance ``sum P dP**2 - r**2``, whatever ``dP``.

Arithmetic runs in float32 for 16- and 32-bit layers (float64 for float64) and the result is
stored in the layer's dtype. A check that fails triggers one recomputation; if that fails too, the
layer raises :class:`abftgemm.UncorrectableError`.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from abftgemm.checksums import accumulation_dtype, unit_roundoff
from abftgemm.report import Event, Report, UncorrectableError, announce

#: P entries below this fraction of their row's maximum are skipped by the log identity: their
#: logarithms are dominated by the rounding of tiny numbers, and they carry almost no weight.
LOG_CHECK_FLOOR = 1e-3


def softmax_forward(z: Any, visible: Any | None, dtype: np.dtype) -> Any:
    """Softmax over the last axis of scaled scores ``z`` (accumulation dtype) where ``visible``.

    Rows with no visible entry give all zeros; a visible NaN makes its row NaN, as plain
    arithmetic does (the GPU kernel behaves the same). Returns ``P`` in ``dtype``.
    """
    xp = _xp(z)
    if visible is not None:
        z = xp.where(visible, z, -np.inf)
    top = z.max(axis=-1, keepdims=True)
    top = xp.where(top == -np.inf, 0, top)  # no visible key: exp(-inf) = 0 everywhere
    e = xp.exp(z - top)
    total = e.sum(axis=-1, keepdims=True)
    return (e / xp.where(total == 0, 1, total)).astype(dtype)


def softmax_with_row_stats(scores: Any, z: Any | None, scale: float, visible: Any | None,
                           key_mask: Any | None, causal: bool, heads: int, dtype: np.dtype,
                           want_stats: bool) -> tuple[Any, Any | None]:
    """``P`` from raw scores ``(batch*heads, seq, seq)`` and the row checksums of the scores.

    The row statistics are what :meth:`abftgemm.DeferredCheck.verify_rows` needs. On the GPU one
    fused kernel reads the raw scores once for both (``z`` is not used; the statistics come for
    free). On the CPU the softmax runs on the scaled scores ``z`` and, only when ``want_stats``,
    a row reduction of the raw scores follows (otherwise the statistics are None).
    """
    xp = _xp(scores)
    if xp.__name__ == "cupy":
        from abftgemm import _cuda_softmax

        return _cuda_softmax.softmax_rows(scores, scale, key_mask, causal, heads, scores.shape[-1])
    stats = None
    if want_stats:
        from abftgemm.backend import get_backend

        stats = np.empty(scores.shape[:-1] + (5,))
        get_backend(np).row_reduce(scores, None, stats)
    return softmax_forward(z, visible, dtype), stats


def check_forward(p: Any, z: Any, visible: Any | None) -> tuple[bool, float, float]:
    """Verify ``P`` against the two forward invariants; returns (ok, worst error, tolerance).

    Rows whose visible scores are not all finite are left out: the scores were verified before
    the softmax, so such rows come from non-finite inputs and pass through as plain softmax
    would compute them. NumPy arrays are checked by the numba kernel of
    :mod:`attention._cpu_checks`, CuPy arrays by array operations; same invariants, same
    tolerances.
    """
    xp = _xp(z)
    acc = z.dtype
    if not z.size:
        errors = (0.0, 0.0, 0.0)
    elif xp is np:
        from attention import _cpu_checks  # numba: loaded with the CPU path only

        visible_rows = None if visible is None else _cpu_checks.rows(visible)
        errors = _cpu_checks.forward_errors(_cpu_checks.rows(p, acc), _cpu_checks.rows(z),
                                            visible_rows, LOG_CHECK_FLOOR)
    else:
        errors = _forward_errors(p.astype(acc), z, visible)
    return _forward_verdict(errors, p.dtype, acc, z.shape[-1])


def _forward_verdict(errors: tuple[float, float, float], p_dtype: np.dtype, acc: np.dtype,
                     length: int) -> tuple[bool, float, float]:
    """(ok, worst error, its tolerance) from ``(worst row-sum error, worst log-identity error,
    largest |z| the identity used)`` of probabilities stored in ``p_dtype``, rows of ``length``."""
    worst_row, worst_log, z_max = errors
    u = unit_roundoff(p_dtype) + length * unit_roundoff(acc)
    row_tol = 4 * u
    # relative error of P entries >= floor*top is ~u each; logs turn that into absolute ~2u
    log_tol = 8 * u + 4 * unit_roundoff(acc) * z_max
    ok = math.isfinite(worst_row) and math.isfinite(worst_log) and worst_row <= row_tol \
        and worst_log <= log_tol
    worst, tol = (worst_row, row_tol) if worst_row / row_tol >= worst_log / log_tol else \
        (worst_log, log_tol)
    return ok, worst, tol


def _forward_errors(p: Any, z: Any, visible: Any | None) -> tuple[float, float, float]:
    """Array-module version of :func:`attention._cpu_checks.forward_errors` (for CuPy)."""
    xp = _xp(z)
    finite = xp.isfinite(z) if visible is None else (xp.isfinite(z) | ~visible)
    rows = finite.all(-1)
    rows_visible = xp.ones(p.shape[:-1], dtype=bool) if visible is None else visible.any(-1)
    row_error = xp.where(rows, xp.abs(p.sum(-1) - rows_visible), 0)
    # log identity on the entries that matter
    top = p.max(axis=-1, keepdims=True)
    z_top = xp.take_along_axis(z, p.argmax(axis=-1)[..., None], axis=-1)
    used = (p > LOG_CHECK_FLOOR * top) & rows[..., None]
    if visible is not None:
        used &= visible
    with np.errstate(divide="ignore", invalid="ignore"):
        log_gap = xp.log(xp.where(used, p, 1)) - xp.log(xp.where(top > 0, top, 1)) - (
            xp.where(used, z, 0) - xp.where(used, z_top, 0))
    log_error = xp.where(used, xp.abs(log_gap), 0)
    return (float(row_error.max()), float(log_error.max()),
            float(xp.where(used, xp.abs(z), 0).max()))


def softmax_backward(dp: Any, p: Any, dtype: np.dtype) -> Any:
    """``dS = P * (dP - rowsum(dP * P))`` in the accumulation dtype of ``dtype``."""
    acc = accumulation_dtype(dtype)
    p, dp = p.astype(acc), dp.astype(acc)
    return p * (dp - (dp * p).sum(axis=-1, keepdims=True))


def check_backward(ds: Any, dp: Any, p: Any) -> tuple[bool, float, float]:
    """Two checksums of each row of ``dS``, against closed forms computed here from P and dP.

    With ``r = rowsum(dP * P)`` (recomputed here, not taken from the backward pass):

    - plain: ``sum_j dS_ij = r (1 - sum_j P_ij)`` (0 when P's rows sum to 1; the factor accounts
      for P stored in a low-precision dtype);
    - weighted by dP: ``sum_j dS_ij dP_ij = sum_j P_ij dP_ij**2 - r**2`` (a variance), which also
      catches faults that keep the plain sum, such as a scaled row.

    Rows whose P or dP hold INF/NaN (the user's non-finite data, or an overflow upstream; a
    fault there was caught by the check of the product or softmax that made them) are not
    judged: their dS passes through as plain math computes it. A fault in dS itself leaves
    P and dP finite and is judged. Returns (ok, plain error, plain tolerance) of the row that is
    worst by either checksum. NumPy arrays go through the numba kernel of
    :mod:`attention._cpu_checks`.
    """
    xp = _xp(ds)
    acc = ds.dtype
    u, tiny = _backward_tolerance(ds)
    if not ds.size:
        return True, 0.0, tiny
    if xp is np:
        from attention import _cpu_checks  # numba: loaded with the CPU path only

        rows = _cpu_checks.rows
        worst, err, tol = _cpu_checks.backward_ratio(rows(ds), rows(dp, acc), rows(p, acc), u,
                                                     tiny)
    else:
        worst, err, tol = _backward_ratio(ds, dp.astype(acc), p.astype(acc), u, tiny)
    return worst <= 1, err, tol


def _backward_tolerance(ds: Any) -> tuple[float, float]:
    """``(u, tiny)``: a row's tolerance is ``u * (sum of its magnitudes) + tiny``."""
    return 8 * ds.shape[-1] * unit_roundoff(ds.dtype), float(np.finfo(ds.dtype).tiny)


def _backward_ratio(ds: Any, dp: Any, p: Any, u: float, tiny: float) -> tuple[float, float, float]:
    """Array-module version of :func:`attention._cpu_checks.backward_ratio` (for CuPy)."""
    xp = _xp(ds)
    terms = p * dp
    r = terms.sum(-1)
    plain_err = xp.abs(ds.sum(-1) - r * (1 - p.sum(-1)))
    plain_tol = u * (xp.abs(terms).sum(-1) + xp.abs(ds).sum(-1) + xp.abs(r)) + tiny
    second = (terms * dp).sum(-1)
    weighted_err = xp.abs((ds * dp).sum(-1) - (second - r * r))
    weighted_tol = u * (xp.abs(second) + r * r + xp.abs(ds * dp).sum(-1)) + tiny
    with np.errstate(invalid="ignore"):  # NaN errors become an infinite ratio just below
        ratio = xp.maximum(plain_err / plain_tol, weighted_err / weighted_tol)
    ratio = xp.where(xp.isfinite(ratio), ratio, np.inf)
    # Rows with INF/NaN in P or dP (or overflowing the check's arithmetic) are not judged.
    judged = xp.isfinite(p.sum(-1)) & xp.isfinite(xp.abs(terms).sum(-1)) & xp.isfinite(second)
    ratio = xp.where(judged, ratio, -1.0)
    t = int(xp.argmax(ratio))
    return (float(ratio.reshape(-1)[t]), float(plain_err.reshape(-1)[t]),
            float(plain_tol.reshape(-1)[t]))


def checked(site: str, out: Any, recompute: Callable[[], Any],
            verify: Callable[[Any], tuple[bool, float, float]], check: str, report: Report,
            fault_hook: Callable | None) -> Any:
    """Let ``fault_hook`` corrupt ``out``, verify it; if that fails, ``recompute()`` once.

    ``check="off"`` skips verification, ``"detect"`` reports without recomputing.
    """
    if fault_hook is not None:
        fault_hook(site, out)
    if check == "off":
        return out
    report.checked[site] = report.checked.get(site, 0) + 1
    ok, worst, tol = verify(out)
    if ok:
        return out
    if check == "detect":
        report.events.append(Event(site, 0, "2D", (), (), worst, tol, "reported"))
        announce(report.events[-1])
        return out
    out = recompute()
    ok, worst_again, tol_again = verify(out)
    report.events.append(Event(site, 0, "2D", (), (), worst, tol,
                               "recomputed" if ok else "reported"))
    if not ok:
        raise UncorrectableError(f"{site}: invariant still violated after recomputation "
                                 f"({worst_again:.3g} > {tol_again:.3g})", report)
    return out


def _xp(x: Any) -> Any:
    from abftgemm.backend import array_module

    return array_module(x)


# ------------------------------------------------------------------ the layer's softmax steps


class ForwardStep:
    """The forward softmax of one pass: probabilities, the scores' observed row checksums (into
    ``plan.observed`` when the scores are checked) and the invariant verdict.

    Without a fault hook, float32/float64 layers on the CPU run one fused kernel
    (:func:`attention._cpu_softmax.forward`); with one, the hook sees ``P`` between computing
    and checking. ``verdict`` is ``(ok, worst, tolerance)``, or None with ``check="off"``.
    """

    def __init__(self, inp: Any, scores: Any, probs: Any, ctx: Any, ws: Any, plan: Any | None):
        self.inp, self.scores, self.probs, self.ctx, self.ws, self.plan = \
            inp, scores, probs, ctx, ws, plan
        self.verdict: tuple[bool, float, float] | None = None
        self.run()

    def run(self) -> None:
        """Compute (again, after the scores were repaired), let the hook see ``P``, check."""
        check, hook = self.ctx.check != "off", self.ctx.fault_hook
        errors = self._compute(fused=check and hook is None)
        if hook is not None:
            hook("softmax", self.probs)
        if check:
            self.verdict = self._verdict(errors if hook is None else None)

    def recompute(self) -> tuple[bool, float, float]:
        """Recompute after a failed invariant; the new verdict."""
        self.verdict = self._verdict(self._compute(fused=True))
        return self.verdict

    def _stats(self) -> Any:
        if self.plan is not None:
            return self.plan.observed
        return self.ws.buffer("softmax_stats", _xp(self.scores), self.scores.shape[:2] + (5,),
                              np.float64)

    def _compute(self, fused: bool) -> Any | None:
        """Fill ``probs`` and the stats; the invariant errors when ``fused`` on the CPU."""
        inp, scores = self.inp, self.scores
        xp = _xp(scores)
        scale = 1 / math.sqrt(inp.head_dim)
        if xp is not np:
            z = self._z()
            self.probs[...] = softmax_forward(z, self._visible(), self.probs.dtype)
            if self.plan is not None:
                from abftgemm.backend import get_backend

                get_backend(xp).row_reduce(scores, None, self.plan.observed)
            return None
        from attention import _cpu_softmax

        wide = scores.dtype.itemsize == 2
        s = scores.astype(np.float32) if wide else scores
        out = self.ws.buffer("probs32", np, scores.shape, np.float32) if wide else self.probs
        errors = np.zeros(3)
        _cpu_softmax.forward(s, np.array([scale], s.dtype), *self._masks(), inp.causal,
                             inp.n_heads, fused and not wide, LOG_CHECK_FLOOR, out,
                             self._stats(), errors)
        if wide:
            self.probs[...] = out
        return errors if fused and not wide else None

    def _masks(self) -> tuple[Any, bool, Any, bool]:
        inp = self.inp
        keys = inp.key_visible if inp.key_visible is not None else np.ones((1, 1), bool)
        add = inp.attn_add if inp.attn_add is not None else np.zeros((1, 1, 1))
        return keys, inp.key_visible is not None, add, inp.attn_add is not None

    def _verdict(self, errors: Any | None) -> tuple[bool, float, float]:
        probs, scores = self.probs, self.scores
        acc = accumulation_dtype(probs.dtype)
        if errors is None:
            xp = _xp(scores)
            if xp is np:
                from attention import _cpu_softmax

                s = scores.astype(acc)
                errors = np.zeros(3)
                _cpu_softmax.check_forward(probs.astype(acc), s,
                                           np.array([1 / math.sqrt(self.inp.head_dim)], acc),
                                           *self._masks(), self.inp.causal, self.inp.n_heads,
                                           LOG_CHECK_FLOOR, errors)
            else:
                return check_forward(probs, self._z(), self._visible())
        return _forward_verdict(tuple(float(e) for e in errors), probs.dtype, acc,
                                scores.shape[-1])

    def _z(self) -> Any:
        """Scaled (and attention-masked) scores in the accumulation dtype (array version)."""
        acc = accumulation_dtype(self.scores.dtype)
        z = self.scores.astype(acc) * (1 / math.sqrt(self.inp.head_dim))
        return z if self.inp.attn_add is None else z + self.inp.attn_add.astype(acc)

    def _visible(self) -> Any | None:
        """Boolean ``(batch*heads, seq_q, seq_k)`` visibility (array version, for CuPy)."""
        inp, (bh, sq, sk) = self.inp, self.scores.shape
        xp = _xp(self.scores)
        if inp.key_visible is None and not inp.causal and inp.attn_add is None:
            return None
        vis = xp.ones((bh // inp.n_heads, inp.n_heads, sq, sk), dtype=bool)
        if inp.key_visible is not None:
            vis &= inp.key_visible[:, None, None, :]
        if inp.causal:
            vis &= xp.tril(xp.ones((sq, sk), dtype=bool))
        vis = vis.reshape(bh, sq, sk)
        if inp.attn_add is not None:
            vis &= inp.attn_add != -np.inf
        return vis


class BackwardStep:
    """The backward softmax of one pass: ``dS`` (scaled, into ``d_scores``), dP's observed row
    checksums (into ``plan.observed``) and the invariant verdict; see :class:`ForwardStep`."""

    def __init__(self, d_probs: Any, probs: Any, d_scores: Any, scale: float, ctx: Any, ws: Any,
                 plan: Any | None):
        self.dp, self.p, self.ds, self.scale = d_probs, probs, d_scores, scale
        self.ctx, self.ws, self.plan = ctx, ws, plan
        self.verdict: tuple[bool, float, float] | None = None
        self.run()

    def run(self) -> None:
        check, hook = self.ctx.check != "off", self.ctx.fault_hook
        xp = _xp(self.dp)
        if xp is not np or self.dp.dtype.itemsize == 2 or hook is not None or not check:
            ds = self._unscaled()
            if hook is not None:
                hook("softmax_backward", ds)
            if check:
                self.verdict = check_backward(ds, self._acc(self.dp), self._acc(self.p))
            self.ds[...] = ds * ds.dtype.type(self.scale)
            return
        from attention import _cpu_softmax

        u, tiny = _backward_tolerance(self.ds)
        result = np.array([-1.0, 0.0, 0.0])
        _cpu_softmax.backward(self.dp, self.p, np.array([self.scale], self.dp.dtype), True, u,
                              tiny, self.ds, self._stats(), result)
        self.verdict = (result[0] <= 1, float(result[1]), float(result[2]) or tiny)

    def recompute(self) -> tuple[bool, float, float]:
        ds = self._unscaled()
        self.verdict = check_backward(ds, self._acc(self.dp), self._acc(self.p))
        self.ds[...] = ds * ds.dtype.type(self.scale)
        return self.verdict

    def _acc(self, x: Any) -> Any:
        acc = accumulation_dtype(x.dtype)
        return x if x.dtype == acc else x.astype(acc)

    def _stats(self) -> Any:
        if self.plan is not None:
            return self.plan.observed
        return self.ws.buffer("softmax_backward_stats", _xp(self.dp), self.dp.shape[:2] + (5,),
                              np.float64)

    def _unscaled(self) -> Any:
        """Unscaled ``dS`` in the accumulation dtype, and dP's row checksums."""
        xp = _xp(self.dp)
        dp, p = self._acc(self.dp), self._acc(self.p)
        if xp is not np:
            if self.plan is not None:
                from abftgemm.backend import get_backend

                get_backend(xp).row_reduce(self.dp, None, self.plan.observed)
            return softmax_backward(dp, p, self.dp.dtype)
        from attention import _cpu_softmax

        ds = self.ws.buffer("ds_unscaled", np, dp.shape, dp.dtype)
        _cpu_softmax.backward(dp, p, np.ones(1, dp.dtype), False, 0.0, 0.0, ds, self._stats(),
                              np.zeros(3))
        return ds
