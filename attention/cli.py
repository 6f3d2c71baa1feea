"""The ``abft`` command line: ``campaign``, ``train``, ``bench`` and ``demo``.

``abft campaign``  fault-injection campaign over every site, kind and pattern
                   (:mod:`attention.campaign`): campaign.json, campaign.md, coverage.png,
                   propagation.png under ``--out``.
``abft train``     a character-level GPT trained unprotected, protected and with
                   checkpoint/restore under faults (:mod:`attention.train`): train.json, train.md,
                   loss.png under ``--out``.
``abft bench``     runs ``bench/gemm.py`` and ``bench/attention.py`` (when present) with the same
                   ``--backend``, writing ``gemm.json`` / ``attention.json`` under ``--out``.
``abft demo``      a quick campaign and a quick training run (``make demo``; about 20 s on
                   two CPU cores the first time, 8 s once the kernels are cached), printing
                   their tables.

Common flags: ``--backend numpy|cupy`` (default: cupy when CuPy imports and sees a GPU, else
numpy), ``--seed``, ``--out``, ``--no-progress``. (The CPU checks are single-threaded: see
bench/NOTES.md on threads next to OpenBLAS.)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from abftgemm.faults import PATTERNS

BENCH_SCRIPTS: tuple[str, ...] = ("gemm.py", "attention.py")
BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def gpu_usable() -> bool:
    """True when CuPy imports and reports at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return False


def array_module(backend: str) -> ModuleType:
    """The array module of ``backend`` ("numpy" or "cupy")."""
    if backend == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


def build_parser() -> argparse.ArgumentParser:
    """The ``abft`` argument parser with its four subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", choices=("numpy", "cupy"), default=None,
                        help="array backend (default: cupy when a GPU is usable, else numpy)")
    common.add_argument("--seed", type=int, default=0, help="seed of everything random")
    common.add_argument("--no-progress", action="store_true", help="hide progress bars")

    parser = argparse.ArgumentParser(prog="abft", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    camp = sub.add_parser("campaign", parents=[common], help="fault-injection campaign")
    camp.add_argument("--out", type=Path, default=Path("out/campaign"))
    _campaign_flags(camp)

    train = sub.add_parser("train", parents=[common], help="training under faults")
    train.add_argument("--out", type=Path, default=Path("out/train"))
    _train_flags(train)

    bench = sub.add_parser("bench", parents=[common], help="run bench/gemm.py, bench/attention.py")
    bench.add_argument("--out", type=Path, default=Path("out/bench"))
    bench.add_argument("--quick", action="store_true", help="pass --quick to the benchmarks")

    demo = sub.add_parser("demo", parents=[common], help="quick campaign + quick training")
    demo.add_argument("--out", type=Path, default=Path("out/demo"))
    return parser


def _campaign_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=2, help="trials per (site, kind, pattern, mode)")
    p.add_argument("--clean-trials", type=int, default=10, help="fault-free trials per mode")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--gemm", type=int, nargs=3, default=(32, 32, 32), metavar=("M", "K", "N"),
                   help="shape of the standalone product")
    p.add_argument("--dtype", default="float32",
                   choices=("float16", "bfloat16", "float32", "float64"))
    p.add_argument("--additive", type=float, default=1.0, help="magnitude of 'additive' faults")
    p.add_argument("--sites", nargs="+", default=None, help="subset of sites (default: all)")
    p.add_argument("--kinds", nargs="+", default=None, help="subset of fault kinds (default: all)")
    p.add_argument("--patterns", nargs="+", default=None, choices=PATTERNS,
                   help="subset of patterns (default: all)")


def _train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--fault-rate", type=float, default=0.05,
                   help="probability that a step gets one extreme fault")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``abft`` and ``python -m attention``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.backend is None:
        args.backend = "cupy" if gpu_usable() else "numpy"
    elif args.backend == "cupy" and not gpu_usable():
        print("abft: --backend cupy, but CuPy is not installed or sees no GPU", file=sys.stderr)
        return 2
    command = {"campaign": _campaign, "train": _train, "bench": _bench, "demo": _demo}
    return command[args.command](args)


def _campaign(args: argparse.Namespace) -> int:
    from attention.campaign import DEFAULT_SITES, CampaignConfig

    config = CampaignConfig(
        trials=args.trials, clean_trials=args.clean_trials, batch=args.batch, seq=args.seq,
        d_model=args.d_model, n_heads=args.heads, gemm=tuple(args.gemm), dtype=args.dtype,
        additive=args.additive, sites=tuple(args.sites or DEFAULT_SITES),
        kinds=tuple(args.kinds or CampaignConfig.kinds),
        patterns=tuple(args.patterns or PATTERNS), seed=args.seed)
    return _run_campaign(config, args)


def _run_campaign(config: Any, args: argparse.Namespace) -> int:
    import json

    from attention import campaign, plots

    xp = array_module(args.backend)
    print(f"campaign: backend {args.backend}, {config.trials} trial(s) per cell, "
          f"{len(config.sites)} sites x {len(config.kinds)} kinds x {len(config.patterns)} "
          f"patterns x 2 modes", flush=True)
    records = campaign.run_campaign(config, xp, progress=not args.no_progress)
    prop = campaign.propagation(config, xp)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "campaign.json").write_text(json.dumps(records, indent=1))
    (out / "campaign.md").write_text(campaign.markdown(records, prop, config, args.backend))
    plots.coverage_heatmap(records, out / "coverage.png")
    plots.propagation_grid(prop, out / "propagation.png")
    print(campaign.site_table(records), campaign.clean_table(records),
          campaign.propagation_table(prop), sep="\n\n")
    print(f"\nwrote {out}/campaign.json, campaign.md, coverage.png, propagation.png")
    return 0


def _train(args: argparse.Namespace) -> int:
    from attention.train import TrainConfig

    config = TrainConfig(
        steps=args.steps, batch=args.batch, seq=args.seq, d_model=args.d_model,
        n_heads=args.heads, n_layers=args.layers, d_ff=args.d_ff, lr=args.lr,
        fault_rate=args.fault_rate, checkpoint_every=args.checkpoint_every, dtype=args.dtype,
        seed=args.seed)
    return _run_train(config, args)


def _run_train(config: Any, args: argparse.Namespace) -> int:
    from attention import plots, train

    xp = array_module(args.backend)
    print(f"train: backend {args.backend}, {config.steps} steps x 4 runs, fault rate "
          f"{config.fault_rate}", flush=True)
    summary = train.train(config, xp, args.out, progress=not args.no_progress)
    table = train.format_table(summary)
    (args.out / "train.md").write_text("# Training under faults\n\n" + table + "\n")
    plots.loss_curves(summary, args.out / "loss.png")
    print(table)
    print(f"\nwrote {args.out}/train.json, train.md, loss.png")
    return 0


def _bench(args: argparse.Namespace) -> int:
    scripts = [BENCH_DIR / name for name in BENCH_SCRIPTS if (BENCH_DIR / name).exists()]
    if not scripts:
        print(f"abft bench: no benchmark scripts in {BENCH_DIR}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for script in scripts:
        command = [sys.executable, str(script), "--backend", args.backend,
                   "--json", str(args.out / f"{script.stem}.json")]
        if args.quick:
            command.append("--quick")
        print("$ " + " ".join(command), flush=True)
        status = max(status, subprocess.run(command, check=False).returncode)
    return status


def _demo(args: argparse.Namespace) -> int:
    from attention.campaign import CampaignConfig
    from attention.train import TrainConfig

    campaign = CampaignConfig(trials=2, clean_trials=10, seed=args.seed)
    train = TrainConfig(steps=200, checkpoint_every=20, seed=args.seed)
    return _run_campaign(campaign, args) or _run_train(train, args)
