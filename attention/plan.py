"""The checking plan: how often each site is checked, and the table of what every step does.

Every step of a pass, with its site, what it computes and where its checksums come from, is the
data of :mod:`attention.passes`, which the functional core runs; :meth:`CheckingPlan.table`
prints it (resolved for one :class:`attention.passes.Variant`) with how often each site is
checked, and :func:`plan_markdown` is docs/checking_plan.md's table (``python
scripts/checking_plan_table.py`` writes it there). Sites are the GEMMs (planned products verified
by their column checksums, or by their row checksums observed by the softmax that reads them),
the two softmax steps and dropout (checked by invariants).

How often is a trade-off: :func:`adaptive_frequencies` picks, from a fault rate and per-site cost
and vulnerability, the cheapest per-site checking probabilities that keep the expected number of
unchecked faults per step under a target (the adaptive frequency ATTNChecker describes but did not
publish). See docs/checking_plan.md for a worked example.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np

from attention.passes import (BACKWARD, FORWARD, INVARIANT_SITES, Step, Variant, carried,
                              checksums, describe, layer, steps)


@dataclass(frozen=True)
class SitePlan:
    """How often one site is checked.

    Attributes
    ----------
    every : int
        Check every ``every``-th call (1 = always).
    probability : float
        Check a call with this probability (applied after ``every``; 1 = always).
    """

    every: int = 1
    probability: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, (int, np.integer)) \
                or self.every < 1:
            raise ValueError(f"SitePlan: every must be an integer of at least 1, got "
                             f"{self.every!r}")
        if not 0 <= self.probability <= 1:  # NaN fails too
            raise ValueError(f"SitePlan: probability must be in [0, 1], got {self.probability!r}")


def _gemm_sites(table: tuple[Step, ...], variant: Variant) -> tuple[str, ...]:
    return tuple(s.site for s in steps(table, variant) if s.op.startswith("gemm"))


FORWARD_SITES = _gemm_sites(FORWARD, Variant())
BACKWARD_SITES = _gemm_sites(BACKWARD, Variant())
SITES = FORWARD_SITES + BACKWARD_SITES
#: Sites only cross-attention runs (the gradients of the separate key and value inputs).
CROSS_SITES = tuple(s for s in _gemm_sites(BACKWARD, Variant(cross=True)) if s not in SITES)
ALL_SITES = SITES + CROSS_SITES
#: The variants docs/checking_plan.md shows beside the default (self-attention, NumPy, weight
#: gradients in the ``x @ w`` layout).
VARIANTS = {"cross-attention": Variant(cross=True), "causal": Variant(causal=True),
            "attention dropout": Variant(dropout=True),
            "PyTorch (weight gradients in the W layout)": Variant(w_layout=True),
            "CuPy": Variant(gpu=True), "fused core": Variant(fused=True)}


def table_rows(variant: Variant = Variant()) -> list[tuple[str, Step, str]]:
    """``(pass, step, checksums)`` for every step of a forward and a backward pass in
    ``variant``, as :mod:`attention.passes` says they run (every site checked, float32 or
    float64, no fault hook)."""
    forward, backward = layer(variant)
    fwd, bwd = steps(forward, variant), steps(backward, variant)
    given = carried(fwd, bwd, variant.gpu)[1]
    return [(name, s, describe(s, t)) for name, table, start in
            (("forward", fwd, frozenset()), ("backward", bwd, given))
            for s, t in zip(table, checksums(table, variant.gpu, start))]


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

    sites: dict[str, SitePlan] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.sites) - set(ALL_SITES)
        if unknown:
            raise ValueError(f"unknown sites in plan: {sorted(unknown)}; sites are {ALL_SITES}")
        self.sites = {**{s: SitePlan() for s in ALL_SITES}, **self.sites}
        self._calls = {s: 0 for s in ALL_SITES}
        self._rng = np.random.default_rng(self.seed)

    def with_frequencies(self, probabilities: Mapping[str, float]) -> "CheckingPlan":
        """A copy whose sites are checked with the given probabilities (``ValueError`` for a
        site that is not one, or a probability outside [0, 1])."""
        unknown = set(probabilities) - set(self.sites)
        if unknown:
            raise ValueError(f"unknown sites: {sorted(unknown)}; sites are {ALL_SITES}")
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

    def table(self, variant: Variant = Variant()) -> str:
        """Every step of a forward and a backward pass in ``variant`` as a markdown table, with
        how often this plan checks it."""
        lines = ["| pass | step | site | computes | checksums | checked |",
                 "|---|---|---|---|---|---|"]
        for name, s, sums in table_rows(variant):
            lines.append(f"| {name} | {s.op} | {s.site or ''} | `{s.computes()}` | {sums} | "
                         f"{self._checked(s)} |")
        return "\n".join(lines)

    def _checked(self, s: Step) -> str:
        if s.site in INVARIANT_SITES or s.op in ("dropout", "fused core", "fused core backward",
                                                 "fused check"):
            return "every call"
        if s.site is None:
            return "-"
        p = self.sites[s.site]
        return "every call" if p.every == 1 and p.probability >= 1 else \
            f"every {p.every}, p={p.probability:.3g}"


def plan_markdown() -> str:
    """docs/checking_plan.md's table: the default plan's, then per :data:`VARIANTS` the rows
    that differ from it."""
    plan = CheckingPlan()
    out = [plan.table()]
    default = plan.table().splitlines()
    for name, variant in VARIANTS.items():
        rows = [r for r in plan.table(variant).splitlines() if r not in default]
        flags = ", ".join(f"{k}=True" for k, v in vars(variant).items() if v)
        out.append(f"\n**{name}** (`Variant({flags})`), the rows that differ:\n\n" +
                   "\n".join(default[:2] + rows))
    return "\n".join(out)


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
