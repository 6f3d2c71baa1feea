"""Fault-injection campaign: every fault kind and pattern at every site, protected and unprotected.

For each site (the 16 GEMM sites of :data:`attention.SITES`, the two softmax invariant sites, and
a standalone GEMM ``"gemm"`` through :func:`abftgemm.matmul`), each fault kind of
:func:`fault_kinds`, each pattern of :data:`abftgemm.faults.PATTERNS`, and each protection mode
(``check="correct"``: protected, ``check="off"``: unprotected), ``trials`` seeded trials run one
forward and one backward pass of a :class:`attention.MultiHeadAttention` (or one product) with a
single :class:`abftgemm.faults.Fault` at that site.  Every trial is compared with the fault-free,
unprotected run of the same layer on the same inputs: output ``y``, ``dx`` and every gradient
(for ``"gemm"``: the product).  ``clean_trials`` runs without a fault measure false positives.

Outcome of a trial (each trial counts in exactly one of ``detected``, ``silent``, ``masked``)::

    detected       protection flagged something (an event, or UncorrectableError)
    silent         nothing flagged, yet some result differs from the fault-free run
    masked         nothing flagged and every result matches the fault-free run

and, overlapping those: ``corrected`` (trials with elements rebuilt from checksums),
``recomputed`` (trials with a recomputation), ``uncorrectable`` (UncorrectableError raised),
``miscorrected`` (flagged and delivered, but a result still differs), ``nonfinite_output`` (``y``,
``dx`` or a gradient holds INF/NaN), ``detected_at_site`` (flagged at the faulted site itself).
With ``check="off"`` detection is 0 by definition; ``silent`` counts the damage.

"Differs": ``|r - r_ref| > rtol * |r_ref| + atol`` for any element of any result ``r`` (NaN
differs from everything), where ``atol = max(atol_scale * max|r_ref|, NOISE_FACTOR * noise)`` and
``noise = max|r_ref - r_exact|`` is the rounding error of the fault-free run itself against the
float64 reference (:mod:`attention.reference`; ``a @ b`` in float64 for ``"gemm"``).
``(rtol, atol_scale)`` come from :data:`TOLERANCES` by dtype -- for float32 ``(1e-4, 1e-4)``: a
corrected element is rebuilt as checksum minus the sum of the others, which carries a rounding
error of a few ``eps * sum|row|``; a thousand times the float32 rounding unit relative to the
largest value is damage, not rounding.  The noise term matters for results that are exactly 0 in
exact arithmetic and pure rounding in floating point, such as the gradient of the key bias ``bk``
(softmax is invariant to it): any re-association, a correction included, changes them completely.
"""
from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
from tqdm import tqdm

import abftgemm
from abftgemm import Report, UncorrectableError
from abftgemm.backend import to_host
from abftgemm.faults import PATTERNS, Fault, bit_layout, chain
from attention import INVARIANT_SITES, SITES, MultiHeadAttention, reference

GEMM_SITE = "gemm"
#: Sites of a campaign by default: the layer's GEMM and invariant sites, then a standalone GEMM.
DEFAULT_SITES: tuple[str, ...] = SITES + tuple(INVARIANT_SITES) + (GEMM_SITE,)
#: ``dtype name -> (rtol, atol_scale)`` of the "differs" test (see the module docstring).
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-9), "float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2),
    "bfloat16": (5e-2, 5e-2),
}
#: Multiple of the fault-free run's own rounding error that still counts as equal.
NOISE_FACTOR = 10.0
COUNTS: tuple[str, ...] = (
    "injected", "detected", "detected_at_site", "corrected", "corrected_elements", "recomputed",
    "uncorrectable", "silent", "masked", "miscorrected", "nonfinite_output", "false_positives",
)


def fault_kinds(dtype: Any, additive: float = 1.0) -> dict[str, dict[str, Any]]:
    """Campaign fault kinds: label -> :class:`abftgemm.faults.Fault` keyword arguments.

    ``"bitflip-exp"`` flips the top exponent bit (huge values, INF/NaN, or for values >= 2 a tiny
    one); ``"bitflip-mant"`` flips the top mantissa bit (a relative change of up to 50%).
    """
    mantissa, exponent = bit_layout(np.dtype(dtype))
    return {
        "inf": {"kind": "inf"}, "-inf": {"kind": "-inf"}, "nan": {"kind": "nan"},
        "near-inf": {"kind": "near-inf"},
        "bitflip-exp": {"kind": "bitflip", "bit": mantissa + exponent - 1},
        "bitflip-mant": {"kind": "bitflip", "bit": mantissa - 1},
        "additive": {"kind": "additive", "magnitude": additive},
    }


@dataclass(frozen=True)
class CampaignConfig:
    """What a campaign runs.

    Attributes
    ----------
    trials : int
        Seeded trials per (site, kind, pattern, mode).
    clean_trials : int
        Fault-free trials per mode (false positives).
    batch, seq, d_model, n_heads : int
        Attention layer and input sizes.
    gemm : tuple of int
        ``(m, k, n)`` of the standalone product.
    dtype : str
    additive : float
        Magnitude of the ``"additive"`` kind.
    sites, kinds, patterns : tuple of str
        Subsets to run (defaults: everything).
    seed : int
    """

    trials: int = 2
    clean_trials: int = 10
    batch: int = 2
    seq: int = 16
    d_model: int = 32
    n_heads: int = 4
    gemm: tuple[int, int, int] = (32, 32, 32)
    dtype: str = "float32"
    additive: float = 1.0
    sites: tuple[str, ...] = DEFAULT_SITES
    kinds: tuple[str, ...] = ("inf", "-inf", "nan", "near-inf", "bitflip-exp", "bitflip-mant",
                              "additive")
    patterns: tuple[str, ...] = PATTERNS
    seed: int = 0


@dataclass
class Record:
    """Counts of one (site, kind, pattern, protected) cell; see the module docstring."""

    site: str
    kind: str
    pattern: str
    protected: bool
    fault: dict[str, Any]
    trials: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON-ready dict: the identifying fields, ``trials``, then every count."""
        out = asdict(self)
        return {**{k: v for k, v in out.items() if k != "counts"}, **self.counts}


@dataclass
class _Trial:
    """The outcome of one run."""

    report: Report
    uncorrectable: bool
    results: dict[str, Any] | None
    injected: bool


class _Testbed:
    """A layer, its inputs and fault-free references for one trial seed."""

    def __init__(self, config: CampaignConfig, xp: Any, trial: int):
        c = config
        self.config, self.xp = c, xp
        self.layer = MultiHeadAttention(c.d_model, c.n_heads, dtype=c.dtype, xp=xp, seed=c.seed)
        rng = np.random.default_rng([c.seed, 5, trial])
        dtype = self.layer.dtype
        shape = (c.batch, c.seq, c.d_model)
        m, k, n = c.gemm
        self.x, self.dy, self.a, self.b = (xp.asarray(rng.standard_normal(s).astype(dtype))
                                           for s in (shape, shape, (m, k), (k, n)))
        self.reference = {site: self.run(site, "off", None).results
                          for site in ("layer", GEMM_SITE)}
        self.atol = self._atol()

    def _atol(self) -> dict[str, dict[str, float]]:
        """Per result: the absolute tolerance of the "differs" test (module docstring)."""
        host = {k: to_host(v).astype(np.float64) for k, v in
                {"x": self.x, "dy": self.dy, "a": self.a, "b": self.b,
                 **self.layer.params}.items()}
        n_heads = self.config.n_heads
        y, cache = reference.forward(host["x"], host, n_heads)
        dx, grads = reference.backward(host["dy"], cache, host, n_heads)
        exact = {"layer": {"y": y, "dx": dx, **grads}, GEMM_SITE: {"c": host["a"] @ host["b"]}}
        _, scale = TOLERANCES[np.dtype(self.layer.dtype).name]
        atol: dict[str, dict[str, float]] = {}
        for target, results in self.reference.items():
            atol[target] = {}
            for key, r in results.items():
                r = to_host(r).astype(np.float64)
                noise = float(np.abs(r - exact[target][key]).max())
                atol[target][key] = max(scale * float(np.abs(r).max()), NOISE_FACTOR * noise)
        return atol

    def run(self, site: str, check: str, hook: Callable | None) -> _Trial:
        """One forward+backward (or one product for ``site == "gemm"``) with ``hook``."""
        report = Report()
        try:
            if site == GEMM_SITE:
                c, r = abftgemm.matmul(self.a, self.b, check=check, fault_hook=hook,
                                       name=GEMM_SITE, return_report=True)
                report.extend(r)
                results = {"c": c}
            else:
                self.layer.check = check
                y, cache = self.layer.forward(self.x, fault_hook=hook)
                report.extend(self.layer.last_report)
                dx, grads = self.layer.backward(self.dy, cache, fault_hook=hook)
                report.extend(self.layer.last_report)
                results = {"y": y, "dx": dx, **grads}
        except UncorrectableError as exc:
            report.extend(exc.report)
            return _Trial(report, True, None, bool(getattr(hook, "injected", False)))
        return _Trial(report, False, results, bool(getattr(hook, "injected", False)))

    def differs(self, site: str, results: dict[str, Any]) -> bool:
        """Whether any result differs from the fault-free one beyond :data:`TOLERANCES`."""
        target = GEMM_SITE if site == GEMM_SITE else "layer"
        rtol, _ = TOLERANCES[np.dtype(self.layer.dtype).name]
        xp = self.xp
        for key, r in results.items():
            expected = self.reference[target][key].astype(np.float64)
            atol = self.atol[target][key]
            ok = xp.abs(r.astype(np.float64) - expected) <= rtol * xp.abs(expected) + atol
            if not bool(ok.all()):
                return True
        return False


def _nonfinite(results: dict[str, Any] | None, xp: Any) -> bool:
    return results is not None and not all(bool(xp.isfinite(r).all()) for r in results.values())


def _tally(record: Record, bench: _Testbed, trial: _Trial) -> None:
    """Add one trial's outcome to ``record``."""
    n = record.counts
    report = trial.report
    detected = report.detected or trial.uncorrectable
    differs = trial.results is not None and bench.differs(record.site, trial.results)
    record.trials += 1
    n["injected"] += trial.injected
    n["detected"] += detected
    n["detected_at_site"] += record.site in report.sites
    n["corrected"] += report.corrected > 0
    n["corrected_elements"] += report.corrected
    n["recomputed"] += report.recomputed > 0
    n["uncorrectable"] += trial.uncorrectable
    n["silent"] += differs and not detected
    n["masked"] += not differs and not detected
    n["miscorrected"] += differs and detected
    n["nonfinite_output"] += _nonfinite(trial.results, bench.xp)
    n["false_positives"] += detected and record.kind == "none"


def _fault_seed(seed: int, *parts: Any) -> int:
    """A stable per-cell fault seed (the same for the protected and unprotected run)."""
    return zlib.crc32("/".join(map(str, (seed, *parts))).encode())


def _cells(config: CampaignConfig) -> Iterator[tuple[str, str, str]]:
    for site in config.sites:
        for kind in config.kinds:
            for pattern in config.patterns:
                yield site, kind, pattern


MODES: tuple[tuple[str, bool], ...] = (("correct", True), ("off", False))
#: Site names of the clean records: a whole layer run (every layer site) and one product.
CLEAN_TARGETS: tuple[str, ...] = ("layer", GEMM_SITE)


def run_campaign(config: CampaignConfig, xp: Any, progress: bool = True) -> list[dict[str, Any]]:
    """Run the campaign of the module docstring.

    Parameters
    ----------
    config : CampaignConfig
    xp : module
        numpy or cupy.
    progress : bool
        Show a progress bar.

    Returns
    -------
    list of dict
        One record per (site, kind, pattern, protected) with ``site``, ``kind``, ``pattern``,
        ``protected``, ``fault`` (the :class:`Fault` arguments), ``trials`` and the counts of
        :data:`COUNTS`; then the clean records (``kind == pattern == "none"``, site ``"layer"``
        for a whole forward+backward or ``"gemm"``), whose ``false_positives`` count clean trials
        flagged anywhere.
    """
    kinds = fault_kinds(config.dtype, config.additive)
    unknown = set(config.kinds) - set(kinds)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; choose from {sorted(kinds)}")
    faulty = {(site, kind, pattern, protected): Record(site, kind, pattern, protected,
                                                       dict(kinds[kind]))
              for site, kind, pattern in _cells(config) for _, protected in MODES}
    clean = {(target, protected): Record(target, "none", "none", protected, {})
             for target in CLEAN_TARGETS for _, protected in MODES}
    total = config.trials * len(faulty) + config.clean_trials * len(clean)
    bar = tqdm(total=total, desc="campaign", leave=False, disable=None if progress else True)
    with np.errstate(all="ignore"):  # the faults overflow and poison on purpose
        _trials(config, xp, kinds, faulty, clean, bar)
    bar.close()
    return [r.as_dict() for r in (*faulty.values(), *clean.values())]


def _trials(config: CampaignConfig, xp: Any, kinds: dict[str, dict[str, Any]],
            faulty: dict[tuple, Record], clean: dict[tuple, Record], bar: tqdm) -> None:
    """Run every trial, tallying into ``faulty`` and ``clean``."""
    for t in range(max(config.trials, config.clean_trials)):
        bench = _Testbed(config, xp, t)
        for check, protected in MODES if t < config.clean_trials else ():
            for target in CLEAN_TARGETS:
                _tally(clean[target, protected], bench, bench.run(target, check, None))
                bar.update()
        for site, kind, pattern in _cells(config) if t < config.trials else ():
            for check, protected in MODES:
                seed = _fault_seed(config.seed, site, kind, pattern, t)
                fault = Fault(pattern=pattern, seed=seed, sites=site, **kinds[kind])
                _tally(faulty[site, kind, pattern, protected], bench, bench.run(site, check, fault))
                bar.update()


# ----------------------------------------------------------------------------- propagation

#: Sites whose unprotected faults :func:`propagation` follows (DESIGN.md §4 table).
PROPAGATION_SITES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "scores", "context")
#: Stages observed: hook site -> name in DESIGN.md §4 (AS scores, AP probabilities, CL context, O).
STAGES: dict[str, str] = {"scores": "AS", "softmax": "AP", "context": "CL", "out_proj": "O"}


def propagation(config: CampaignConfig, xp: Any) -> dict[str, dict[str, np.ndarray]]:
    """How one unprotected element fault spreads through the forward pass.

    For each site of :data:`PROPAGATION_SITES` an ``"additive"`` fault (``config.additive``) hits
    element ``(seq // 2, 1)`` of batch 0 (for the per-head sites: batch 0, head 0) with
    ``check="off"``; each stage of :data:`STAGES` is captured as the hook sees it and compared with
    the fault-free run.

    Returns
    -------
    dict
        ``fault site -> stage name -> |faulty - clean|`` as a float64 NumPy array: batch 0 and
        head 0 for AS, AP, CL (``(seq, seq)``, ``(seq, seq)``, ``(seq, head_dim)``), batch 0 for O
        (``(seq, d_model)``).
    """
    bench = _Testbed(config, xp, 0)
    clean = _capture(bench, None)
    out = {}
    with np.errstate(all="ignore"):
        for site in PROPAGATION_SITES:
            fault = Fault("additive", "element", sites=site, batch=0, row=config.seq // 2, col=1,
                          magnitude=config.additive)
            faulty = _capture(bench, fault)
            out[site] = {STAGES[s]: np.abs(faulty[s] - clean[s]) for s in STAGES}
    return out


def _capture(bench: _Testbed, fault: Fault | None) -> dict[str, np.ndarray]:
    """Forward pass (check="off") recording batch 0 of every stage after ``fault`` acted."""
    seen: dict[str, np.ndarray] = {}

    def record(site: str, c: Any) -> None:
        if site in STAGES and site not in seen:
            seen[site] = to_host(c[0]).astype(np.float64)

    bench.layer.check = "off"
    bench.layer.forward(bench.x, fault_hook=record if fault is None else chain(fault, record))
    return seen


def spread(diff: np.ndarray) -> str:
    """Name the shape of the non-zero part of ``diff``: "-", "0D", "row", "column", "all", "2D"."""
    hit = ~(diff <= 1e-6 * float(np.nanmax(diff, initial=0.0)) + np.finfo(np.float64).tiny)
    rows, cols = int(hit.any(axis=1).sum()), int(hit.any(axis=0).sum())
    if rows == 0:
        return "-"
    if rows == 1 and cols == 1:
        return "0D"
    if rows == 1:
        return f"row ({cols}/{diff.shape[1]} cols)"
    if cols == 1:
        return f"column ({rows}/{diff.shape[0]} rows)"
    if hit.all():
        return "all"
    return f"2D ({rows}x{cols})"


# ----------------------------------------------------------------------------- summaries


def site_table(records: list[dict[str, Any]]) -> str:
    """Per site, summed over kinds and patterns: protected outcomes vs. unprotected damage."""
    head = ("| site | trials | protected: detected | corrected | recomputed | uncorrectable | "
            "silent | miscorrected | unprotected: silent | nonfinite | masked |")
    lines = [head, "|" + "---|" * 11]
    for site in dict.fromkeys(r["site"] for r in records if r["kind"] != "none"):
        p = _sum(records, site, True)
        u = _sum(records, site, False)
        lines.append(f"| {site} | {p['trials']} | {p['detected']} | {p['corrected']} | "
                     f"{p['recomputed']} | {p['uncorrectable']} | {p['silent']} | "
                     f"{p['miscorrected']} | {u['silent']} | {u['nonfinite_output']} | "
                     f"{u['masked']} |")
    return "\n".join(lines)


def coverage_table(records: list[dict[str, Any]]) -> str:
    """Protected detection rate (detected/trials over patterns) per site and kind."""
    kinds = list(dict.fromkeys(r["kind"] for r in records if r["kind"] != "none"))
    lines = ["| site | " + " | ".join(kinds) + " |", "|" + "---|" * (len(kinds) + 1)]
    for site in dict.fromkeys(r["site"] for r in records if r["kind"] != "none"):
        cells = []
        for kind in kinds:
            s = _sum(records, site, True, kind)
            cells.append(f"{s['detected']}/{s['trials']}")
        lines.append(f"| {site} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def clean_table(records: list[dict[str, Any]]) -> str:
    """False positives of the fault-free trials."""
    lines = ["| clean run | protected | trials | false positives | differs from fault-free |",
             "|---|---|---|---|---|"]
    for r in records:
        if r["kind"] == "none":
            lines.append(f"| {r['site']} | {r['protected']} | {r['trials']} | "
                         f"{r['false_positives']} | {r['silent'] + r['miscorrected']} |")
    return "\n".join(lines)


def propagation_table(prop: dict[str, dict[str, np.ndarray]]) -> str:
    """The DESIGN.md §4 table, measured: where one unprotected element fault spreads."""
    lines = ["| fault in | " + " | ".join(STAGES.values()) + " |", "|" + "---|" * (len(STAGES) + 1)]
    for site, stages in prop.items():
        lines.append(f"| {site} | " + " | ".join(spread(d) for d in stages.values()) + " |")
    return "\n".join(lines)


def markdown(records: list[dict[str, Any]], prop: dict[str, dict[str, np.ndarray]],
             config: CampaignConfig, backend: str) -> str:
    """The whole campaign summary (``campaign.md``)."""
    rtol, scale = TOLERANCES[config.dtype]
    return "\n\n".join([
        "# Fault-injection campaign",
        f"Backend {backend}, dtype {config.dtype}, layer batch={config.batch} seq={config.seq} "
        f"d_model={config.d_model} heads={config.n_heads}, standalone GEMM (m, k, n)="
        f"{config.gemm}; {config.trials} trial(s) per (site, kind, pattern, mode), "
        f"{config.clean_trials} clean trial(s) per mode; seed {config.seed}.",
        f"A trial's results (y, dx, every gradient; the product for `gemm`) *differ* when "
        f"|r - r_ref| > {rtol:g}·|r_ref| + atol, atol = max({scale:g}·max|r_ref|, "
        f"{NOISE_FACTOR:g}·(rounding error of the fault-free run against float64)). "
        "detected + silent + masked = trials; miscorrected = detected, delivered, still differs.",
        "## Outcomes per site (summed over kinds and patterns)", site_table(records),
        "## Protected coverage: detected / trials", coverage_table(records),
        "## Clean runs", clean_table(records),
        "## Propagation of one unprotected element fault (batch 0, head 0)",
        propagation_table(prop),
    ]) + "\n"


def _sum(records: list[dict[str, Any]], site: str, protected: bool,
         kind: str | None = None) -> dict[str, int]:
    rows = [r for r in records if r["site"] == site and r["protected"] == protected
            and r["kind"] != "none" and (kind is None or r["kind"] == kind)]
    return {k: sum(r[k] for r in rows) for k in ("trials", *COUNTS)}
