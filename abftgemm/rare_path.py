"""The rare path of every protected product: verify both directions, then repair, report or
raise (docs/design.md, "Classify, repair, recompute, or raise")."""
from __future__ import annotations

from typing import Any

import numpy as np

from abftgemm.backend import Backend
from abftgemm.checksums import Checksums, encoding_of
from abftgemm.encode import observe, predict
from abftgemm.locate import Verdict, diagnose, verify
from abftgemm.nonfinite import settle_unverifiable
from abftgemm.operands import Operands
from abftgemm.repair import finding_in_place, repair_batch
from abftgemm.report import Report, announce

_LEFT = "nothing: left in place (check='detect')"
_ROUNDING = ("nothing: the product computed again is the same, and every element of its flagged "
             "vectors within its rigorous rounding bound of the exact product (float64): its "
             "rounding, one-sided beyond the threshold's statistical accumulation term, not a "
             "fault")
_VERIFIED = {"data": _LEFT, "rounding": _ROUNDING, "checksum": (
    "nothing: the data verifies against checksums derived afresh from the inputs; the "
    "predicted checksum was wrong, the data left as computed")}


def protect(be: Backend, op: Operands, out: Any, check: str, name: str, report: Report,
            a_checksums: Checksums | None) -> Checksums:
    """Verify ``out`` (and repair it when ``check == "correct"``); return its encodings (new
    arrays, two copies out of the observed records: see :func:`abftgemm.checksums.encoding_of`)."""
    with np.errstate(all="ignore"):  # non-finite data is judged and reported, not warned about
        obs_col, obs_row = observe(be, out)  # first: the product is freshest in cache
        pred_col, pred_row = predict(be, op, a_checksums)
        verdict = verify(be, op, pred_col, pred_row, obs_col, obs_row)
        for b in settle(be, op, out, verdict, check, name, report):
            obs_col[b], obs_row[b] = (o[0] for o in observe(be, out[b:b + 1]))
    return Checksums(cols=encoding_of(obs_col), rows=encoding_of(obs_row))


def settle(be: Backend, op: Operands, out: Any, verdict: Verdict, check: str, name: str,
           report: Report, announce_findings: bool = True, computed_here: bool = True) -> list[int]:
    """Report what ``verdict`` found; with ``check == "correct"`` repair every flagged batch item
    in place (or raise); with ``check == "detect"`` announce every finding as a
    :class:`~abftgemm.report.FaultDetectedWarning`. ``computed_here``: ``out`` came from the
    backend's GEMM (False: from elsewhere, :func:`abftgemm.verify`; see
    :func:`abftgemm.repair.finding_in_place`). Returns the batch indices that were repaired."""
    first_new = len(report.events)
    repaired = []
    with np.errstate(all="ignore"):  # non-finite data is judged and reported, not warned about
        for b in ([] if verdict.clean else verdict.flagged_batches()):
            if check == "detect":
                finding = finding_in_place(be, op, out, b, verdict, computed_here)
                report.events.append(diagnose(verdict, b).event(
                    name, b, "passed-through" if finding == "rounding" else "reported",
                    _VERIFIED[finding], pattern=None if finding == "data" else finding))
                continue
            repair_batch(be, op, out, b, verdict, name, report)
            repaired.append(b)
        # Elements no checksum could judge (non-finite inputs, overflow): settled one by one.
        repaired += settle_unverifiable(be, op, out, verdict, check, name, report)
    for event in report.events[first_new:] if announce_findings else ():
        if event.action == "reported":  # detect mode: found and left in place
            announce(event)
    return sorted(set(repaired))
