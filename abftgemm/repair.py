"""Repair one batch item of a flagged product: checksums first, then recomputation, else raise.

The order, each step re-verified against checksums derived afresh from the inputs:

1. re-derive the predicted checksums; if the data now verifies, the checksum was wrong
   (``checksum``), and the data is left alone;
2. rebuild the located elements from the checksums (0D, 1R, 1C, scattered single errors):
   ``c_ij = predicted_sum_j - sum of the other elements`` -- never ``c_ij + d``, which loses
   everything to cancellation when ``c_ij`` is huge and is NaN when it is INF -- and confirm each
   rebuilt element against the same element recomputed from the inputs. Several errors in one
   vector can locate like a single one, and rebuilding at the wrong place can leave a pattern no
   checksum sees (a float16 4x4 tile of near-INF errors was "rebuilt" into +-v patterns whose row,
   column and weighted sums all cancel): without the confirmation that product verified clean
   and was returned wrong;
3. recompute the flagged rows and columns from the inputs (2D, several errors per vector);
4. recompute the whole matrix;
5. raise :class:`~abftgemm.report.UncorrectableError` with the report.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from abftgemm.backend import Backend, to_host
from abftgemm.encode import observe, predict
from abftgemm.locate import Diagnosis, Verdict, diagnose, verify
from abftgemm.operands import Operands, item
from abftgemm.report import Report, UncorrectableError
from abftgemm.thresholds import element_tolerance, threshold


def repair_batch(be: Backend, op: Operands, out: Any, b: int, verdict: Verdict, site: str,
                 report: Report) -> None:
    """Make ``out[b]`` verify against checksums derived from the inputs, or raise."""
    one = item(op, b)
    view = out[b:b + 1]
    pred = predict(be, one, None, None)
    fresh = _reverify(be, one, view, pred)
    if fresh.clean:  # the data agrees with checksums derived afresh: the old ones were wrong
        report.events.append(diagnose(verdict, b).event(site, b, "checksum-recomputed",
                                                        pattern="checksum"))
        return
    diagnosis = diagnose(fresh, 0)
    if diagnosis.cells:
        with np.errstate(invalid="ignore", over="ignore"):  # the bad elements may be INF/NaN
            _rebuild(one.xp, view[0], diagnosis, pred)
        if _rebuilt_as_recomputed(be, one, view[0], diagnosis, fresh) and \
                _reverify(be, one, view, pred).clean:
            report.events.append(diagnosis.event(site, b, "corrected"))
            return
    _recompute_vectors(be, one, view[0], diagnosis)
    if _reverify(be, one, view, pred).clean:
        report.events.append(diagnosis.event(site, b, "recomputed"))
        return
    be.gemm(one.a, one.b, view, one.bias)
    if _reverify(be, one, view, pred).clean:
        report.events.append(diagnosis.event(site, b, "recomputed", pattern="2D"))
        return
    report.events.append(diagnosis.event(site, b, "reported"))
    raise UncorrectableError(f"{site}[{b}]: the product does not verify even after recomputation",
                             report)


def _reverify(be: Backend, one: Operands, view: Any, pred: tuple[Any, Any]) -> Verdict:
    obs_col, obs_row = observe(be, view)
    return verify(be, one, pred[0], pred[1], obs_col, obs_row)


def _rebuild(xp: Any, c: Any, diagnosis: Diagnosis, pred: tuple[Any, Any]) -> None:
    """Rebuild each located element from the checksum of its (single-error) vector."""
    rows = xp.asarray(np.array([i for i, _ in diagnosis.cells]))
    cols = xp.asarray(np.array([j for _, j in diagnosis.cells]))
    picks = xp.arange(len(diagnosis.cells))
    if diagnosis.direction == "cols":
        vectors = c[:, cols].astype(np.float64)          # (m, cells): each cell's column
        vectors[rows, picks] = 0
        total = pred[0][0, cols, 0]
    else:
        vectors = c[rows, :].astype(np.float64).T        # (n, cells): each cell's row
        vectors[cols, picks] = 0
        total = pred[1][0, rows, 0]
    c[rows, cols] = (total - vectors.sum(0)).astype(c.dtype)


def _recompute_vectors(be: Backend, one: Operands, c: Any, diagnosis: Diagnosis) -> None:
    """Recompute the rows and columns the diagnosis names, from the inputs."""
    xp = one.xp
    if diagnosis.rows:
        rows = xp.asarray(np.array(diagnosis.rows))
        c[rows, :] = product_rows(be, one, rows)
    if diagnosis.cols:
        cols = xp.asarray(np.array(diagnosis.cols))
        c[:, cols] = product_cols(be, one, cols)


def _rebuilt_as_recomputed(be: Backend, one: Operands, c: Any, diagnosis: Diagnosis,
                           fresh: Verdict) -> bool:
    """Do the rebuilt elements equal the same elements recomputed from the inputs?

    Both sides carry rounding: the rebuilt value that of its vector's checksum (bounded by the
    vector's threshold), the recomputed one the GEMM's (bounded by :func:`element_tolerance` of
    the vector's ``sum |A||B|``, which is at least the element's).
    The cheaper of recomputing the cells' rows or their columns is used.
    """
    xp = one.xp
    rows = np.array([i for i, _ in diagnosis.cells])
    cols = np.array([j for _, j in diagnosis.cells])
    recomputed = product_cells(be, one, rows, cols)
    rebuilt = c[xp.asarray(rows), xp.asarray(cols)]
    side, vectors = (fresh.cols, cols) if diagnosis.direction == "cols" else (fresh.rows, rows)
    size = to_host(side.pred[0, :, 2])[vectors]  # predicted sum |A||B| of each cell's vector
    # The vector's threshold with its observed |C| sum (polluted by the fault, NaN for a NaN)
    # replaced by the predicted one, which bounds it.
    tolerance = threshold(size, size, one.k, side.length, one.dtype, one.bias is not None) \
        + element_tolerance(size, one.k, one.dtype)
    with np.errstate(invalid="ignore"):  # INF - INF: not confirmed
        gap = np.abs(to_host(rebuilt).astype(np.float64) - to_host(recomputed).astype(np.float64))
    return bool((gap <= tolerance).all())


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
