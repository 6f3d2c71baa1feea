"""Repair one batch item of a flagged product: checksums first, then recomputation, else raise.

Each step is re-verified against checksums derived afresh from the inputs (docs/design.md,
"Classify, repair, recompute, or raise", gives the reasons):

1. the predicted checksums re-derived: if the data now verifies, they were wrong (``checksum``);
2. the located elements' rows (columns, when the row checksums located them) recomputed;
   ``corrected`` only when nothing else changed beyond rounding;
3. the flagged rows and columns recomputed (2D, several errors per vector);
4. the whole matrix recomputed;
5. delivered if every element lies within the rigorous rounding bound of the exact product
   (:func:`_within_rounding`), else :class:`~abftgemm.report.UncorrectableError` raised.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from abftgemm.backend import Backend, to_host
from abftgemm.checksums import smallest_normal, unit_roundoff
from abftgemm.encode import observe, predict
from abftgemm.locate import Diagnosis, Verdict, diagnose, verify
from abftgemm.operands import Operands, item
from abftgemm.report import Report, UncorrectableError
from abftgemm.thresholds import KAPPA, element_tolerance, growth_margin


def repair_batch(be: Backend, op: Operands, out: Any, b: int, verdict: Verdict, site: str,
                 report: Report) -> None:
    """Make ``out[b]`` verify against checksums derived from the inputs, or raise."""
    one = item(op, b)
    view = out[b:b + 1]
    pred = predict(be, one, None)
    fresh = _reverify(be, one, view, pred)
    if fresh.clean:  # the data agrees with checksums derived afresh: the old ones were wrong
        report.events.append(diagnose(verdict, b).event(
            site, b, "checksum-recomputed", _verified("the data left as computed", fresh),
            pattern="checksum"))
        return
    diagnosis = diagnose(fresh, 0)
    first = view.copy()  # the delivered product, to tell rounding from a fault (step 5)
    if diagnosis.cells:
        rows, cols = (sorted(set(ix)) for ix in zip(*diagnosis.cells))
        held = (rows, []) if diagnosis.direction == "cols" else ([], cols)
        explained = _only_located_changed(be, one, view[0], diagnosis, *held)
        after = _reverify(be, one, view, pred)
        if explained and after.clean:
            what = "rows" if diagnosis.direction == "cols" else "columns"
            report.events.append(diagnosis.event(site, b, "corrected", _verified(
                f"the {what} holding the {len(diagnosis.cells)} located elements recomputed "
                "from the inputs", after)))
            return
    _recompute_vectors(be, one, view[0], diagnosis.rows, diagnosis.cols)
    after = _reverify(be, one, view, pred)
    if after.clean:
        report.events.append(diagnosis.event(site, b, "recomputed", _verified(
            "the flagged rows and columns recomputed from the inputs", after)))
        return
    be.gemm(one.a, one.b, view, one.bias)
    after = _reverify(be, one, view, pred)
    done = _verified("the whole product recomputed from the inputs", after)
    if not after.clean:
        if not (_rounding_can_explain(one, verdict, after, b)
                and _within_rounding(one, view[0], diagnose(after, 0))):
            report.events.append(diagnosis.event(site, b, "reported", done))
            raise UncorrectableError(
                f"{site}[{b}]: the product does not verify even after recomputation", report)
        done += "; every element within its rigorous rounding bound of the exact product (float64)"
        if _same_bits(one.xp, first, view):  # the first product again: no fault was in it
            report.events.append(diagnosis.event(site, b, "passed-through", done + (
                ", and bit for bit the product first delivered: its rounding, one-sided beyond "
                "the threshold's statistical accumulation term, not a fault"), pattern="rounding"))
            return
    report.events.append(diagnosis.event(site, b, "recomputed", done, pattern="2D"))


def finding_in_place(be: Backend, op: Operands, out: Any, b: int, verdict: Verdict,
                     computed_here: bool) -> Literal["checksum", "rounding", "data"]:
    """What flagged batch item ``b`` of ``out`` holds, for ``check="detect"`` (``out`` is not
    modified): ``"checksum"`` when it verifies against checksums derived afresh (the predicted
    ones were wrong); ``"rounding"`` when it fails them by no more than rounding can reach,
    :func:`_within_rounding` holds and, when the backend's GEMM made it (``computed_here``), that
    GEMM gives it again bit for bit (a transient fault would not); a caller's product
    (:func:`abftgemm.verify`) is judged by those bounds alone; else ``"data"``."""
    one = item(op, b)
    view = out[b:b + 1]
    fresh = _reverify(be, one, view, predict(be, one, None))
    if fresh.clean:
        return "checksum"
    if not _rounding_can_explain(one, verdict, fresh, b):
        return "data"
    if computed_here:
        again = one.xp.empty_like(view)
        be.gemm(one.a, one.b, again, one.bias)
        if not _same_bits(one.xp, again, view):
            return "data"
    return "rounding" if _within_rounding(one, view[0], diagnose(fresh, 0)) else "data"


def _rounding_can_explain(one: Operands, verdict: Verdict, fresh: Verdict, b: int) -> bool:
    """Whether the worst ``|d| / threshold`` of ``verdict`` (item ``b``) and of ``fresh`` is within
    what rounding can reach: the rigorous accumulation bound over the threshold's statistical
    term, ``1.01 (k + 1) / (KAPPA sqrt(k))``, plus 2 for the output term."""
    k = max(one.k, 1)
    reach = 1.01 * (k + 1) / (KAPPA * math.sqrt(k)) + 2
    found = (diagnose(v, i) for v, i in ((verdict, b), (fresh, 0)))
    return all(d.magnitude <= reach * d.threshold for d in found)  # NaN and INF fail


def _same_bits(xp: Any, x: Any, y: Any) -> bool:
    """``x`` and ``y`` bit for bit (``-0`` is not ``0``; any dtype, bfloat16 on CuPy included)."""
    bits = np.dtype(f"u{x.dtype.itemsize}")
    return bool(xp.array_equal(x.view(bits), y.view(bits)))


def _within_rounding(one: Operands, c: Any, flagged: Diagnosis) -> bool:
    """Whether every element of the rows and columns ``flagged`` names in ``c`` lies within a GEMM's
    rigorous rounding bound of the exact product, in any summation order (Higham, Lemma 3.1):
    ``|c - A B| <= gamma_(k+1) |A||B| + u_out |c|``, plus the float64 reference's rounding, the
    underflow floor and, with a bias, ``u_out |A||B|``. Rounding that is one-sided within a BLAS
    block exceeds the threshold's statistical ``sqrt(k)`` term on clean data."""
    rows, cols = list(flagged.rows), list(flagged.cols)
    if not rows and not cols:
        return False
    a, b, got = (to_host(x).astype(np.float64) for x in (one.a[0], one.b[0], c))
    bias = to_host(one.bias).astype(np.float64) if one.bias is not None else np.zeros(one.n)
    k = max(one.k, 1)
    u_out, floor = unit_roundoff(one.dtype), smallest_normal(one.dtype) * (k + 1)
    c_acc = growth_margin(k, one.dtype) + 2.02 * (k + 1) * 2.0 ** -53 \
        + (u_out if one.bias is not None else 0.0)
    with np.errstate(all="ignore"):  # INF and NaN fail the comparison
        for ix, x, y, g, e in ((rows, a[rows], b, got[rows], bias),
                               (cols, a, b[:, cols], got[:, cols], bias[cols])):
            if not ix:
                continue
            exact, size = x @ y + e, np.abs(x) @ np.abs(y) + np.abs(e)
            if not np.all(np.abs(g - exact) <= c_acc * size + 1.01 * u_out * np.abs(g) + floor):
                return False
    return True


def _reverify(be: Backend, one: Operands, view: Any, pred: tuple[Any, Any]) -> Verdict:
    return verify(be, one, *pred, *observe(be, view))


def _verified(done: str, after: Verdict) -> str:
    """What an event vouches for: what was done, and the re-verification that followed."""
    return (f"{done}; then every row and column checked against checksums derived afresh from "
            f"the inputs: largest |d|/threshold {after.worst_ratio():.2g}"
            f"{'' if after.clean else ', still flagged'}")


def _only_located_changed(be: Backend, one: Operands, c: Any, diagnosis: Diagnosis,
                          rows: Sequence[int], cols: Sequence[int]) -> bool:
    """Recompute rows ``rows`` and columns ``cols`` of ``c``; True when nothing but the located
    elements changed by more than two elements' rounding (the GEMM's and the recomputation's,
    :func:`element_tolerance`): else the fault was wider than located (step 2)."""
    ix = one.xp.asarray(np.array(rows or cols))
    old = to_host(c[ix, :] if rows else c[:, ix].T).astype(np.float64)
    _recompute_vectors(be, one, c, rows, cols)
    new = to_host(c[ix, :] if rows else c[:, ix].T).astype(np.float64)
    a, b = (to_host(x[0]).astype(np.float64) for x in (one.a, one.b))
    size = np.abs(a[rows]) @ np.abs(b) if rows else (np.abs(a) @ np.abs(b[:, cols])).T
    located = np.zeros(new.shape, dtype=bool)
    for i, j in diagnosis.cells:
        located[(rows.index(i), j) if rows else (cols.index(j), i)] = True
    with np.errstate(invalid="ignore"):  # INF - INF: changed
        same = np.abs(new - old) <= 2 * element_tolerance(size, one.k, one.dtype)
    return bool((same | located).all())


def _recompute_vectors(be: Backend, one: Operands, c: Any, rows: Sequence[int],
                       cols: Sequence[int]) -> None:
    if rows:
        ix = one.xp.asarray(np.array(rows))
        c[ix, :] = product_rows(be, one, ix)
    if cols:
        ix = one.xp.asarray(np.array(cols))
        c[:, ix] = product_cols(be, one, ix)


def product_cells(be: Backend, one: Operands, rows: np.ndarray, cols: np.ndarray) -> Any:
    """Elements ``(rows[t], cols[t])`` of the product, recomputed with the backend's GEMM on the
    cheaper of their rows or their columns; a 1-D array in ``one``'s array module."""
    xp = one.xp
    unique_rows, row_of = np.unique(rows, return_inverse=True)
    unique_cols, col_of = np.unique(cols, return_inverse=True)
    if len(unique_rows) * one.n <= one.m * len(unique_cols):
        part = product_rows(be, one, xp.asarray(unique_rows))
        return part[xp.asarray(row_of), xp.asarray(cols)]
    part = product_cols(be, one, xp.asarray(unique_cols))
    return part[xp.asarray(rows), xp.asarray(col_of)]


def product_rows(be: Backend, one: Operands, rows: Any) -> Any:
    """Rows ``rows`` of the product, ``(len(rows), n)``, recomputed with the backend's GEMM."""
    part = one.xp.empty((1, len(rows), one.n), dtype=one.dtype)
    be.gemm(one.a[0][rows][None], one.b, part, one.bias)
    return part[0]


def product_cols(be: Backend, one: Operands, cols: Any) -> Any:
    """Columns ``cols`` of the product, ``(m, len(cols))``, recomputed with the backend's GEMM."""
    xp = one.xp
    part = xp.empty((1, one.m, len(cols)), dtype=one.dtype)
    bias = None if one.bias is None else xp.ascontiguousarray(one.bias[cols])
    be.gemm(one.a, xp.ascontiguousarray(one.b[0][:, cols])[None], part, bias)
    return part[0]
