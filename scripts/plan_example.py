"""Worked example of the adaptive checking frequency (attention.plan.adaptive_frequencies).

Costs come from counts (attention.experiments.check_costs): the bytes each site's checks move and
the FLOPs they do for the given shape, turned into milliseconds with a nominal bandwidth and FLOP
rate, so the same command prints the same table on every machine.  Vulnerability is each site's
share of the layer's GEMM FLOPs (a fault strikes a site in proportion to the work it does).  It
prints, as markdown, the cheapest per-site checking probabilities that keep the expected number
of unchecked faults per step under a target.

``--measure ROUNDS`` adds a cross-check: per-site timings on this machine (the layer with only
that site checked minus the layer with none, forward+backward, medians of ``--repeats``
interleaved repetitions), ``ROUNDS`` times over, shown as min-max ranges.  They are not the
model's input: on a busy CPU they vary from run to run by more than most sites cost.

Run: ``python scripts/plan_example.py [--shape B H S HD] [--fault-rate R] [--target T]
[--bandwidth GB/s] [--gflops GFLOP/s] [--measure ROUNDS --repeats N]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from attention import SITES, CheckingPlan, adaptive_frequencies
from attention.experiments.check_costs import check_costs, model_ms


def site_flops(b: int, h: int, s: int, hd: int) -> dict[str, float]:
    """GEMM FLOPs (2mnk) of every site of one forward+backward."""
    d = h * hd
    proj = 2 * b * s * d * d
    core = 2 * b * h * s * s * hd
    return {"q_proj": proj, "k_proj": proj, "v_proj": proj, "scores": core, "context": core,
            "out_proj": proj, "d_wo": proj, "d_context": proj, "d_probs": core, "d_v": core,
            "d_q": core, "d_k": core, "d_wq": proj, "d_wk": proj, "d_wv": proj, "d_x": 3 * proj}


def measured_ranges(shape: tuple[int, int, int, int], rounds: int,
                    repeats: int) -> dict[str, tuple[float, float]]:
    """Per site (and "invariants"): min and max over ``rounds`` of the timed check cost (ms)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed
    from bench.attention import Case, site_costs

    case = Case(np, shape, "float32")
    runs = [site_costs(case, repeats, 2, gpu=False) for _ in range(rounds)]
    return {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in runs[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(4, 4, 128, 32),
                        metavar=("B", "H", "S", "HD"))
    parser.add_argument("--fault-rate", type=float, default=1e-3,
                        help="expected faults per layer step (all sites together)")
    parser.add_argument("--target", type=float, default=1e-4,
                        help="tolerated expected unchecked faults per step")
    parser.add_argument("--bandwidth", type=float, default=20.0,
                        help="nominal memory bandwidth of the checks, GB/s")
    parser.add_argument("--gflops", type=float, default=10.0,
                        help="nominal FLOP rate of the checks, GFLOP/s")
    parser.add_argument("--measure", type=int, default=0, metavar="ROUNDS",
                        help="also time every site ROUNDS times (a cross-check, shown as ranges)")
    parser.add_argument("--repeats", type=int, default=7, help="repetitions per timing round")
    args = parser.parse_args(argv)
    shape = tuple(args.shape)
    counted = check_costs(*shape)
    cost = {s: model_ms(counted[s], args.bandwidth, args.gflops) for s in SITES}
    flops = site_flops(*shape)
    total = sum(flops.values())
    vulnerability = {s: flops[s] / total for s in SITES}
    freq = adaptive_frequencies(args.fault_rate, vulnerability, cost, args.target)
    timed = measured_ranges(shape, args.measure, args.repeats) if args.measure else {}

    print(f"shape (batch, heads, seq, head_dim) = {shape}, float32; fault rate "
          f"{args.fault_rate:g}/step, target {args.target:g} unchecked/step; model: "
          f"{args.bandwidth:g} GB/s, {args.gflops:g} GFLOP/s\n")
    head = "| site | GEMM FLOPs share | check bytes | check FLOPs | model cost (ms) | probability |"
    rule = "|---|---|---|---|---|---|"
    if timed:
        head += f" timed (ms, min-max of {args.measure}) |"
        rule += "---|"
    print(head)
    print(rule)
    for s in SITES:
        line = (f"| {s} | {vulnerability[s]:.3f} | {counted[s].bytes:,} | {counted[s].flops:,} | "
                f"{cost[s]:.3f} | {freq[s]:.3f} |")
        if timed:
            line += f" {timed[s][0]:.3f} to {timed[s][1]:.3f} |"
        print(line)
    full = sum(cost.values())
    chosen = sum(freq[s] * cost[s] for s in SITES)
    left = sum(args.fault_rate * vulnerability[s] * (1 - freq[s]) for s in SITES)
    print(f"\nchecking every site costs {full:.3f} ms/step (model); the plan costs {chosen:.3f} "
          f"ms/step and leaves {left:.2g} expected unchecked faults/step "
          f"(target {args.target:g}).")
    if timed:
        low = sum(timed[s][0] for s in SITES)
        high = sum(timed[s][1] for s in SITES)
        print(f"timed, summed over the sites: {low:.3f} to {high:.3f} ms/step; the softmax "
              f"invariants (always on): {timed['invariants'][0]:.3f} to "
              f"{timed['invariants'][1]:.3f} ms/step.")
    print("\nApply it: `MultiHeadAttention(..., plan=CheckingPlan().with_frequencies(freq))`.")
    CheckingPlan().with_frequencies(freq)  # validates the site names


if __name__ == "__main__":
    main()
