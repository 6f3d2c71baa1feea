"""The checking plan: per site, what is checked, where its checksums come from, and how often.

Every GEMM site but one is verified in both directions (row and column checksums) when it is
checked: one direction locates 0D errors, both are needed to repair 1R (column checks) and 1C (row
checks) without recomputation. The scores are the exception: reading them only to verify them
costs over 30% of their GEMM on a GPU, so the softmax observes their row checksums on its own read
(0D and 1C are rebuilt from row checksums; a bad row is recomputed, from Q's row and K). Checksums "passed" cost no encoding pass: they are the verified checksums
of an earlier product (or of the layer input, encoded once for three products).

How often is a trade-off: :func:`adaptive_frequencies` picks, from a fault rate and per-site cost
and vulnerability, the cheapest per-site checking probabilities that keep the expected number of
unchecked faults per step under a target (the adaptive frequency ATTNChecker describes but did not
publish). See docs/checking_plan.md for a worked example.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np


@dataclass(frozen=True)
class SitePlan:
    """How one site is protected.

    Attributes
    ----------
    product : str
        The product, in the layer's notation.
    checksums : str
        Where the operands' encodings come from ("passed: ..." costs no encoding pass).
    every : int
        Check every ``every``-th call (1 = always).
    probability : float
        Check a call with this probability (applied after ``every``; 1 = always).
    """

    product: str
    checksums: str
    every: int = 1
    probability: float = 1.0


_SITES: dict[str, SitePlan] = {
    "q_proj": SitePlan("Q = X Wq + bq", "passed: column encoding of X (encoded once for Q, K, V)"),
    "k_proj": SitePlan("K = X Wk + bk", "passed: column encoding of X"),
    "v_proj": SitePlan("V = X Wv + bv", "passed: column encoding of X"),
    "scores": SitePlan("S_h = Q_h K_h^T", "passed: column encoding of K; row checksums only, "
                       "observed by the softmax on its one read of S (abftgemm.matmul_deferred)"),
    "context": SitePlan("CL_h = P_h V_h", "encoded: P (no linear checksum crosses the softmax)"),
    "out_proj": SitePlan("O = CL Wo + bo", "passed: column encoding of CL from the context site"),
    "d_wo": SitePlan("dWo = CL^T dO", "encoded"),
    "d_context": SitePlan("dCL = dO Wo^T", "encoded"),
    "d_probs": SitePlan("dP_h = dCL_h V_h^T", "passed: column encodings of dCL and V"),
    "d_v": SitePlan("dV_h = P_h^T dCL_h", "encoded"),
    "d_q": SitePlan("dQ_h = dS_h K_h", "encoded"),
    "d_k": SitePlan("dK_h = dS_h^T Q_h", "encoded"),
    "d_wq": SitePlan("dWq = X^T dQ", "encoded"),
    "d_wk": SitePlan("dWk = X^T dK", "encoded"),
    "d_wv": SitePlan("dWv = X^T dV", "encoded"),
    "d_x": SitePlan("dX = [dQ dK dV] [Wq Wk Wv]^T", "encoded"),
}

#: Non-GEMM steps checked by invariants (they receive ``fault_hook`` calls too).
INVARIANT_SITES = {
    "softmax": "rows of P sum to 1; log P_ij - log P_i,max = z_ij - z_i,max",
    "softmax_backward": "rows of dS sum to 0; their dP-weighted sums equal sum P dP^2 - r^2",
}

FORWARD_SITES = ("q_proj", "k_proj", "v_proj", "scores", "context", "out_proj")
BACKWARD_SITES = ("d_wo", "d_context", "d_probs", "d_v", "d_q", "d_k", "d_wq", "d_wk", "d_wv",
                  "d_x")
SITES = FORWARD_SITES + BACKWARD_SITES


@dataclass
class CheckingPlan:
    """Per-site plan plus the call counters and random stream that apply it.

    Parameters
    ----------
    sites : mapping of site name to SitePlan, optional
        Defaults to checking every site on every call.
    seed : int
        Seed of the stream that draws probabilistic checks.
    """

    sites: dict[str, SitePlan] = field(default_factory=lambda: dict(_SITES))
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.sites) - set(SITES)
        if unknown:
            raise ValueError(f"unknown sites in plan: {sorted(unknown)}; sites are {SITES}")
        self.sites = {**_SITES, **self.sites}
        self._calls = {s: 0 for s in SITES}
        self._rng = np.random.default_rng(self.seed)

    def with_frequencies(self, probabilities: Mapping[str, float]) -> "CheckingPlan":
        """A copy whose sites are checked with the given probabilities."""
        sites = {s: replace(p, probability=float(probabilities.get(s, p.probability)))
                 for s, p in self.sites.items()}
        return CheckingPlan(sites, self.seed)

    def should_check(self, site: str) -> bool:
        """Advance ``site``'s counter and say whether this call is checked."""
        plan = self.sites[site]
        self._calls[site] += 1
        if (self._calls[site] - 1) % plan.every:
            return False
        return plan.probability >= 1 or bool(self._rng.random() < plan.probability)

    def table(self) -> str:
        """The plan as a markdown table."""
        lines = ["| site | product | checksums | checked |", "|---|---|---|---|"]
        for s in SITES:
            p = self.sites[s]
            how = "every call" if p.every == 1 and p.probability >= 1 else \
                f"every {p.every}, p={p.probability:.3g}"
            lines.append(f"| {s} | {p.product} | {p.checksums} | {how} |")
        for s, inv in INVARIANT_SITES.items():
            lines.append(f"| {s} | softmax | invariant: {inv} | every call |")
        return "\n".join(lines)


def adaptive_frequencies(fault_rate: float, vulnerability: Mapping[str, float],
                         cost: Mapping[str, float], target: float) -> dict[str, float]:
    """Cheapest per-site checking probabilities meeting a reliability target.

    A fault strikes site ``s`` in one step with probability ``fault_rate * vulnerability[s]``
    (vulnerability: e.g. the site's share of GEMM time or FLOPs, or its exposure measured by a
    campaign). Checking it with probability ``f_s`` costs ``f_s * cost[s]`` per step and leaves
    ``fault_rate * vulnerability[s] * (1 - f_s)`` expected unchecked faults. Minimizing total cost
    subject to ``sum of unchecked <= target`` is a fractional knapsack: check sites in decreasing
    order of vulnerability per unit cost, fully, until the remaining risk fits the target; the
    last site gets the fractional probability that meets it exactly.

    Returns
    -------
    dict site -> probability in [0, 1].
    """
    if fault_rate < 0 or target < 0:
        raise ValueError("fault_rate and target must be non-negative")
    risk = {s: fault_rate * v for s, v in vulnerability.items()}
    excess = sum(risk.values()) - target
    freq = {s: 0.0 for s in risk}
    for s in sorted(risk, key=lambda s: risk[s] / max(cost[s], 1e-300), reverse=True):
        if excess <= 0:
            break
        if risk[s] <= 0:
            continue
        freq[s] = min(1.0, excess / risk[s])
        excess -= freq[s] * risk[s]
    return freq
