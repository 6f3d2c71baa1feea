"""The row verification of a planned product whose consumer observes its rows
(``directions="rows by consumer"``; docs/design.md, "The planned product")."""
from __future__ import annotations

from typing import Any

import numpy as np

from abftgemm.backend import Backend
from abftgemm.encode import predict_rows
from abftgemm.locate import verify
from abftgemm.operands import Operands
from abftgemm.rare_path import settle
from abftgemm.report import Report
from abftgemm.thresholds import safe_magnitude, threshold_coefficients
from abftgemm.verdicts import Slot


class ConsumerRows:
    """Workspaces and launches of the row verification of one planned product: its operands
    ``op`` (no bias) and ``out_triangle`` as :class:`~abftgemm.plan.ProtectedMatmul` takes them."""

    def __init__(self, be: Backend, op: Operands, out_triangle: str | None, counters: Any,
                 verdict: Slot):
        self._be, self._counters, self._slot = be, counters, verdict
        self.verdict_made = False
        self._coefficients = threshold_coefficients(op.k, op.n, op.dtype, False)
        self._safe = safe_magnitude(op.k, op.dtype)
        self.row_limits = None if out_triangle is None else be.row_limits(op.m, op.n, op.dtype)
        if self.row_limits is None:
            self._b_rows = self._zeros((op.b.shape[0], op.k, 5))
            # the row encoding of b out of those records, when none is handed on
            self._b_enc = self._zeros((3, op.b.shape[0], op.k))
        else:  # the encoding of b's leading columns, grown by the prediction
            self._enc = self._zeros((3, op.k))
        self._pred = self._zeros((op.batch, op.m, 5))
        self.observed = self._zeros((op.batch, op.m, 5))
        # the flagged and unverifiable rows, counted in the ledger slot (int64 on the CPU)
        self._verdict = verdict.device if be.xp is not np else verdict.device.view(np.int64)
        rows = (op.batch, op.m)  # the judge's per-row threshold, flag and verifiability
        self._judged = (self._zeros(rows), self._zeros(rows, bool), self._zeros(rows, bool))

    def _zeros(self, shape: tuple[int, ...], dtype: Any = np.float64) -> Any:
        self._counters.allocations += 1
        return self._be.xp.zeros(shape, dtype=dtype)

    def predict(self, op: Operands, b_rows: Any | None) -> None:
        """Predict the product's row checksums from ``b_rows`` ``(3, 1 or b's batch, k)`` when
        handed on, else from ``b``'s row encoding made first (counted copy); with
        :attr:`row_limits`, in one launch that encodes ``b``'s leading columns as it goes."""
        self.verdict_made = False  # judge() ran since this prediction
        self._counters.launches += 1
        if self.row_limits is not None:
            self._be.predict_lower_rows(op.a, op.b, self.row_limits, self._enc, self._pred)
            return
        if b_rows is None:
            self._counters.launches += 2
            self._be.row_reduce(op.b, None, self._b_rows)
            self._b_enc[...] = self._b_rows[..., :3].transpose(2, 0, 1)
            self._counters.copies += 1
            b_rows = self._b_enc
        self._be.row_reduce(op.a, b_rows, self._pred)

    def judge(self) -> None:
        """Count the flagged and unverifiable rows of :attr:`observed` (on the device)."""
        self.verdict_made = True
        self._counters.launches += 1
        self._slot.clear()
        self._be.flag(self._pred, self.observed, self._coefficients, self._safe, self._verdict,
                      out=self._judged)

    def flagged(self) -> bool:
        """Whether the judged rows flagged, as the ledger's last fetch copied them."""
        return bool(self._slot.host.any())

    def rare_path(self, op: Operands, c: Any, check: str, name: str, report: Report) -> None:
        """Verify whole rows from a fresh prediction and repair ``c`` in place (or raise, as
        :func:`abftgemm.matmul` does); with :attr:`row_limits`, complete the product first."""
        if self.row_limits is not None:
            self._be.complete_lower(op.a, op.b, c)
            self._be.row_reduce(c, None, self.observed)
        verdict = verify(self._be, op, None, predict_rows(self._be, op), None, self.observed)
        settle(self._be, op, c, verdict, check, name, report)
