"""One campaign trial's outcome and the "differs" test of :mod:`attention.experiments.campaign`
(its module docstring defines the tolerance), shared by the layer's testbed and the fused core's
(:mod:`attention.experiments.fused_campaign`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from abftgemm import Report
from abftgemm.backend import to_host
from abftgemm.checksums import smallest_normal, unit_roundoff

#: ``dtype name -> (rtol, atol_scale)`` of the "differs" test (see the campaign's docstring).
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-9), "float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2),
    "bfloat16": (5e-2, 5e-2),
}
#: Multiple of the fault-free run's own rounding error that still counts as equal.
NOISE_FACTOR = 10.0


@dataclass
class Trial:
    """The outcome of one run: its report, whether it raised UncorrectableError, its results
    (None when it raised) and whether the fault was injected."""

    report: Report
    uncorrectable: bool
    results: dict[str, Any] | None
    injected: bool


def absolute_floor(dtype: str) -> float:
    """The absolute floor ``tiny / u`` of :func:`absolute_tolerances` for ``dtype`` data (the
    arithmetic's: float64 for float64 data, else float32)."""
    arith = np.float64 if dtype == "float64" else np.float32
    return smallest_normal(arith) / unit_roundoff(arith)


def absolute_tolerances(reference: dict[str, Any], exact: dict[str, np.ndarray],
                        dtype: str) -> dict[str, float]:
    """Per result of the fault-free run ``reference``: ``atol = max(atol_scale max|r_ref|,
    NOISE_FACTOR max|r_ref - r_exact|, tiny / u)`` (``exact``: the float64 results, host arrays;
    ``tiny`` and ``u`` the smallest normal number and the unit roundoff of the arithmetic,
    float64 for float64 data, else float32: the checks' thresholds have absolute floors of the
    lengths summed times ``tiny``, so a change that small passes them by design; a result that is
    exactly 0 everywhere has no other term)."""
    _, scale = TOLERANCES[dtype]
    tiny = absolute_floor(dtype)
    atol = {}
    for key, r in reference.items():
        r = to_host(r).astype(np.float64)
        noise = float(np.abs(r - exact[key]).max())
        atol[key] = max(scale * float(np.abs(r).max()), NOISE_FACTOR * noise, tiny)
    return atol


def compare(xp: Any, results: dict[str, Any], reference: dict[str, Any], atol: dict[str, float],
            dtype: str) -> str:
    """``"equal"`` (every result bit-identical to ``reference``), ``"within"`` (some differ, all
    within ``|r - r_ref| <= rtol |r_ref| + atol``) or ``"beyond"``."""
    rtol, _ = TOLERANCES[dtype]
    verdict = "equal"
    for key, r in results.items():
        expected = reference[key]
        if bool(xp.array_equal(r, expected)):
            continue
        expected = expected.astype(np.float64)
        ok = xp.abs(r.astype(np.float64) - expected) <= rtol * xp.abs(expected) + atol[key]
        if not bool(ok.all()):
            return "beyond"
        verdict = "within"
    return verdict
