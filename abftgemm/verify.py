"""``verify(c, a, b)``: the two-direction check of :func:`abftgemm.matmul` on a product computed
elsewhere, or to see how close clean data comes to the thresholds; ``c`` is never modified."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from abftgemm.backend import get_backend, to_host
from abftgemm.encode import observe, predict
from abftgemm.locate import Side, verify as verify_sides
from abftgemm.operands import Operands
from abftgemm.rare_path import settle
from abftgemm.report import Report
from abftgemm.tensors import is_tensor, to_array


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` found.

    Attributes
    ----------
    report : Report
        The findings (action ``"reported"`` for faults; ``input-nonfinite`` / ``overflow``
        events for what was passed through).
    col_diff, col_threshold : numpy.ndarray (batch, n)
        Per column: ``|predicted - observed|`` of the plain checksum and its threshold
        (NaN/INF where the column is not verifiable or holds non-finite values).
    row_diff, row_threshold : numpy.ndarray (batch, m)
        The same per row.
    """

    report: Report
    col_diff: np.ndarray
    col_threshold: np.ndarray
    row_diff: np.ndarray
    row_threshold: np.ndarray

    @property
    def clean(self) -> bool:
        """True when no fault was found."""
        return not self.report.detected

    @property
    def worst_ratio(self) -> float:
        """Largest finite ``diff / threshold`` of both directions: below 1 on clean data unless
        its rounding is one-sided (the report then says ``"rounding"``)."""
        with np.errstate(invalid="ignore", divide="ignore"):  # INF / INF: not finite, left out
            ratios = np.concatenate([(self.col_diff / self.col_threshold).ravel(),
                                     (self.row_diff / self.row_threshold).ravel()])
        return float(ratios.max(initial=0.0, where=np.isfinite(ratios)))


def verify(c: Any, a: Any, b: Any, *, bias: Any | None = None,
           name: str = "verify") -> Verification:
    """Check that ``c`` is ``a @ b (+ bias)`` up to rounding; never modify ``c``.

    Parameters
    ----------
    c : array or tensor
        The product to check, of the shape and dtype ``matmul(a, b)`` has (NumPy or CuPy like
        ``a``, or a PyTorch tensor). NumPy's own ``a @ b`` of bfloat16 arrays is float32: cast
        it (``.astype(a.dtype)``) before checking it.
    a, b, bias : array
        Its operands, as :func:`abftgemm.matmul` takes them.
    name : str
        Site name in the report.

    Returns
    -------
    Verification
        The report and the per-vector differences and thresholds. Findings are not announced
        as warnings: the caller asked for them.

    Raises
    ------
    TypeError, ValueError
        For operands :func:`abftgemm.matmul` would refuse, or a ``c`` of another shape or dtype.
    """
    op = Operands.prepare(a, b, bias)
    if is_tensor(c):
        c = to_array(c, "c")
    if isinstance(c, np.generic) and op.xp is np:  # what matmul returns for vector @ vector
        c = np.asarray(c)
    if not isinstance(c, op.xp.ndarray):
        raise TypeError(f"verify: c must be a {op.xp.__name__} array as a and b are, got "
                        f"{type(c).__name__}")
    if tuple(c.shape) != op.shape or c.dtype != op.dtype:
        raise ValueError(f"verify: c is {c.dtype} {tuple(c.shape)}; a @ b is {op.dtype} {op.shape}")
    be = get_backend(op.xp)
    # a C-contiguous copy: the checks below must never reach the caller's memory through a view
    view = c.copy(order="C").reshape(op.batch, op.m, op.n)
    report = Report()
    verdict = verify_sides(be, op, *predict(be, op, None), *observe(be, view))
    settle(be, op, view, verdict, "detect", name, report, announce_findings=False,
           computed_here=False)
    report.checked[name] = op.batch
    return Verification(report, *_margins(verdict.cols), *_margins(verdict.rows))


def _margins(side: Side) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore"):
        return np.abs(to_host(side.diff[..., 0])), to_host(side.tau)
