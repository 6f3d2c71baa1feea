"""Figures of the campaign and of training under faults (matplotlib, Agg backend, PNG files)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402


def coverage_heatmap(records: list[dict[str, Any]], path: Path) -> None:
    """Site x kind heatmaps: protected detected/trials, and unprotected silent/trials.

    Parameters
    ----------
    records : list of dict
        Campaign records (:func:`attention.campaign.run_campaign`); clean records are skipped.
    path : Path
        PNG file to write.
    """
    faulty = [r for r in records if r["kind"] != "none"]
    sites = list(dict.fromkeys(r["site"] for r in faulty))
    kinds = list(dict.fromkeys(r["kind"] for r in faulty))
    panels = (("protected: detected / trials", True, "detected"),
              ("unprotected: silent corruption / trials", False, "silent"))
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.6 * len(kinds), 1.5 + 0.35 * len(sites)),
                             constrained_layout=True)
    for ax, (title, protected, count) in zip(axes, panels):
        rate = np.zeros((len(sites), len(kinds)))
        for i, site in enumerate(sites):
            for j, kind in enumerate(kinds):
                cell = [r for r in faulty if (r["site"], r["kind"], r["protected"])
                        == (site, kind, protected)]
                trials = sum(r["trials"] for r in cell)
                rate[i, j] = sum(r[count] for r in cell) / trials if trials else math.nan
        image = ax.imshow(rate, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), v in np.ndenumerate(rate):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if v > 0.5 else "white")
        ax.set_xticks(range(len(kinds)), kinds, rotation=45, ha="right")
        ax.set_yticks(range(len(sites)), sites)
        ax.set_title(title)
    fig.colorbar(image, ax=axes, shrink=0.6)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def propagation_grid(prop: dict[str, dict[str, np.ndarray]], path: Path) -> None:
    """log10 |faulty - clean| per fault site (rows) and stage AS, AP, CL, O (columns).

    Parameters
    ----------
    prop : dict
        From :func:`attention.campaign.propagation`.
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
                ax.set_title(stage)
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
        From :func:`attention.train.train`.
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
    ax.set_title("Character-level GPT under faults")
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)
