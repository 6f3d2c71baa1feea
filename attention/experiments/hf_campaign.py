"""Fault propagation through training of a transformers model, unprotected and protected.

The seed paper's first two experiments at CPU scale (``abft campaign --model gpt2``): a small
model of one family (:mod:`attention.experiments.hf_models`) trains on the synthetic corpus; at
step :data:`FAULT_STEP` one fault of a kind (INF, NaN, near-INF, ...) hits one element of one
protected product of the first layer (every one in turn, forward and backward); training goes on
for ``steps`` steps in all.

- Unprotected (``check="off"``): does the run become non-trainable (a non-finite loss), and how
  many steps after the fault?
- Protected (``check="correct"``): was the fault detected, and is the loss curve the fault-free
  one (the largest difference of a step's loss from the fault-free run's)?

Each (site, kind) runs ``trials`` times with different fault positions (seeds), each run on a
fresh model from the same seed, so every run sees the same batches and the same initial weights.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from tqdm import tqdm

from abftgemm.faults import Fault
from attention.experiments.campaign import fault_kinds
from attention.experiments.hf_models import HFTrainer
from attention.experiments.provenance import provenance, provenance_line
from attention.experiments.train import RunResult, TrainConfig, synthetic_corpus

#: The fault strikes during this step (after one clean step: the model has an optimizer state).
FAULT_STEP = 1
#: Length of the synthetic training text (longer where ``seq`` needs it: ``seq + 2``).
CORPUS_CHARS = 20000
#: The campaign settings a transformers family uses (the others do not apply to it).
SETTINGS: tuple[str, ...] = ("model", "layers", "steps", "trials", "kinds", "additive", "batch",
                             "seq", "d_model", "n_heads", "seed")


def first_layer_sites(sites: list[str]) -> list[str]:
    """The sites of the first layer's modules (module paths with a ``.0.`` component)."""
    return [s for s in sites if ".0." in s.split(":")[0] + "."]


def run(config: Any, device: str = "cpu", progress: bool = True) -> dict[str, Any]:
    """Every (site of the first layer, kind, trial), unprotected and protected.

    Parameters
    ----------
    config : attention.experiments.campaign.CampaignConfig
        ``model`` (the family), ``layers``, ``steps``, ``trials``, ``kinds``, sizes, ``seed``.
    device : str
        ``"cpu"`` or ``"cuda"``.
    progress : bool

    Returns
    -------
    dict
        ``{"model", "config" (the :data:`SETTINGS`), "device", "provenance"
        (:func:`attention.experiments.provenance.provenance`), "sites", "fault_free": [loss per
        step], "records": [...]}``; a record holds
        ``site, kind, trial, protected, fired, non_trainable_at, steps_to_non_trainable,
        detected, corrected, recomputed, max_abs_loss_diff``.
    """
    corpus_chars = max(CORPUS_CHARS, config.seq + 2)
    text = synthetic_corpus(corpus_chars, config.seed)
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], dtype=np.int64)
    settings = TrainConfig(model=config.model, seq=config.seq, batch=config.batch,
                           d_model=config.d_model, n_heads=config.n_heads,
                           n_layers=config.layers, d_ff=2 * config.d_model, seed=config.seed,
                           corpus_chars=corpus_chars)

    def trainer() -> HFTrainer:
        return HFTrainer(settings, data, len(chars), device)

    sites = first_layer_sites(trainer().sites())
    fault_free = _train(trainer(), config.steps, "correct", None)[0]
    kinds = fault_kinds("float32", config.additive)
    cells = [(s, k, t) for s in sites for k in config.kinds for t in range(config.trials)]
    records = []
    for site, kind, trial in tqdm(cells, desc=f"campaign {config.model}", leave=False,
                                  disable=None if progress else True):
        for protected in (False, True):
            # --seed moves the faults too (the default, 0, gives seed = trial)
            fault = Fault(pattern="element", seed=config.seed * 100_003 + trial, sites=site,
                          **kinds[kind])
            losses, result = _train(trainer(), config.steps, "correct" if protected else "off",
                                    fault)
            bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
            diffs = [abs(a - b) for a, b in zip(losses, fault_free)]
            records.append({
                "site": site, "kind": kind, "trial": trial, "protected": protected,
                "fired": bool(fault.injected), "non_trainable_at": bad,
                "steps_to_non_trainable": None if bad is None else bad - FAULT_STEP,
                "detected": result.detected, "corrected": result.corrected,
                "recomputed": result.recomputed,
                "max_abs_loss_diff": max(d if math.isfinite(d) else math.inf for d in diffs)})
    return {"model": config.model, "config": {k: getattr(config, k) for k in SETTINGS},
            "device": device, "provenance": provenance(), "sites": sites,
            "fault_free": fault_free, "records": records}


def describe(result: dict[str, Any]) -> str:
    """One line of campaign.md: the settings, device and provenance of :func:`run`'s
    ``result``."""
    settings = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
                        for k, v in result["config"].items())
    return (f"Settings: {settings}; PyTorch on {result['device']}. "
            f"{provenance_line(result['provenance'])}")


def _train(trainer: HFTrainer, steps: int, check: str,
           fault: Fault | None) -> tuple[list[float], RunResult]:
    """Losses of ``steps`` training steps, ``fault`` injected during step :data:`FAULT_STEP`;
    an unprotected run stops at its first non-finite loss (the rest count as non-finite)."""
    result = RunResult("campaign", check, [])
    losses: list[float] = []
    for step in range(steps):
        scheduled = _Once(fault) if fault is not None and step == FAULT_STEP else None
        loss, grads = trainer.grads(step, check, scheduled, result)
        losses.append(loss)
        if not math.isfinite(loss):
            losses += [math.nan] * (steps - step - 1)
            break
        trainer.opt.step(grads)
    return losses, result


class _Once:
    """A scheduled fault in the form :meth:`HFTrainer.grads` takes (``hook()``)."""

    def __init__(self, fault: Fault):
        self.fault = fault

    def hook(self) -> Fault:
        return self.fault


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (site, kind): runs, share made non-trainable unprotected, mean steps until then, share
    detected protected, largest protected loss difference from the fault-free run."""
    rows = []
    cells = dict.fromkeys((r["site"], r["kind"]) for r in result["records"])
    for site, kind in cells:
        mine = [r for r in result["records"] if (r["site"], r["kind"]) == (site, kind)
                and r["fired"]]
        off = [r for r in mine if not r["protected"]]
        on = [r for r in mine if r["protected"]]
        broken = [r["steps_to_non_trainable"] for r in off if r["non_trainable_at"] is not None]
        rows.append({
            "site": site, "kind": kind, "runs": len(off),
            "non_trainable": len(broken) / len(off) if off else None,
            "steps_to_non_trainable": float(np.mean(broken)) if broken else None,
            "detected": sum(r["detected"] > 0 for r in on) / len(on) if on else None,
            "max_abs_loss_diff": max((r["max_abs_loss_diff"] for r in on), default=None)})
    return rows


def kinds_table(result: dict[str, Any]) -> str:
    """Per fault kind, over every site: faulty runs, how many became non-trainable unprotected and
    after how many steps (``k``: that many steps after the faulty one), and the protected runs
    detected and made non-trainable."""
    lines = ["| kind | runs | unprotected: non-trainable | after (steps: runs) | "
             "protected: detected | protected: non-trainable |", "|" + "---|" * 6]
    for kind in dict.fromkeys(r["kind"] for r in result["records"]):
        mine = [r for r in result["records"] if r["kind"] == kind and r["fired"]]
        off = [r for r in mine if not r["protected"]]
        on = [r for r in mine if r["protected"]]
        after = sorted(r["steps_to_non_trainable"] for r in off
                       if r["non_trainable_at"] is not None)
        spread = ", ".join(f"{k}: {after.count(k)}" for k in dict.fromkeys(after)) or "-"
        lines.append(f"| {kind} | {len(off)} | {len(after)} | {spread} | "
                     f"{sum(r['detected'] > 0 for r in on)} | "
                     f"{sum(r['non_trainable_at'] is not None for r in on)} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The per-kind and per-(site, kind) tables and the totals."""
    rows = summary_rows(result)
    lines = [kinds_table(result), "",
             "| site | kind | runs | unprotected: non-trainable | steps until then | "
             "protected: detected | protected: max abs dloss |", "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r['site']} | {r['kind']} | {r['runs']} | {_pct(r['non_trainable'])} | "
                     f"{_num(r['steps_to_non_trainable'])} | {_pct(r['detected'])} | "
                     f"{_num(r['max_abs_loss_diff'])} |")
    fired = [r for r in result["records"] if r["fired"]]
    off = [r for r in fired if not r["protected"]]
    on = [r for r in fired if r["protected"]]
    broken = sum(r["non_trainable_at"] is not None for r in off)
    lines += ["", f"{result['model']}: {len(off)} faulty runs per mode; unprotected, "
              f"{broken} ({_pct(broken / len(off) if off else None)}) became non-trainable; "
              f"protected, {sum(r['detected'] > 0 for r in on)} detected, "
              f"{sum(r['non_trainable_at'] is not None for r in on)} non-trainable, largest "
              f"loss difference from the fault-free run "
              f"{_num(max((r['max_abs_loss_diff'] for r in on), default=None))}"]
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
