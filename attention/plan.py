"""The checking plan: per site, what is checked, where its checksums come from, and how often.

:data:`ROUTES` is the table the functional core (:mod:`attention.functional`) executes: per GEMM
site, its operands, its bias, where the checksums come from and how it is verified. Sites are
planned products (:class:`abftgemm.ProtectedMatmul`) verified by their column checksums; the row
direction is computed on the rare path, when a column flags. The scores and ``dP`` are the
exception: reading them only to verify them costs a large part of their GEMM on a GPU (their
inner dimension, the head dimension, is short, so the GEMM is bound by writing them), so the softmax
kernels (forward and backward) observe their row checksums on the read they make anyway
(:class:`abftgemm.ProtectedMatmul`'s ``directions="rows by consumer"``). Checksums "passed" cost
no encoding pass: they are the column encodings an earlier product's verification observed (or
composed from such encodings of its parts), the encoding an earlier site made of the same operand (``X`` is encoded once per pass
for ``Q``, ``K`` and ``V``, and ``X^T`` once for their weight gradients), or, for ``P``, ``dS``
and their transposes, the encodings the CPU softmax kernels make as they write them (the GPU
kernels do not yet: there those products read their operand; nor does a GPU plan keep a whole
encoding it made itself, so there ``K`` and ``V`` read ``X`` again).

How often is a trade-off: :func:`adaptive_frequencies` picks, from a fault rate and per-site cost
and vulnerability, the cheapest per-site checking probabilities that keep the expected number of
unchecked faults per step under a target (the adaptive frequency ATTNChecker describes but did not
publish). See docs/checking_plan.md for a worked example.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np

from attention.dropout import DROPOUT_CHECK, DROPOUT_SITE


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


@dataclass(frozen=True)
class Route:
    """Where a site's operands and checksums come from: the table the functional core executes.

    Tensor names are those of :mod:`attention.functional` (``"x"``: the query input; ``"key"``,
    ``"value"``: the key and value inputs, ``"x"`` again in self-attention; ``"qh"``: Q split
    into heads, ...); a trailing ``"^T"`` transposes the last two axes.

    Attributes
    ----------
    out : str
        Name of the product.
    a, b : str
        Names of the operands.
    bias : str or None
        Name of the bias added inside the protection.
    a_sums : str or None
        "Passed": the tensor whose column encoding is the column encoding of ``a``, known
        without reading ``a``: observed by the product that made it, made by the softmax kernel
        that wrote it (``probs``, ``d_scores`` and their transposes, on the CPU), made by an
        earlier site of the pass that encoded the same tensor (every site that encodes its
        ``a`` hands the encoding on under ``a``'s name; in self-attention ``key`` and ``value``
        are ``x``), or composed from the observed encodings of its parts (``d_qkv`` from the
        head products ``d_qh``, ``d_kh``, ``d_vh``). None, or when the pass has no such
        encoding: encoded from ``a``.
    verify : {"columns", "rows by consumer"}
        ``"columns"``: a planned product verified by its own two launches. ``"rows by consumer"``:
        the next kernel that reads the product observes its row checksums on that read.
    b_rows : str or None
        For ``"rows by consumer"``: the tensor whose column encoding is the row encoding of ``b``
        (``b`` is that tensor transposed).
    a_triangle : {None, "lower", "upper"}
        In a causal layer, ``a`` is zero outside this triangle (``P`` and ``dS`` are lower
        triangular, their transposes upper): the product multiplies only the blocks it can
        hold (:class:`abftgemm.ProtectedMatmul`'s ``a_triangle``).
    out_triangle : {None, "lower"}
        In a causal layer, only this triangle of the product is read (the scores and ``dP``:
        the softmax sees keys ``j <= i``): row blocks are computed and verified up to their
        last column (:class:`abftgemm.ProtectedMatmul`'s ``out_triangle``).
    """

    out: str
    a: str
    b: str
    bias: str | None = None
    a_sums: str | None = None
    verify: str = "columns"
    b_rows: str | None = None
    a_triangle: str | None = None
    out_triangle: str | None = None

    def describe(self) -> str:
        """The checksum route in words (the ``checksums`` column of the plan's table)."""
        if self.verify == "rows by consumer":
            return (f"passed: column encoding of {self.b_rows} as the row encoding of {self.b}; "
                    "row checksums only, observed by the softmax kernel on its one read")
        return f"passed: column encoding of {self.a_sums}" if self.a_sums else "encoded"


#: Every GEMM site's route (self-attention; cross-attention reads ``key``/``value`` where the
#: table says so and adds the sites of :data:`CROSS_SITES`).
ROUTES: dict[str, Route] = {
    "q_proj": Route("q", "x", "wq", "bq"),
    "k_proj": Route("k", "key", "wk", "bk", a_sums="key"),
    "v_proj": Route("v", "value", "wv", "bv", a_sums="value"),
    "scores": Route("scores", "qh", "kh^T", verify="rows by consumer", b_rows="kh",
                    out_triangle="lower"),
    "context": Route("context_h", "probs", "vh", a_sums="probs", a_triangle="lower"),
    "out_proj": Route("y", "context", "wo", "bo", a_sums="context_h"),
    "d_wo": Route("d_wo", "context^T", "dy"),
    "d_context": Route("d_context", "dy", "wo^T"),
    "d_probs": Route("d_probs", "d_context_h", "vh^T", verify="rows by consumer", b_rows="vh",
                     out_triangle="lower"),
    "d_v": Route("d_vh", "probs^T", "d_context_h", a_sums="probs^T", a_triangle="upper"),
    "d_q": Route("d_qh", "d_scores", "kh", a_sums="d_scores", a_triangle="lower"),
    "d_k": Route("d_kh", "d_scores^T", "qh", a_sums="d_scores^T", a_triangle="upper"),
    "d_wq": Route("d_wq", "x^T", "dq"),
    "d_wk": Route("d_wk", "key^T", "dk", a_sums="key^T"),
    "d_wv": Route("d_wv", "value^T", "dv", a_sums="value^T"),
    "d_x": Route("dx", "d_qkv", "w_qkv^T", a_sums="d_qkv"),
    "d_key": Route("d_key", "dk", "wk^T"),
    "d_value": Route("d_value", "dv", "wv^T"),
}

_PRODUCTS = {
    "q_proj": "Q = X Wq + bq", "k_proj": "K = X_k Wk + bk", "v_proj": "V = X_v Wv + bv",
    "scores": "S_h = Q_h K_h^T", "context": "CL_h = P_h V_h", "out_proj": "O = CL Wo + bo",
    "d_wo": "dWo = CL^T dO", "d_context": "dCL = dO Wo^T", "d_probs": "dP_h = dCL_h V_h^T",
    "d_v": "dV_h = P_h^T dCL_h", "d_q": "dQ_h = dS_h K_h", "d_k": "dK_h = dS_h^T Q_h",
    "d_wq": "dWq = X^T dQ", "d_wk": "dWk = X_k^T dK", "d_wv": "dWv = X_v^T dV",
    "d_x": "dX = [dQ dK dV] [Wq Wk Wv]^T (self-attention; cross-attention: dQ Wq^T)",
    "d_key": "dX_k = dK Wk^T (cross-attention only)",
    "d_value": "dX_v = dV Wv^T (cross-attention only)",
}

_SITES: dict[str, SitePlan] = {s: SitePlan(_PRODUCTS[s], r.describe()) for s, r in ROUTES.items()}

#: Non-GEMM steps checked by invariants (they receive ``fault_hook`` calls too).
INVARIANT_SITES = {
    "softmax": "rows of P sum to 1; log P_ij - z_ij is the same for every visible j",
    "softmax_backward": "rows of dS sum to 0; their dP-weighted sums equal sum P dP^2 - r^2",
}

FORWARD_SITES = ("q_proj", "k_proj", "v_proj", "scores", "context", "out_proj")
BACKWARD_SITES = ("d_wo", "d_context", "d_probs", "d_v", "d_q", "d_k", "d_wq", "d_wk", "d_wv",
                  "d_x")
SITES = FORWARD_SITES + BACKWARD_SITES
#: Sites only cross-attention runs (the gradients of the separate key and value inputs).
CROSS_SITES = ("d_key", "d_value")
ALL_SITES = SITES + CROSS_SITES


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
        unknown = set(self.sites) - set(ALL_SITES)
        if unknown:
            raise ValueError(f"unknown sites in plan: {sorted(unknown)}; sites are {ALL_SITES}")
        self.sites = {**_SITES, **self.sites}
        self._calls = {s: 0 for s in ALL_SITES}
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
        for s in ALL_SITES:
            p = self.sites[s]
            how = "every call" if p.every == 1 and p.probability >= 1 else \
                f"every {p.every}, p={p.probability:.3g}"
            lines.append(f"| {s} | {p.product} | {p.checksums} | {how} |")
        for s, inv in INVARIANT_SITES.items():
            lines.append(f"| {s} | softmax | invariant: {inv} | every call |")
        lines.append(f"| {DROPOUT_SITE} | {DROPOUT_CHECK} | every call with dropout |")
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
