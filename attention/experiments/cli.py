"""The ``abft`` command line: ``campaign``, ``train``, ``bench`` and ``demo``.

``abft campaign``  fault-injection campaign over every site, kind and pattern
                   (:mod:`attention.experiments.campaign`): campaign.json, campaign.md,
                   coverage.png, propagation.png under ``--out``.
``abft train``     a character-level GPT trained unprotected, protected and with
                   checkpoint/restore under faults (:mod:`attention.experiments.train`):
                   train.json, train.md, loss.png under ``--out``.  The PNG files need matplotlib
                   (``pip install "abftgemm[plots]"``); without it they are skipped with a note.
``abft bench``     runs ``bench/gemm.py`` and ``bench/attention.py`` (when present) with the same
                   ``--backend``, writing ``gemm.json`` / ``attention.json`` under ``--out``.
``abft demo``      a quick campaign and a quick training run (what ``make demo`` runs),
                   printing their tables.

Common flags: ``--backend numpy|cupy`` (default: cupy when CuPy imports and sees a GPU, else
numpy), ``--seed``, ``--out``, ``--no-progress``; ``abft COMMAND --help`` lists the rest with their
defaults.  A bad flag or value prints one line and exits with status 2. (The CPU checks are
single-threaded: see bench/NOTES.md on threads next to OpenBLAS.)
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, TypeVar

from attention.experiments.flags import add_flags, from_args

T = TypeVar("T")
#: How to get the plots when matplotlib is missing.
PLOTS_HINT = 'pip install "abftgemm[plots]"'
#: How to get a transformers ``--model`` when PyTorch or transformers is missing.
HF_HINT = 'pip install "abftgemm[hf]"'
BENCH_SCRIPTS: tuple[str, ...] = ("gemm.py", "attention.py")
#: The repository's bench/ folder (attention/experiments/cli.py -> repository root).
BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
#: The files ``abft campaign`` and ``abft train`` may write under ``--out``; a run removes those
#: it does not write itself (:func:`_drop_stale`).
OUTPUTS: dict[str, tuple[str, ...]] = {
    "campaign": ("campaign.json", "campaign.md", "coverage.png", "propagation.png"),
    "train": ("train.json", "train.md", "loss.png")}


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


#: Values that start with ``-`` and are no flag: the fault kind ``-inf`` (``--kinds inf -inf``).
_DASH_VALUES = frozenset({"-inf"})


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2, and which reads
    :data:`_DASH_VALUES` as values."""

    def _parse_optional(self, arg_string: str) -> Any:
        # argparse takes a word that starts with "-" for a flag unless it looks like a number
        if arg_string in _DASH_VALUES:
            return None
        return super()._parse_optional(arg_string)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``abft`` argument parser with its four subcommands.

    The flags of ``campaign`` and ``train`` are the fields of
    :class:`attention.experiments.campaign.CampaignConfig` and
    :class:`attention.experiments.train.TrainConfig` (:mod:`attention.experiments.flags`).
    """
    from attention.experiments.campaign import CampaignConfig
    from attention.experiments.train import TrainConfig

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", choices=("numpy", "cupy"), default=None,
                        help="array backend (default: cupy when a GPU is usable, else numpy)")
    common.add_argument("--no-progress", action="store_true", help="hide progress bars")

    parser = _Parser(prog="abft", description=_plain(__doc__.split("\n\n")[0]))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    camp = sub.add_parser("campaign", parents=[common], help="fault-injection campaign",
                          description=_plain((CampaignConfig.__doc__ or "").splitlines()[0]))
    camp.add_argument("--out", type=Path, default=Path("out/campaign"),
                      help="output folder (default: out/campaign)")
    add_flags(camp, CampaignConfig)

    train = sub.add_parser("train", parents=[common], help="training under faults",
                           description=_plain((TrainConfig.__doc__ or "").splitlines()[0]))
    train.add_argument("--out", type=Path, default=Path("out/train"),
                       help="output folder (default: out/train)")
    add_flags(train, TrainConfig)

    bench = sub.add_parser("bench", parents=[common], help="run bench/gemm.py, bench/attention.py")
    bench.add_argument("--out", type=Path, default=Path("out/bench"),
                       help="output folder (default: out/bench)")
    bench.add_argument("--quick", action="store_true", help="pass --quick to the benchmarks")

    demo = sub.add_parser("demo", parents=[common], help="quick campaign + quick training")
    demo.add_argument("--out", type=Path, default=Path("out/demo"),
                      help="output folder (default: out/demo)")
    demo.add_argument("--seed", type=int, default=0, help="seed of everything random (default: 0)")
    return parser


def _plain(text: str) -> str:
    """A docstring's line as ``--help`` prints it: reST roles and literals as plain words
    (``:func:`train``` -> ``train``, ````abft```` -> ``abft``)."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")


class _BadFlags(ValueError):
    """A configuration refused a flag's value (raised before anything runs)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``abft`` and ``python -m attention``; returns the exit status.

    Bad flags or values, and sizes past the machine's memory, print one line on stderr and
    return 2. Unless the environment sets it, ``OMP_WAIT_POLICY`` is ``passive`` in this
    process: the runs alternate NumPy's BLAS pool (the unprotected products) with numba's
    OpenMP pool (the fused attention core), and with both spinning after their work each waits
    for the cores the other holds (bench/NOTES.md).
    """
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before numba's OpenMP pool starts
    if args.backend is None:
        args.backend = "cupy" if gpu_usable() else "numpy"
    elif args.backend == "cupy" and not gpu_usable():
        print("abft: --backend cupy, but CuPy is not installed or sees no GPU", file=sys.stderr)
        return 2
    command = {"campaign": _campaign, "train": _train, "bench": _bench, "demo": _demo}
    try:
        _output_folder(args.out)  # before any work: train would fail after 3 of its 4 runs
        return command[args.command](args)
    except _BadFlags as exc:
        print(f"abft {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:  # sizes past this machine's memory
        if not _out_of_memory(exc):
            raise
        print(f"abft {args.command}: error: not enough memory for these sizes ({exc}); "
              "choose smaller ones", file=sys.stderr)
        return 2


#: What PyTorch's CPU allocator says when an allocation fails (a RuntimeError, not a
#: MemoryError).
_TORCH_CPU_OOM = "DefaultCPUAllocator: can't allocate memory"


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed: a MemoryError (NumPy, CuPy), PyTorch's
    ``OutOfMemoryError`` (CUDA) or its CPU allocator's RuntimeError."""
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or _TORCH_CPU_OOM in str(exc))


def _output_folder(out: Path) -> None:
    """Raise :class:`_BadFlags` when ``--out`` cannot become a folder: a file at it or above it,
    or a name the file system refuses. Nothing is created here (a bad flag leaves no folder
    behind); the commands create it (:func:`_make_output`)."""
    for part in (out, *out.parents):
        try:
            exists = part.exists()
        except OSError as exc:  # a name the file system refuses (too long)
            raise _BadFlags(f"--out {out}: {exc.strerror or exc}") from None
        if exists:
            if not part.is_dir():
                raise _BadFlags(f"--out {out}: a file is in the way ({part}); --out names a "
                                "folder")
            if not os.access(part, os.W_OK | os.X_OK):
                raise _BadFlags(f"--out {out}: cannot write in {part}")
            return


def _need_hf(model: str, backend: str) -> None:
    """Raise :class:`_BadFlags` when the transformers ``--model`` cannot run: PyTorch or
    transformers missing (saying how to get them), or ``--backend cupy`` (PyTorch on
    ``"cuda"``) with a PyTorch that sees no CUDA device (a CPU-only build)."""
    for name in ("torch", "transformers"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise _BadFlags(f"--model {model} needs PyTorch and transformers; "
                            f"{exc.name or name} is not installed ({HF_HINT})") from None
    import torch

    if backend == "cupy" and not torch.cuda.is_available():
        raise _BadFlags(f"--model {model} with --backend cupy trains with PyTorch on the GPU, "
                        "but this PyTorch sees no CUDA device (a CPU-only build?); "
                        "--backend numpy runs it on the CPU")


def _make_output(out: Path) -> None:
    """Create the folder ``--out`` once the flags are judged, before any work; raise
    :class:`_BadFlags` when the file system refuses it (a name too long, a read-only mount)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _BadFlags(f"--out {out}: {exc.strerror or exc}") from None


def _config(config: type[T], args: argparse.Namespace) -> T:
    try:
        return from_args(config, args)
    except ValueError as exc:
        raise _BadFlags(str(exc)) from None


def _plots() -> ModuleType | None:
    """:mod:`attention.experiments.plots`, or None (saying how to get it) without matplotlib."""
    try:
        return importlib.import_module("attention.experiments.plots")
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        print(f"plots skipped: matplotlib is not installed ({PLOTS_HINT})")
        return None


def _campaign(args: argparse.Namespace) -> int:
    from attention.experiments.campaign import CampaignConfig

    return _run_campaign(_config(CampaignConfig, args), args)


def _run_campaign(config: Any, args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from attention.experiments import campaign
    from attention.experiments.provenance import provenance
    from attention.experiments.train import jsonable

    if config.model != "layer":
        return _run_model_campaign(config, args)

    xp = array_module(args.backend)
    problem = campaign.backend_problem(config, xp)
    if problem:
        raise _BadFlags(problem)
    out: Path = args.out
    _make_output(out)
    print(f"campaign: {config.core} core, backend {args.backend}, {config.trials} trial(s) per "
          f"cell, {len(config.sites)} sites x {len(config.kinds)} kinds x "
          f"{len(config.patterns)} patterns x 2 modes", flush=True)
    records = campaign.run_campaign(config, xp, progress=not args.no_progress)
    prop = campaign.propagation(config, xp) if config.core == "unfused" else None
    result = {"model": "layer", "config": dataclasses.asdict(config), "backend": args.backend,
              "provenance": provenance(), "records": records}
    (out / "campaign.json").write_text(json.dumps(jsonable(result), indent=1))
    (out / "campaign.md").write_text(campaign.markdown(records, prop, config, args.backend))
    written = ["campaign.json", "campaign.md"]
    plots = _plots()
    if plots is not None:
        plots.coverage_bars(records, out / "coverage.png")
        written.append("coverage.png")
        if prop is not None:
            plots.propagation_grid(prop, out / "propagation.png")
            written.append("propagation.png")
    _drop_stale(out, "campaign", written)
    tables = [campaign.site_table(records), *campaign.not_fired_lines(records),
              campaign.clean_table(records)]
    if prop is not None:
        tables.append(campaign.propagation_table(prop))
    print(*tables, sep="\n\n")
    print(f"\nwrote {out}/" + ", ".join(written))
    return 0


def _run_model_campaign(config: Any, args: argparse.Namespace) -> int:
    """``abft campaign --model FAMILY``: fault propagation through training of a transformers
    model (:mod:`attention.experiments.hf_campaign`)."""
    import json

    from attention.experiments import hf_campaign
    from attention.experiments.train import jsonable

    _need_hf(config.model, args.backend)
    device = "cpu" if args.backend == "numpy" else "cuda"
    out: Path = args.out
    _make_output(out)
    print(f"campaign: {config.model} ({config.layers} layers), PyTorch on {device}, "
          f"{config.trials} trial(s) per (site, kind), {len(config.kinds)} kinds x 2 modes, "
          f"{config.steps} steps per run", flush=True)
    result = hf_campaign.run(config, device, progress=not args.no_progress)
    (out / "campaign.json").write_text(json.dumps(jsonable(result), indent=1))
    table = hf_campaign.markdown(result)
    (out / "campaign.md").write_text(f"# Fault propagation in training: {config.model}\n\n"
                                     f"{hf_campaign.describe(result)}\n\n{table}\n")
    _drop_stale(out, "campaign", ("campaign.json", "campaign.md"))
    print(table)
    print(f"\nwrote {out}/campaign.json, campaign.md")
    return 0


def _train(args: argparse.Namespace) -> int:
    from attention.experiments.train import TrainConfig

    return _run_train(_config(TrainConfig, args), args)


def _run_train(config: Any, args: argparse.Namespace) -> int:
    from attention.experiments import train

    if config.model != "gpt":
        _need_hf(config.model, args.backend)
    xp = array_module(args.backend)
    _make_output(args.out)
    print(f"train: backend {args.backend}, {config.steps} steps x 4 runs, fault rate "
          f"{config.fault_rate}", flush=True)
    summary = train.train(config, xp, args.out, progress=not args.no_progress)
    table = train.format_table(summary)
    (args.out / "train.md").write_text("# Training under faults\n\n" + train.describe(summary)
                                       + "\n\n" + table + "\n")
    written = ["train.json", "train.md"]
    plots = _plots()
    if plots is not None:
        plots.loss_curves(summary, args.out / "loss.png")
        written.append("loss.png")
    _drop_stale(args.out, "train", written)
    print(table)
    print(f"\nwrote {args.out}/" + ", ".join(written))
    return 0


def _drop_stale(out: Path, command: str, written: list[str] | tuple[str, ...]) -> None:
    """Remove the files of :data:`OUTPUTS` ``[command]`` under ``out`` that this run did not
    write: a previous run's (a layer campaign's propagation.png beside a fused core's campaign,
    a figure where matplotlib is now missing) would pass for this run's."""
    for name in OUTPUTS[command]:
        if name not in written:
            (out / name).unlink(missing_ok=True)


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
    from attention.experiments.campaign import CampaignConfig
    from attention.experiments.train import TrainConfig

    try:
        campaign = CampaignConfig(trials=2, clean_trials=10, seed=args.seed)
        train = TrainConfig(steps=200, checkpoint_every=20, seed=args.seed)
    except ValueError as exc:
        raise _BadFlags(str(exc)) from None
    return _run_campaign(campaign, args) or _run_train(train, args)
