"""Figures of the campaign and of training under faults (matplotlib, Agg backend, PNG files).

matplotlib is optional (``pip install "abftgemm[plots]"``): importing this module without it
raises ModuleNotFoundError, which ``abft`` turns into a one-line note and skips the figures.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

#: Full names of the propagation stages (the columns of :func:`propagation_grid`).
STAGE_NAMES: dict[str, str] = {"AS": "attention scores", "AP": "attention probabilities",
                               "CL": "context", "O": "layer output"}


#: Outcome -> (label, colour) of :func:`coverage_bars`, in stacking order.  Okabe-Ito colours
#: (distinguishable with every common colour-vision deficiency), one meaning each: blues for the
#: trials protection caught, vermillion and reddish purple for wrong results delivered, orange for
#: small undetected changes, grey for no effect.
OUTCOME_STYLE: dict[str, tuple[str, str]] = {
    "repaired": ("detected, delivered within bound", "#0072B2"),
    "uncorrectable": ("detected, raised UncorrectableError", "#56B4E9"),
    "miscorrected": ("detected, delivered beyond bound", "#CC79A7"),
    "silent": ("silent corruption", "#D55E00"),
    "silent_within_bound": ("silent, within bound", "#E69F00"),
    "masked": ("masked (bit-identical)", "#BBBBBB"),
}


def outcome_shares(records: list[dict[str, Any]], site: str, protected: bool) -> dict[str, float]:
    """Share of the trials at ``site`` (summed over kinds and patterns) per :data:`OUTCOME_STYLE`
    outcome; the shares add up to 1 (all NaN when the site has no trial)."""
    cell = [r for r in records if r["kind"] != "none" and r["site"] == site
            and r["protected"] == protected]
    n = {k: sum(r[k] for r in cell) for k in ("trials", "detected", "uncorrectable",
                                                  "miscorrected", "silent",
                                                  "silent_within_bound", "masked")}
    counts = {"repaired": n["detected"] - n["uncorrectable"] - n["miscorrected"],
              **{k: n[k] for k in OUTCOME_STYLE if k != "repaired"}}
    return {k: v / n["trials"] if n["trials"] else math.nan for k, v in counts.items()}


def coverage_bars(records: list[dict[str, Any]], path: Path) -> None:
    """Per site, the share of each trial outcome, protected (left) and unprotected (right).

    Parameters
    ----------
    records : list of dict
        Campaign records (:func:`attention.experiments.campaign.run_campaign`); clean records
        are skipped.
    path : Path
        PNG file to write.
    """
    sites = list(dict.fromkeys(r["site"] for r in records if r["kind"] != "none"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.8 + 0.3 * len(sites)), sharey=True,
                             constrained_layout=True)
    rows = np.arange(len(sites))
    for ax, protected in zip(axes, (True, False)):
        shares = [outcome_shares(records, site, protected) for site in sites]
        left = np.zeros(len(sites))
        for outcome, (label, colour) in OUTCOME_STYLE.items():
            width = np.array([s[outcome] for s in shares])
            ax.barh(rows, width, left=left, color=colour, label=label, edgecolor="white",
                    linewidth=0.5)
            left += np.nan_to_num(width)
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of trials")
        ax.set_title("protection on (check=\"correct\")" if protected
                     else "protection off (check=\"off\")")
    axes[0].set_yticks(rows, sites)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def propagation_grid(prop: dict[str, dict[str, np.ndarray]], path: Path) -> None:
    """log10 |faulty - clean| per fault site (rows) and stage (columns).

    Stages: AS attention scores, AP attention probabilities (softmax of AS), CL context (AP V),
    O layer output (all heads, after the output projection).

    Parameters
    ----------
    prop : dict
        From :func:`attention.experiments.campaign.propagation`.
    path : Path
        PNG file to write.
    """
    sites = list(prop)
    stages = list(prop[sites[0]])
    cmap = plt.get_cmap("magma").with_extremes(bad="white")
    fig, axes = plt.subplots(len(sites), len(stages), figsize=(2.6 * len(stages),
                                                               2.2 * len(sites)),
                             constrained_layout=True, squeeze=False)
    for i, site in enumerate(sites):
        for j, stage in enumerate(stages):
            ax = axes[i, j]
            diff = prop[site][stage]
            with np.errstate(divide="ignore"):
                image = ax.imshow(np.log10(np.where(diff > 0, diff, np.nan)), vmin=-8, vmax=1,
                                  cmap=cmap, aspect="auto")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(f"{stage}: {STAGE_NAMES.get(stage, stage)}", fontsize=9)
            if j == 0:
                ax.set_ylabel(f"fault in {site}")
    fig.colorbar(image, ax=axes, shrink=0.5, label="log10 |faulty - clean| (white: unchanged)")
    fig.suptitle("One unprotected element fault, batch 0 / head 0 (rows: queries)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loss_curves(summary: dict[str, Any], path: Path) -> None:
    """Loss per step of every training run, with fault steps and checkpoint restores marked.

    Parameters
    ----------
    summary : dict
        From :func:`attention.experiments.train.train`.
    path : Path
        PNG file to write.
    """
    fig, ax = plt.subplots(figsize=(9, 4.5), constrained_layout=True)
    styles = {"fault_free": ("black", "-", 2.5), "unprotected": ("tab:red", "-", 1.2),
              "protected": ("tab:green", "--", 1.5), "checkpoint": ("tab:blue", ":", 1.5)}
    for name, run in summary["runs"].items():
        losses = np.array([math.nan if v is None else v for v in run["losses"]], dtype=float)
        color, style, width = styles.get(name, ("gray", "-", 1))
        ax.plot(np.where(np.isfinite(losses), losses, math.nan), style, color=color,
                lw=width, label=name)
        if run["non_trainable_at"] is not None:
            ax.axvline(run["non_trainable_at"], color=color, lw=1)
            ax.annotate(f"{name}: non-finite loss", (run["non_trainable_at"], 0.97), color=color,
                        xycoords=("data", "axes fraction"), fontsize=8, ha="left", va="top")
    for i, restore in enumerate(summary["runs"].get("checkpoint", {}).get("restores", [])):
        ax.axvline(restore["at"], color="tab:blue", lw=0.6, alpha=0.5,
                   label="checkpoint restore" if i == 0 else None)
    for i, fault in enumerate(summary["schedule"]):
        ax.plot(fault["step"], 0, "v", color="tab:orange", ms=5, transform=ax.get_xaxis_transform(),
                clip_on=False, label="fault" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    model = summary.get("config", {}).get("model", "gpt")
    ax.set_title("Character-level GPT under faults" if model == "gpt" else
                 f"Hugging Face {model} under faults")
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)
