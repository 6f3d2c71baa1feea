"""Verify checksums, locate faulty elements and classify them (0D / 1R / 1C / 2D).

:func:`verify` runs on the device for the whole batch and leaves a :class:`Verdict`; only when it
flags something does :func:`diagnose` pull the flagged vectors of one batch item to the host and
decide which elements the checksums can locate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from abftgemm.backend import Backend, to_host
from abftgemm.operands import Operands
from abftgemm.report import Event
from abftgemm.thresholds import safe_magnitude, threshold_coefficients

#: A weighted-checksum ratio must land this close to an integer to count as a location.
LOCATION_SLACK = 0.25


@dataclass
class Side:
    """Verification of one direction (columns or rows), ``(batch, vectors)``, on the device."""

    pred: Any        # (batch, vectors, 5) predicted checksums (None: direction not checked)
    obs: Any         # (batch, vectors, 5) observed checksums (None: direction not checked)
    tau: Any         # (batch, vectors) threshold for the plain difference
    bad: Any         # (batch, vectors) bool: flagged
    verifiable: Any  # (batch, vectors) bool: checksums can judge it (backend.py ``flag``)
    length: int      # elements per vector

    @property
    def diff(self) -> Any:
        """(batch, vectors, 2) predicted - observed [plain, weighted]."""
        return self.pred[..., :2] - self.obs[..., :2]


def _side(be: Backend, op: Operands, pred: Any, obs: Any, length: int, counts: Any) -> Side:
    coefficients = threshold_coefficients(op.k, length, op.dtype, op.bias is not None)
    tau, bad, verifiable = be.flag(pred, obs, coefficients, safe_magnitude(op.k, op.dtype), counts)
    return Side(pred, obs, tau, bad, verifiable, length)


@dataclass
class Verdict:
    """Result of verifying a batched product in both directions."""

    cols: Side
    rows: Side
    n_bad: int
    n_unverifiable: int

    @property
    def clean(self) -> bool:
        return self.n_bad == 0

    def worst_ratio(self) -> float:
        """Largest finite ``|d| / threshold`` (plain or weighted) of both directions' vectors."""
        ratios = [to_host(abs(side.diff).max(-1) / side.tau).ravel()
                  for side in (self.cols, self.rows) if side.pred is not None]
        finite = np.concatenate([r[np.isfinite(r)] for r in ratios])
        return float(finite.max()) if finite.size else 0.0

    def flagged_batches(self) -> list[int]:
        """Batch indices with at least one flagged vector (host list)."""
        any_bad = self.cols.bad.any(-1) | self.rows.bad.any(-1)
        return [int(b) for b in to_host(any_bad).nonzero()[0]]

    def unverifiable(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(b, rows, cols)`` per batch item with an element that no judged vector covers (a
        judged row or column verified or flagged its elements): the host indices of the rows and
        columns checksums could not judge (every column when that side is absent)."""
        if self.n_unverifiable == 0:
            return []
        rows, cols = (to_host(~side.verifiable) for side in (self.rows, self.cols))
        return [(b, rows[b].nonzero()[0], cols[b].nonzero()[0])
                for b in map(int, (rows.any(-1) & cols.any(-1)).nonzero()[0])]


def verify(be: Backend, op: Operands, pred_col: Any, pred_row: Any, obs_col: Any,
           obs_row: Any) -> Verdict:
    """Compare predicted and observed checksums of every vector; one host transfer of counts.
    With ``pred_col`` None the rows only (the column side absent: never flagged, never
    confirming), for products whose consumer observed their rows on the way through."""
    counts = op.xp.zeros(2, dtype=np.int64)
    rows = _side(be, op, pred_row, obs_row, op.n, counts)
    if pred_col is None:
        absent = op.xp.zeros((rows.bad.shape[0], op.n), dtype=bool)
        cols = Side(None, None, None, absent, absent, op.m)
    else:
        cols = _side(be, op, pred_col, obs_col, op.m, counts)
    n_bad, n_unverifiable = (int(c) for c in to_host(counts))
    return Verdict(cols, rows, n_bad, n_unverifiable)


@dataclass
class Diagnosis:
    """What one batch item's flags mean, on the host."""

    pattern: str                 # 0D, 1R, 1C or 2D (nothing located)
    cells: list[tuple[int, int]]  # elements the checksums locate (empty: none located)
    direction: str               # "cols" or "rows": which checksums located the cells
    rows: tuple[int, ...]        # flagged or located rows
    cols: tuple[int, ...]        # flagged or located columns
    magnitude: float
    threshold: float

    def event(self, site: str, batch: int, action: str, verified: str,
              pattern: str | None = None) -> Event:
        """The :class:`~abftgemm.report.Event` of this diagnosis (``verified``: see there)."""
        return Event(site, batch, pattern or self.pattern, self.rows, self.cols, self.magnitude,
                     self.threshold, action, verified)


def diagnose(verdict: Verdict, b: int) -> Diagnosis:
    """Classify the flags of batch item ``b`` and pick the elements the checksums locate."""
    by_cols, by_rows = _flagged(verdict.cols, b), _flagged(verdict.rows, b)
    magnitude, tau = _worst(by_cols, by_rows)
    if _consistent(by_cols, by_rows):
        cells, direction = [(int(r), int(j)) for j, r in zip(by_cols.idx, by_cols.loc)], "cols"
    elif _consistent(by_rows, by_cols):
        cells, direction = [(int(i), int(c)) for i, c in zip(by_rows.idx, by_rows.loc)], "rows"
    else:
        cells, direction = [], ""
    rows = tuple(sorted(set(map(int, by_rows.idx)) | {i for i, _ in cells}))
    cols = tuple(sorted(set(map(int, by_cols.idx)) | {j for _, j in cells}))
    # 2D when nothing is located: several errors in a vector, errors cancelling in a direction
    # that could see them, or a wrong predicted checksum (only fresh checksums tell: repair.py).
    return Diagnosis(cell_pattern(cells), cells, direction, rows, cols, magnitude, tau)


class _Flags(NamedTuple):
    """The flags of one direction of one batch item, on the host."""

    idx: np.ndarray   # flagged vector indices
    loc: np.ndarray   # their located positions (-1: none)
    size: np.ndarray  # their |plain difference| (NaN/INF: non-finite)
    tau: np.ndarray   # every vector's threshold (INF where the direction is absent)
    ok: np.ndarray    # every vector's verifiability


def _flagged(side: Side, b: int) -> _Flags:
    idx = to_host(side.bad[b]).nonzero()[0]
    diff = to_host(side.diff[b][idx]) if len(idx) else np.zeros((0, 2))
    nonfinite = to_host(side.obs[b][idx, 3:5]) if len(idx) else np.zeros((0, 2))
    loc = np.array([_locate(d, nf, side.length) for d, nf in zip(diff, nonfinite)], dtype=np.int64)
    ok = to_host(side.verifiable[b])
    tau = np.full(ok.shape, np.inf) if side.tau is None else to_host(side.tau[b])
    return _Flags(idx, loc, np.abs(diff[:, 0]), tau, ok)


def _locate(diff: np.ndarray, nonfinite: np.ndarray, length: int) -> int:
    """The position one flagged vector's differences ``[plain, weighted]`` and observed
    non-finite ``[count, last index]`` locate: the one non-finite element, or the weighted-to-plain
    ratio's integer; -1 when they locate none."""
    count, last = nonfinite
    if count == 1:
        return int(last)
    if count == 0 and diff[0] != 0 and np.isfinite(diff).all():
        pos = diff[1] / diff[0] * length - 1
        r = round(pos) if np.isfinite(pos) else -1
        if 0 <= r < length and abs(pos - r) <= LOCATION_SLACK:
            return r
    return -1


def _consistent(mine: _Flags, other: _Flags) -> bool:
    """Do the flagged vectors of one direction (``mine``) locate every faulty element? Each must
    locate one element, whose vector in the other direction is flagged too or blind to it
    (:func:`_blind`), and each vector flagged in the other direction must hold one of them."""
    if len(mine.idx) == 0 or (mine.loc < 0).any():
        return False
    confirmed = np.isin(mine.loc, other.idx) | _blind(mine, other)
    return bool(confirmed.all() and np.isin(other.idx, mine.loc).all())


def _blind(mine: _Flags, other: _Flags) -> np.ndarray:
    """Per flagged vector of ``mine``: is the other direction's vector through its located element
    blind to an error there (unverifiable, or ``|d| - tau <= 2 tau_o``: docs/design.md)? A
    non-finite difference is seen by every verifiable vector."""
    with np.errstate(invalid="ignore"):  # INF - INF: seen
        hidden = mine.size - mine.tau[mine.idx] <= 2 * other.tau[mine.loc]
    return ~other.ok[mine.loc] | hidden


def cell_pattern(cells: list[tuple[int, int]]) -> str:
    """``0D``, ``1R``, ``1C`` or ``2D`` (also for none): the shape of a list of ``(row, col)``."""
    if len(cells) == 1:
        return "0D"
    rows, cols = {i for i, _ in cells}, {j for _, j in cells}
    return "1R" if len(rows) == 1 else "1C" if len(cols) == 1 else "2D"


def _worst(*directions: _Flags) -> tuple[float, float]:
    """Largest flagged ``|d|`` (non-finite first) and the threshold of that vector."""
    best = (0.0, 0.0)
    for flags in directions:
        if len(flags.idx):
            key = np.where(np.isfinite(flags.size), flags.size, np.inf)
            t = int(np.argmax(key))
            if not best[0] >= key[t]:
                best = (float(flags.size[t]), float(flags.tau[flags.idx[t]]))
    return best
