"""Settle, element by element, what checksums cannot judge: non-finite inputs and overflow
(docs/design.md, "Non-finite inputs and overflow", states the rules).

The elements whose row AND column both escaped checksum verification (backend ``flag``) are
compared, on the host, with a float64 model of each, not with a recomputation, since at the
overflow boundary one summation order overflows where another does not. From
``e_ij = sum_c a_ic b_cj (+ bias_j)`` and the sums ``P+_ij``, ``P-_ij`` of its positive and
negative terms, rounding allows a finite value within
:func:`~abftgemm.thresholds.element_tolerance` of ``e_ij`` (twice: the model is a float64
computation too), ``+INF`` when ``(1 + delta) P+_ij`` reaches the accumulator's limit
(:func:`~abftgemm.thresholds.growth_margin`) or ``e_ij`` rounds past the output's, ``-INF``
likewise with ``P-_ij``, and NaN only when both can. Where the element's own inputs hold INF/NaN,
the terms no summation makes finite decide (:func:`_forced`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from abftgemm.backend import Backend, to_host
from abftgemm.checksums import accumulation_dtype
from abftgemm.locate import Verdict, cell_pattern
from abftgemm.operands import Operands, item
from abftgemm.repair import product_cells
from abftgemm.report import Event, Report, UncorrectableError
from abftgemm.threads import blas_scope
from abftgemm.thresholds import element_tolerance, growth_margin, largest_finite

#: Float64 operands are scaled (exactly, by powers of two) below 2**_SCALED_EXPONENT, so that the
#: model's products stay below 2**1000 and a sum of fewer than 2**23 of them stays finite.
_SCALED_EXPONENT = 500
#: What the events of this module vouch for (Event.verified).
_PASSED = ("each element checked against a float64 model of it from the inputs: the inputs' "
           "INF/NaN or rounding allow it; passed through as computed")
_RECOMPUTED = ("the faulty elements recomputed from the inputs; then each checked against a "
               "float64 model of it: within element_tolerance, or an overflow rounding allows")


def settle_unverifiable(be: Backend, op: Operands, out: Any, verdict: Verdict, check: str,
                        site: str, report: Report) -> list[int]:
    """Settle every element of ``out`` ``(batch, m, n)`` that no vector ``verdict`` judged
    covers; ``report`` receives ``input-nonfinite`` and ``overflow`` events, and the faults found,
    which ``check == "correct"`` replaces in place. Returns the batch indices modified; raises
    :class:`~abftgemm.report.UncorrectableError` when a replacement is still not allowed."""
    return [b for b, rows, cols in verdict.unverifiable()
            if _settle_item(be, item(op, b), out[b], rows, cols, b, check, site, report)]


@dataclass
class _Model:
    """Float64 model of the elements ``rows x cols`` of one product, in scaled units."""

    exact: np.ndarray          # (r, c) e_ij
    positive: np.ndarray       # (r, c) P+_ij
    negative: np.ndarray       # (r, c) P-_ij
    shift: np.ndarray          # (r, c) int: element (i, j) is judged in units of 2**shift
    inputs_finite: np.ndarray  # (r, c) bool: row i of a, column j of b and bias_j are finite
    forced: np.ndarray         # (r, c) int: _ANY, _PLUS, _MINUS or _NAN
    skippable: np.ndarray      # (r, c) bool: a term of a zero and an INF or NaN factor
    k: int
    dtype: np.dtype

    def allows(self, delivered: np.ndarray) -> np.ndarray:
        """(r, c) bool: ``delivered`` (float64) is an outcome rounding allows, or, where the
        inputs are not finite, one that their non-finite terms allow (docs/design.md)."""
        out_limit, acc_limit = (np.ldexp(largest_finite(t), -self.shift)
                                for t in (self.dtype, accumulation_dtype(self.dtype)))
        growth = 1 + growth_margin(self.k, self.dtype)
        up, down = (terms * growth >= acc_limit for terms in (self.positive, self.negative))
        tol = self.tolerance()
        d = np.ldexp(delivered, -self.shift)
        with np.errstate(invalid="ignore"):  # INF - INF in the finite test: not allowed there
            finite = np.abs(d - self.exact) <= tol
        plus = (d == np.inf) & (up | (self.exact + tol >= out_limit))
        minus = (d == -np.inf) & (down | (self.exact - tol <= -out_limit))
        nan = np.isnan(d)
        rounding = finite | plus | minus | (nan & up & down)
        nonfinite = np.select(
            [self.forced == _NAN, self.forced == _PLUS, self.forced == _MINUS],
            [nan, (d == np.inf) | (nan & (self.skippable | down)),
             (d == -np.inf) | (nan & (self.skippable | up))],
            nan | rounding)  # _ANY: zero-factor terms only, computed (NaN) or skipped
        return np.where(self.inputs_finite, rounding, nonfinite)

    def tolerance(self) -> np.ndarray:
        """(r, c) how far a finite element may sit from the model (scaled units)."""
        size = self.positive + self.negative
        return element_tolerance(size, self.k, self.dtype) \
            + element_tolerance(size, self.k, np.float64)


def _model(one: Operands, rows: np.ndarray, cols: np.ndarray) -> _Model:
    xp = one.xp
    a = to_host(one.a[0][xp.asarray(rows)]).astype(np.float64)
    b = to_host(one.b[0][:, xp.asarray(cols)]).astype(np.float64)
    bias = np.zeros(len(cols)) if one.bias is None else \
        to_host(one.bias[xp.asarray(cols)]).astype(np.float64)
    a_finite, b_finite = np.isfinite(a), np.isfinite(b)
    inputs_finite = a_finite.all(1)[:, None] & (b_finite.all(0) & np.isfinite(bias))[None, :]
    forced, skippable = _forced(a, b, bias) if not inputs_finite.all() else \
        (np.zeros(inputs_finite.shape, int), np.zeros(inputs_finite.shape, bool))
    a, b, bias = np.where(a_finite, a, 0), np.where(b_finite, b, 0), np.nan_to_num(bias)
    shift_a = _shift(np.abs(a).max(1, initial=0))
    shift_b = _shift(np.maximum(np.abs(b).max(0, initial=0), np.abs(bias)))
    shift = shift_a[:, None] + shift_b[None, :]
    a, b = np.ldexp(a, -shift_a[:, None]), np.ldexp(b, -shift_b[None, :])
    bias = np.ldexp(bias[None, :], -shift)
    a_pos, a_neg, b_pos, b_neg = np.maximum(a, 0), np.maximum(-a, 0), np.maximum(b, 0), \
        np.maximum(-b, 0)
    with blas_scope():
        positive = a_pos @ b_pos + a_neg @ b_neg + np.maximum(bias, 0)
        negative = a_pos @ b_neg + a_neg @ b_pos + np.maximum(-bias, 0)
        exact = a @ b + bias
    return _Model(exact, positive, negative, shift, inputs_finite, forced, skippable, one.k,
                  np.dtype(one.dtype))


#: What an element's non-finite terms allow (:func:`_forced`): any value, ``+INF`` or NaN,
#: ``-INF`` or NaN, NaN.
_ANY, _PLUS, _MINUS, _NAN = range(4)


def _forced(a: np.ndarray, b: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(forced, skippable)``, (r, c) each: what the non-finite terms of ``a @ b + bias`` allow
    (docs/design.md), and whether a term has a zero and a non-finite factor; from counts that
    are products of indicator matrices (exact in float64)."""
    fin_a = np.isfinite(a)
    pos_a, neg_a, pos_b, neg_b = a > 0, a < 0, b > 0, b < 0
    inf_a, minf_a, inf_b, minf_b = a == np.inf, a == -np.inf, b == np.inf, b == -np.inf
    f = np.float64
    with blas_scope():
        plus = inf_a.astype(f) @ pos_b + minf_a.astype(f) @ neg_b \
            + (fin_a & pos_a).astype(f) @ inf_b + (fin_a & neg_a).astype(f) @ minf_b
        minus = inf_a.astype(f) @ neg_b + minf_a.astype(f) @ pos_b \
            + (fin_a & pos_a).astype(f) @ minf_b + (fin_a & neg_a).astype(f) @ inf_b
        nan = np.isnan(a).astype(f) @ (b != 0) + ((a != 0) & ~np.isnan(a)).astype(f) @ np.isnan(b)
        skippable = (~fin_a).astype(f) @ (b == 0) + (a == 0).astype(f) @ ~np.isfinite(b)
    plus, minus = plus + (bias == np.inf), minus + (bias == -np.inf)
    nan = nan + np.isnan(bias) + ((plus > 0) & (minus > 0))
    return np.select([nan > 0, plus > 0, minus > 0], [_NAN, _PLUS, _MINUS], _ANY), skippable > 0


def _shift(magnitude: np.ndarray) -> np.ndarray:
    """Power-of-two exponents that bring ``magnitude`` below ``2**_SCALED_EXPONENT`` (0 for all
    but huge float64 values)."""
    return np.maximum(np.frexp(magnitude)[1] - _SCALED_EXPONENT, 0)


def _settle_item(be: Backend, one: Operands, c: Any, rows: np.ndarray, cols: np.ndarray, b: int,
                 check: str, site: str, report: Report) -> bool:
    """Settle elements ``rows x cols`` of product ``c`` ``(m, n)``; True when ``c`` changed."""
    xp = one.xp
    model = _model(one, rows, cols)
    delivered = to_host(c[xp.asarray(rows)][:, xp.asarray(cols)]).astype(np.float64)
    allowed = model.allows(delivered)
    for pattern, cells in (("input-nonfinite", ~model.inputs_finite & allowed),
                           ("overflow", ~np.isfinite(delivered) & allowed & model.inputs_finite)):
        if cells.any():
            report.events.append(_event(site, b, pattern, rows, cols, cells, float("nan"),
                                        float("nan"), "passed-through", _PASSED))
    if allowed.all():
        return False
    faulty = ~allowed
    fi, fj = faulty.nonzero()
    with np.errstate(invalid="ignore", over="ignore"):
        gap = np.where(faulty, np.abs(delivered - np.ldexp(model.exact, model.shift)), 0)
    worst = np.unravel_index(np.argmax(np.where(np.isnan(gap), np.inf, gap)), gap.shape)
    magnitude, threshold = float(gap[worst]), float(np.ldexp(model.tolerance(), model.shift)[worst])
    pattern = cell_pattern([(int(rows[i]), int(cols[j])) for i, j in zip(fi, fj)])
    if check == "detect":
        report.events.append(_event(site, b, pattern, rows, cols, faulty, magnitude, threshold,
                                    "reported", "nothing: left in place (check='detect')"))
        return False
    cell_rows, cell_cols = rows[fi], cols[fj]
    c[xp.asarray(cell_rows), xp.asarray(cell_cols)] = product_cells(be, one, cell_rows, cell_cols)
    fixed = to_host(c[xp.asarray(rows)][:, xp.asarray(cols)]).astype(np.float64)
    ok = bool(model.allows(fixed)[faulty].all())
    report.events.append(_event(site, b, pattern, rows, cols, faulty, magnitude, threshold,
                                "recomputed" if ok else "reported",
                                _RECOMPUTED + ("" if ok else ", and they are not")))
    if not ok:
        raise UncorrectableError(f"{site}[{b}]: recomputed elements are still not what the "
                                 "inputs allow", report)
    return True


def _event(site: str, b: int, pattern: str, rows: np.ndarray, cols: np.ndarray, mask: np.ndarray,
           magnitude: float, threshold: float, action: str, verified: str) -> Event:
    """An event naming the rows and columns of the cells ``mask`` selects in ``rows x cols``."""
    return Event(site, b, pattern, tuple(int(r) for r in rows[mask.any(1)]),
                 tuple(int(j) for j in cols[mask.any(0)]), magnitude, threshold, action, verified)
