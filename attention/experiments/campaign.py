"""Fault-injection campaign: every fault kind and pattern at every site, protected and unprotected.

For each site (the 16 GEMM sites of :data:`attention.SITES`, the two softmax invariant sites, and
a standalone GEMM ``"gemm"`` through :func:`abftgemm.matmul`), each fault kind of
:func:`fault_kinds`, each pattern of :data:`abftgemm.faults.PATTERNS`, and each protection mode
(``check="correct"``: protected, ``check="off"``: unprotected), ``trials`` seeded trials run one
forward and one backward pass of a :class:`attention.MultiHeadAttention` (or one product) with a
single :class:`abftgemm.faults.Fault` at that site.  Every trial is compared with the fault-free,
unprotected run of the same layer on the same inputs, through the same code (with a fault hook
that changes nothing: a hook sends float32's softmax backward through its unscaled ``dS``, which
rounds differently): output ``y``, ``dx`` and every gradient (for ``"gemm"``: the product); the
clean trials with the plain unprotected run.  ``clean_trials`` runs without a fault measure false positives.
``core="fused"`` (``--core fused``) runs the same trials on the fused attention core's internal
sites and its final checks' sites instead (:mod:`attention.experiments.fused_campaign`).

Outcome of a trial: each trial whose fault fired (every clean trial) counts in exactly one of
these four (see :data:`OUTCOMES`); a faulted trial whose fault never fired (its site was not
reached) counts in none of them, as ``not_fired``::

    detected             protection flagged something (an event, or UncorrectableError)
    silent               nothing flagged, and some result differs from the fault-free run by more
                         than the tolerance below: silent corruption
    silent_within_bound  nothing flagged, some result differs from the fault-free run, but every
                         difference is within the tolerance (e.g. a fault smaller than the
                         detection threshold: a y element moved from 1.247e-4 to 1.857e-4)
    masked               nothing flagged and every result is bit-identical to the fault-free run

and, overlapping ``detected``: ``corrected`` (trials with elements rebuilt from checksums),
``recomputed`` (trials with a recomputation), ``uncorrectable`` (UncorrectableError raised),
``miscorrected`` (flagged and delivered, but a result still differs beyond the tolerance);
overlapping everything: ``nonfinite_output`` (``y``, ``dx`` or a gradient holds INF/NaN),
``detected_at_site`` (flagged at the faulted site itself).  With ``check="off"`` detection is 0
by definition; ``silent`` counts the damage.  Clean (fault-free) trials run protected only: an
unprotected run cannot flag anything, so it cannot have a false positive.

The tolerance ("differs beyond"): ``|r - r_ref| > rtol * |r_ref| + atol`` for any element of any
result ``r`` (NaN differs from everything), where ``atol = max(atol_scale * max|r_ref|,
NOISE_FACTOR * noise, tiny / u)`` and ``noise = max|r_ref - r_exact|`` is the rounding error of
the fault-free run itself against the float64 reference (:mod:`attention.reference`; ``a @ b``
in float64 for ``"gemm"``); ``tiny`` and ``u`` are the smallest normal number and the unit
roundoff of the arithmetic (float64 for float64 data, else float32): the checks' thresholds
have absolute floors of the lengths summed times ``tiny``, which a result that is exactly 0
everywhere (dropout 1) meets with no other term.  ``(rtol, atol_scale)`` come from :data:`TOLERANCES` by dtype -- for
float32 ``(1e-4, 1e-4)``: a corrected element is rebuilt as checksum minus the sum of the
others, which carries a rounding error of a few ``eps * sum|row|``; a thousand times the float32
rounding unit relative to the largest value is damage, not rounding.  The noise term matters for
results that are exactly 0 in exact arithmetic and pure rounding in floating point, such as the
gradient of the key bias ``bk`` (softmax is invariant to it): any re-association, a correction
included, changes them completely.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterator

import numpy as np
from tqdm import tqdm

import abftgemm
from abftgemm import Report, UncorrectableError
from abftgemm.backend import to_host
from abftgemm.checksums import accumulation_dtype
from abftgemm.faults import PATTERNS, Fault, bit_layout, chain
from attention import INVARIANT_SITES, SITES, MultiHeadAttention, reference
from attention.experiments import fused_campaign
from attention.experiments.flags import option
from attention.experiments.hf_models import FAMILIES, model_problem
from attention.experiments.outcomes import (NOISE_FACTOR, TOLERANCES, Trial, absolute_floor,
                                            absolute_tolerances, compare)
from attention.experiments.provenance import provenance_line

GEMM_SITE = "gemm"
#: Sites of a campaign by default: the layer's GEMM and invariant sites, then a standalone GEMM.
DEFAULT_SITES: tuple[str, ...] = SITES + tuple(INVARIANT_SITES) + (GEMM_SITE,)
#: The cores a campaign faults: the layer (its unfused attention core) or the fused core alone.
CORES: tuple[str, ...] = ("unfused", "fused")
#: The outcomes of the module docstring: every trial counts in exactly one, but a faulted trial
#: whose fault never fired (``not_fired``), which counts in none.
OUTCOMES: tuple[str, ...] = ("detected", "silent", "silent_within_bound", "masked")
COUNTS: tuple[str, ...] = (
    "injected", "not_fired", *OUTCOMES, "detected_at_site", "corrected", "corrected_elements",
    "recomputed",
    "uncorrectable", "miscorrected", "nonfinite_output", "false_positives",
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


#: Fault kinds of a campaign (labels of :func:`fault_kinds`).
KINDS: tuple[str, ...] = ("inf", "-inf", "nan", "near-inf", "bitflip-exp", "bitflip-mant",
                          "additive")


#: CampaignConfig fields a --model family does not use.
_LAYER_ONLY = ("dtype", "sites", "patterns", "clean_trials", "gemm")


@dataclass(frozen=True)
class CampaignConfig:
    """What a campaign runs (each field is also an ``abft campaign`` flag).

    Attributes
    ----------
    trials : int
        Seeded trials per (site, kind, pattern, mode), at least 1.
    clean_trials : int
        Fault-free protected trials (false positives), at least 0.
    batch, seq, d_model, n_heads : int
        Attention layer and input sizes: ``seq >= 2``, ``d_model`` a multiple of ``n_heads``
        with at least 2 columns per head (the propagation fault hits column 1 of head 0; an
        even number for ``model="llama"``).
    gemm : tuple of int
        ``(m, k, n)`` of the standalone product.
    dtype : str
    additive : float
        Magnitude of the ``"additive"`` kind (finite, non-zero).
    sites, kinds, patterns : tuple of str
        Subsets to run (defaults: everything), each non-empty and known; ``sites`` of the
        ``core``: :data:`DEFAULT_SITES`, or :func:`attention.experiments.fused_campaign.sites_of`
        the dropout (all of them when ``sites`` is left at :data:`DEFAULT_SITES`).
    core : str
        ``"unfused"``: the layer's sites and a standalone GEMM (the module docstring).
        ``"fused"``: the fused attention core's internal and final-check sites
        (:mod:`attention.experiments.fused_campaign`), on ``batch * n_heads`` heads of ``seq``
        x ``d_model / n_heads``; ``gemm`` does not apply.
    mask, dropout : str, float
        The fused core's mask (:data:`attention.experiments.fused_campaign.MASKS`; default
        causal) and attention dropout probability in ``[0, 1]`` (default 0); ``core="fused"``
        only.
    seed : int
        At least 0 (below 2**64 with a transformers ``model``).
    model : str
        ``"layer"``: this module's campaign of the attention layer. A transformers family
        (:data:`attention.experiments.hf_models.FAMILIES`): the training-propagation campaign of
        :mod:`attention.experiments.hf_campaign` on a model of that family with ``layers``
        blocks, ``steps`` training steps per run (at every protected product of the first layer;
        ``sites``, ``patterns``, ``clean_trials``, ``gemm`` and ``dtype`` do not apply).
    layers, steps : int
        See ``model`` (a family's only); ``steps`` at least 3: the fault strikes in step 1
        (:data:`attention.experiments.hf_campaign.FAULT_STEP`), and a fault in its backward
        pass shows only in the loss of the step after.

    Raises
    ------
    ValueError
        On any value outside those ranges, naming the flag.
    """

    trials: int = option(2, "seeded trials per (site, kind, pattern, protection mode)")
    clean_trials: int = option(10, "fault-free protected trials (false positives)")
    batch: int = option(2, "layer input batch")
    seq: int = option(16, "layer input sequence length")
    d_model: int = option(32, "layer width")
    n_heads: int = option(4, "attention heads (must divide --d-model)", flag="--heads")
    gemm: tuple[int, int, int] = option((32, 32, 32), "shape of the standalone product",
                                        nargs=3, metavar=("M", "K", "N"))
    dtype: str = option("float32", "layer and product dtype", choices=tuple(TOLERANCES))
    additive: float = option(1.0, "magnitude of 'additive' faults")
    sites: tuple[str, ...] = option(DEFAULT_SITES, "sites to fault (the fused:* sites with "
                                    "--core fused, all of them by default)",
                                    choices=DEFAULT_SITES + fused_campaign.ALL_SITES)
    kinds: tuple[str, ...] = option(KINDS, "fault kinds", choices=KINDS)
    patterns: tuple[str, ...] = option(PATTERNS, "fault patterns", choices=PATTERNS)
    seed: int = option(0, "seed of everything random")
    model: str = option("layer", "the attention layer, or training-propagation in a small "
                        "transformers model of that family (needs the [hf] extra)",
                        choices=("layer",) + FAMILIES)
    layers: int = option(2, "transformer blocks of a --model family")
    steps: int = option(6, "training steps per run of a --model family (the fault in step 1; "
                        "at least 3: a faulty gradient shows in a later step's loss)")
    core: str = option("unfused", "attention core to fault: the layer's (unfused) sites, or the "
                       "fused core's internal tile sites", choices=CORES)
    mask: str = option("causal", "the fused core's mask (--core fused)",
                       choices=tuple(fused_campaign.MASKS))
    dropout: float = option(0.0, "the fused core's attention dropout probability (--core fused)")

    def __post_init__(self) -> None:
        at_least = {"--trials": (self.trials, 1), "--clean-trials": (self.clean_trials, 0),
                    "--batch": (self.batch, 1), "--seq": (self.seq, 2),
                    "--d-model": (self.d_model, 1), "--heads": (self.n_heads, 1),
                    "--gemm": (min(self.gemm), 1), "--layers": (self.layers, 1),
                    "--steps": (self.steps, 3), "--seed": (self.seed, 0)}
        for flag, (value, low) in at_least.items():
            if value < low:
                raise ValueError(f"{flag} must be at least {low}, got {value}")
        if len(self.gemm) != 3:
            raise ValueError(f"--gemm takes three sizes M K N, got {self.gemm}")
        if self.d_model % self.n_heads or self.d_model // self.n_heads < 2:
            raise ValueError(f"--heads ({self.n_heads}) must divide --d-model ({self.d_model}) "
                             "into heads of at least 2 columns")
        if self.dtype not in TOLERANCES:
            raise ValueError(f"--dtype must be one of {', '.join(TOLERANCES)}, got {self.dtype}")
        if not (math.isfinite(self.additive) and self.additive != 0):
            raise ValueError(f"--additive must be finite and non-zero, got {self.additive}")
        if self.model not in ("layer",) + FAMILIES:
            raise ValueError(f"--model must be layer or one of {', '.join(FAMILIES)}, got "
                             f"{self.model}")
        if self.core not in CORES:
            raise ValueError(f"--core must be one of {', '.join(CORES)}, got {self.core}")
        problem = model_problem(self.model, self.d_model, self.n_heads, self.seed)
        if problem:
            raise ValueError(problem)
        if self.core == "fused" and self.model != "layer":
            raise ValueError("--core fused faults the fused attention core alone: --model layer")
        if self.mask not in fused_campaign.MASKS:
            raise ValueError(f"--mask must be one of {', '.join(fused_campaign.MASKS)}, got "
                             f"{self.mask}")
        if not 0 <= self.dropout <= 1:
            raise ValueError(f"--dropout must be a probability in [0, 1], got {self.dropout}")
        for applies, names, why in (
                (self.model == "layer", _LAYER_ONLY, "for --model layer only (a --model family "
                 "runs float32 and faults the model's own sites)"),
                (self.core == "unfused", ("gemm",), "for --core unfused only (the fused core's "
                 "campaign has no standalone product)"),
                (self.core == "fused", ("mask", "dropout"), "for --core fused only"),
                (self.model != "layer", ("layers", "steps"), "for a --model family only")):
            given = self._given(names)
            if given and not applies:
                raise ValueError(f"{', '.join(given)}: {why}")
        for name in ("sites", "kinds", "patterns"):  # a value given twice is one cell
            object.__setattr__(self, name, tuple(dict.fromkeys(getattr(self, name))))
        fused_sites = fused_campaign.sites_of(self.dropout)
        if self.core == "fused" and self.sites == DEFAULT_SITES:
            object.__setattr__(self, "sites", fused_sites)
        if self.core == "fused":
            missing = [s for s in self.sites if s in fused_campaign.ALL_SITES
                       and s not in fused_sites]
            if missing:
                raise ValueError(f"--sites {', '.join(missing)}: the dropped probabilities, "
                                 "with --dropout only")
        site_choices = fused_sites if self.core == "fused" else DEFAULT_SITES
        for flag, chosen, known in (("--sites", self.sites, site_choices),
                                    ("--kinds", self.kinds, KINDS),
                                    ("--patterns", self.patterns, PATTERNS)):
            unknown = [c for c in chosen if c not in known]
            if unknown or not chosen:
                raise ValueError(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; "
                                 f"choose from {', '.join(known)}")

    def _given(self, names: tuple[str, ...]) -> list[str]:
        """The flags of the fields ``names`` set to other than their defaults."""
        return [f"--{f.name.replace('_', '-')}" for f in fields(self)
                if f.name in names and getattr(self, f.name) != f.default]


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


class _Testbed:
    """A layer, its inputs and fault-free references for one trial seed."""

    def __init__(self, config: CampaignConfig, xp: Any, trial: int):
        c = config
        self.config, self.xp = c, xp
        # the unfused core whatever runs: a fault hook picks it, so the fault-free reference and
        # the clean runs must too (the fused core differs in the last bits, and has none of
        # these sites)
        self.layer = MultiHeadAttention(c.d_model, c.n_heads, dtype=c.dtype, xp=xp, seed=c.seed,
                                        core="unfused")
        rng = np.random.default_rng([c.seed, 5, trial])
        dtype = self.layer.dtype
        shape = (c.batch, c.seq, c.d_model)
        m, k, n = c.gemm
        self.x, self.dy, self.a, self.b = (xp.asarray(rng.standard_normal(s).astype(dtype))
                                           for s in (shape, shape, (m, k), (k, n)))
        self.reference = {site: self.run(site, "off", None).results
                          for site in ("layer", GEMM_SITE)}
        # what a faulted trial is compared with: the fault-free run through the code a fault hook
        # takes (with a hook, the softmax backward hands the hook its unscaled dS and scales it
        # after, which rounds differently in float32 from the hook-free path: no fault that
        # changed nothing could otherwise be "masked")
        self.hooked = {site: self.run(site, "off", _no_fault).results
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
        return {target: absolute_tolerances(results, exact[target], self.config.dtype)
                for target, results in self.reference.items()}

    def fault(self, site: str, kind: dict[str, Any], pattern: str, seed: int) -> Fault:
        """The trial's fault: ``kind`` (keyword arguments of :class:`Fault`) at ``site``."""
        return Fault(pattern=pattern, seed=seed, sites=site, **kind)

    def run(self, site: str, check: str, hook: Callable | None) -> Trial:
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
                # the backward's findings alone (the forward's are in already)
                dx, grads = self.layer.backward(self.dy, {**cache, "report": Report()},
                                                fault_hook=hook)
                report.extend(self.layer.last_report)
                results = {"y": y, "dx": dx, **grads}
        except UncorrectableError as exc:
            report.extend(exc.report)
            return Trial(report, True, None, bool(getattr(hook, "injected", False)))
        return Trial(report, False, results, bool(getattr(hook, "injected", False)))

    def compare(self, site: str, results: dict[str, Any], faulted: bool = False) -> str:
        """``"equal"`` (bit-identical to the fault-free run), ``"within"`` (differs, within the
        tolerance of the module docstring) or ``"beyond"``; ``faulted``: a run with a fault
        hook, compared with the fault-free run through the same code."""
        target = GEMM_SITE if site == GEMM_SITE else "layer"
        reference = (self.hooked if faulted else self.reference)[target]
        return compare(self.xp, results, reference, self.atol[target], self.config.dtype)


def _no_fault(site: str, c: Any) -> None:
    """A fault hook that changes nothing (the fault-free run of a faulted trial's code)."""


def _nonfinite(results: dict[str, Any] | None, xp: Any) -> bool:
    return results is not None and not all(bool(xp.isfinite(r).all()) for r in results.values())


def _tally(record: Record, bench: Any, trial: Trial) -> None:
    """Add one trial's outcome to ``record``."""
    n = record.counts
    report = trial.report
    detected = report.detected or trial.uncorrectable
    faulted = record.kind != "none"
    record.trials += 1
    n["injected"] += trial.injected
    if faulted and not trial.injected:  # no fault ran: not an outcome of one
        n["not_fired"] += 1
        n["false_positives"] += detected
        return
    verdict = "equal" if trial.results is None else \
        bench.compare(record.site, trial.results, faulted=faulted)
    n["detected"] += detected
    n["detected_at_site"] += record.site in report.sites
    n["corrected"] += report.corrected > 0
    n["corrected_elements"] += report.corrected
    n["recomputed"] += report.recomputed > 0
    n["uncorrectable"] += trial.uncorrectable
    n["silent"] += verdict == "beyond" and not detected
    n["silent_within_bound"] += verdict == "within" and not detected
    n["masked"] += verdict == "equal" and not detected
    n["miscorrected"] += verdict == "beyond" and detected
    n["nonfinite_output"] += _nonfinite(trial.results, bench.xp)
    n["false_positives"] += detected and not faulted


def _fault_seed(seed: int, *parts: Any) -> int:
    """A stable per-cell fault seed (the same for the protected and unprotected run)."""
    return zlib.crc32("/".join(map(str, (seed, *parts))).encode())


def _cells(config: CampaignConfig) -> Iterator[tuple[str, str, str]]:
    for site in config.sites:
        for kind in config.kinds:
            for pattern in config.patterns:
                yield site, kind, pattern


MODES: tuple[tuple[str, bool], ...] = (("correct", True), ("off", False))
#: Site names of the (protected) clean records: a whole layer run (every layer site) and one
#: product.
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
        :data:`COUNTS`; then the clean records (``kind == pattern == "none"``, protected only, site
        ``"layer"`` for a whole forward+backward or ``"gemm"``; ``"fused"`` for the fused core's),
        whose ``false_positives`` count clean trials flagged anywhere.

    Raises
    ------
    ValueError
        Where :func:`backend_problem` names one.
    """
    problem = backend_problem(config, xp)
    if problem:
        raise ValueError(problem)
    kinds = {site: fault_kinds(site_dtype(config, site), config.additive)
             for site in config.sites}
    faulty = {(site, kind, pattern, protected): Record(site, kind, pattern, protected,
                                                       dict(kinds[site][kind]))
              for site, kind, pattern in _cells(config) for _, protected in MODES}
    targets = CLEAN_TARGETS if config.core == "unfused" else (fused_campaign.CLEAN_TARGET,)
    clean = {target: Record(target, "none", "none", True, {}) for target in targets}
    total = config.trials * len(faulty) + config.clean_trials * len(clean)
    bar = tqdm(total=total, desc="campaign", leave=False, disable=None if progress else True)
    with np.errstate(all="ignore"):  # the faults overflow and poison on purpose
        _trials(config, xp, kinds, faulty, clean, bar)
    bar.close()
    return [r.as_dict() for r in (*faulty.values(), *clean.values())]


def _trials(config: CampaignConfig, xp: Any, kinds: dict[str, dict[str, dict[str, Any]]],
            faulty: dict[tuple, Record], clean: dict[tuple, Record], bar: tqdm) -> None:
    """Run every trial, tallying into ``faulty`` and ``clean`` (``kinds``: per site, as the
    elements it hits hold them)."""
    for t in range(max(config.trials, config.clean_trials)):
        bench = testbed(config, xp, t)
        for target in clean if t < config.clean_trials else ():
            _tally(clean[target], bench, bench.run(target, "correct", None))
            bar.update()
        for site, kind, pattern in _cells(config) if t < config.trials else ():
            for check, protected in MODES:
                seed = _fault_seed(config.seed, site, kind, pattern, t)
                fault = bench.fault(site, kinds[site][kind], pattern, seed)
                _tally(faulty[site, kind, pattern, protected], bench, bench.run(site, check, fault))
                bar.update()


#: Layer sites whose fault hook sees the accumulation dtype, not the data's: the softmax
#: backward hands it its unscaled dS (float32 for 16-bit data).
ACCUMULATED_SITES: tuple[str, ...] = ("softmax_backward",)


def site_dtype(config: CampaignConfig, site: str) -> np.dtype:
    """The dtype of the elements a fault at ``site`` hits, whose layout places the bit flips of
    :func:`fault_kinds`: the data's, the accumulation dtype at :data:`ACCUMULATED_SITES`, and on
    the fused core :func:`attention.experiments.fused_campaign.site_dtype`."""
    if config.core == "fused":
        return fused_campaign.site_dtype(config.dtype, site)
    data = np.dtype(config.dtype)
    return accumulation_dtype(data) if site in ACCUMULATED_SITES else data


def backend_problem(config: CampaignConfig, xp: Any) -> str | None:
    """Why ``config`` cannot run on the array module ``xp``, or None (``--core fused`` on CuPy:
    the CUDA kernels inject single elements)."""
    if config.core == "unfused":
        return None
    return fused_campaign.backend_problem(config.sites, config.patterns, xp)


def testbed(config: CampaignConfig, xp: Any, trial: int) -> Any:
    """The inputs and fault-free references of trial ``trial``: of the layer and a standalone
    GEMM, or of the fused core (:class:`attention.experiments.fused_campaign.FusedTestbed`)."""
    if config.core == "unfused":
        return _Testbed(config, xp, trial)
    c = config
    shape = (c.batch * c.n_heads, c.seq, c.d_model // c.n_heads)
    return fused_campaign.FusedTestbed(c.dtype, shape, c.seed, xp, trial, c.mask, c.dropout)


# ----------------------------------------------------------------------------- propagation

#: Sites whose unprotected faults :func:`propagation` follows.
PROPAGATION_SITES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "scores", "context")
#: Stages observed: hook site -> name (AS scores, AP probabilities, CL context, O output).
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
    head = ("| site | trials per mode | protected: detected | corrected | recomputed | "
            "uncorrectable | miscorrected | silent, within bound | silent corruption | masked | "
            "unprotected: silent corruption | silent, within bound | masked | non-finite output |")
    lines = [head, "|" + "---|" * 14]
    for site in dict.fromkeys(r["site"] for r in records if r["kind"] != "none"):
        p = _sum(records, site, True)
        u = _sum(records, site, False)
        cells = [p[k] for k in ("trials", "detected", "corrected", "recomputed", "uncorrectable",
                                "miscorrected", "silent_within_bound", "silent", "masked")]
        cells += [u[k] for k in ("silent", "silent_within_bound", "masked", "nonfinite_output")]
        lines.append(f"| {site} | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def not_fired_lines(records: list[dict[str, Any]]) -> list[str]:
    """A line for the summary when faulted trials never fired their fault (no outcome counts
    them), else none."""
    missed = {}
    for r in records:
        if r["not_fired"]:
            missed[r["site"]] = missed.get(r["site"], 0) + r["not_fired"]
    if not missed:
        return []
    return ["**Faults that never fired** (trials counted in no outcome): " +
            ", ".join(f"{site} {n}" for site, n in missed.items()) + "."]


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
    """The protected fault-free trials: false positives, and how the results compare with the
    unprotected fault-free run."""
    lines = ["| clean run (protected) | trials | false positives | bit-identical to unprotected | "
             "differs, within bound | differs beyond bound |", "|---|---|---|---|---|---|"]
    for r in records:
        if r["kind"] == "none":
            lines.append(f"| {r['site']} | {r['trials']} | {r['false_positives']} | "
                         f"{r['masked']} | {r['silent_within_bound']} | "
                         f"{r['silent'] + r['miscorrected']} |")
    return "\n".join(lines)


def propagation_table(prop: dict[str, dict[str, np.ndarray]]) -> str:
    """Where one unprotected element fault spreads (stages of :data:`STAGES`), measured."""
    lines = ["| fault in | " + " | ".join(STAGES.values()) + " |", "|" + "---|" * (len(STAGES) + 1)]
    for site, stages in prop.items():
        lines.append(f"| {site} | " + " | ".join(spread(d) for d in stages.values()) + " |")
    return "\n".join(lines)


#: campaign.md's glossary: what every outcome and column means.
GLOSSARY = """\
Outcomes (every trial counts in exactly one of the first four):

- **detected**: protection flagged the trial (an event at any site, or `UncorrectableError`).
- **silent corruption**: nothing flagged, and a result differs from the fault-free run beyond the
  bound below.
- **silent, within bound**: nothing flagged, a result differs from the fault-free run, but by no
  more than the bound (a fault below the detection threshold that still moved some values).
- **masked**: nothing flagged, every result bit-identical to the fault-free run.

A faulted trial whose fault never fired (the run did not reach its site) counts in none of them;
the summary says how many there were, if any.

Overlapping **detected**: **corrected** (elements rebuilt from checksums), **recomputed** (rows,
columns or tiles recomputed from the inputs), **uncorrectable** (`UncorrectableError` raised, no
result delivered), **miscorrected** (delivered, still beyond the bound). **non-finite output**:
y, dx or a gradient holds INF/NaN. **trials per mode**: trials with protection on
(`check="correct"`), and as many with it off (`check="off"`), on the same inputs and faults.
**false positives**: protected trials flagged anywhere that ran no fault."""

#: campaign.md's legend of the propagation table.
STAGE_LEGEND = """\
Stages: **AS** attention scores Q_h K_hᵀ/√d, **AP** attention probabilities softmax(AS), **CL**
context AP·V_h, **O** output of the layer (all heads, after the output projection). Cells: `-`
unchanged, `0D` one element, `row (c/n cols)` one row, `column (r/n rows)` one column, `all`
every element, `2D (r x c)` a block of rows and columns."""


def markdown(records: list[dict[str, Any]], prop: dict[str, dict[str, np.ndarray]] | None,
             config: CampaignConfig, backend: str) -> str:
    """The whole campaign summary (``campaign.md``); ``prop`` None (``--core fused``) leaves the
    propagation section out."""
    rtol, scale = TOLERANCES[config.dtype]
    if config.core == "fused":
        dropout = f", dropout {config.dropout:g}" if config.dropout else ""
        what = (f"fused attention core ({fused_campaign.MASKS[config.mask]}{dropout}), "
                f"{config.batch * config.n_heads} heads of seq="
                f"{config.seq} x head_dim={config.d_model // config.n_heads}")
        results = "out, dq, dk, dv"
    else:
        what = (f"layer batch={config.batch} seq={config.seq} d_model={config.d_model} heads="
                f"{config.n_heads}, standalone GEMM (m, k, n)={config.gemm}")
        results = "y, dx, every gradient; the product for `gemm`"
    parts = [
        "# Fault-injection campaign",
        f"Backend {backend}, dtype {config.dtype}, {what}; {config.trials} trial(s) per (site, "
        f"kind, pattern, mode), {config.clean_trials} clean protected trial(s) per target; seed "
        f"{config.seed}. " + provenance_line(),
        GLOSSARY,
        f"The bound: a trial's results ({results}) differ "
        f"beyond it when |r - r_ref| > {rtol:g}·|r_ref| + atol for some element, atol = "
        f"max({scale:g}·max|r_ref|, {NOISE_FACTOR:g}·(rounding error of the fault-free run "
        f"against float64), {absolute_floor(config.dtype):.3g} (the checks' absolute floor)), "
        "r_ref the unprotected fault-free run.",
        "## Outcomes per site (summed over kinds and patterns)", site_table(records),
        *not_fired_lines(records),
        "## Protected coverage: detected / trials", coverage_table(records),
        "## Clean runs", clean_table(records),
    ]
    if prop is not None:
        parts += ["## Propagation of one unprotected element fault (batch 0, head 0)",
                  STAGE_LEGEND, propagation_table(prop)]
    return "\n\n".join(parts) + "\n"


def _sum(records: list[dict[str, Any]], site: str, protected: bool,
         kind: str | None = None) -> dict[str, int]:
    rows = [r for r in records if r["site"] == site and r["protected"] == protected
            and r["kind"] != "none" and (kind is None or r["kind"] == kind)]
    return {k: sum(r[k] for r in rows) for k in ("trials", *COUNTS)}
