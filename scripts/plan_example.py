"""Worked example of the adaptive checking frequency (attention.plan.adaptive_frequencies).

Measures, on this machine, the cost of checking each attention site alone (the layer with only
that site checked minus the layer unchecked, forward+backward), takes each site's share of the
layer's GEMM FLOPs as its vulnerability (a fault strikes a site in proportion to the work it
does), and prints the cheapest per-site checking probabilities that keep the expected number of
unchecked faults per step under a target, as markdown.

Run: ``PYTHONPATH=. python scripts/plan_example.py [--shape B H S HD] [--fault-rate R] [--target T]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import SITES, CheckingPlan, adaptive_frequencies  # noqa: E402
from bench.attention import Case, site_costs  # noqa: E402


def site_flops(b: int, h: int, s: int, hd: int) -> dict[str, float]:
    """GEMM FLOPs (2mnk) of every site of one forward+backward."""
    d = h * hd
    proj = 2 * b * s * d * d
    core = 2 * b * h * s * s * hd
    return {"q_proj": proj, "k_proj": proj, "v_proj": proj, "scores": core, "context": core,
            "out_proj": proj, "d_wo": proj, "d_context": proj, "d_probs": core, "d_v": core,
            "d_q": core, "d_k": core, "d_wq": proj, "d_wk": proj, "d_wv": proj, "d_x": 3 * proj}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(4, 4, 128, 32))
    parser.add_argument("--fault-rate", type=float, default=1e-3,
                        help="expected faults per layer step (all sites together)")
    parser.add_argument("--target", type=float, default=1e-4,
                        help="tolerated expected unchecked faults per step")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    case = Case(np, tuple(args.shape), "float32")
    costs = site_costs(case, args.repeats, 2, gpu=False)
    flops = site_flops(*args.shape)
    total = sum(flops.values())
    vulnerability = {s: flops[s] / total for s in SITES}
    cost = {s: max(costs[s], 1e-6) for s in SITES}
    freq = adaptive_frequencies(args.fault_rate, vulnerability, cost, args.target)
    print(f"shape (batch, heads, seq, head_dim) = {tuple(args.shape)}, float32, NumPy; "
          f"fault rate {args.fault_rate:g}/step, target {args.target:g} unchecked/step\n")
    print("| site | GEMM FLOPs share | check cost (ms) | probability checked |")
    print("|---|---|---|---|")
    for s in SITES:
        print(f"| {s} | {vulnerability[s]:.3f} | {costs[s]:.3f} | {freq[s]:.3f} |")
    full = sum(cost.values())
    chosen = sum(freq[s] * cost[s] for s in SITES)
    left = sum(args.fault_rate * vulnerability[s] * (1 - freq[s]) for s in SITES)
    print(f"\nThe softmax invariants, checked on every call, cost {costs['invariants']:.3f} ms/step "
          "on top.")
    print(f"\nchecking every site costs {full:.3f} ms/step; the plan costs {chosen:.3f} ms/step "
          f"and leaves {left:.2g} expected unchecked faults/step (target {args.target:g}).")
    print("\nApply it: `MultiHeadAttention(..., plan=CheckingPlan().with_frequencies(freq))`.")
    CheckingPlan().with_frequencies(freq)  # validates the site names


if __name__ == "__main__":
    main()
