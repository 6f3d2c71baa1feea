"""The attention layer on a shared CPU: idle, and with another CPU-bound process running.

Usage::

    python bench/loaded.py [--json PATH] [--cases small,medium] [--repeats N] [--scenarios ...]

Cases ``(batch, heads, seq, head_dim)``: small (4, 4, 128, 32) and medium (2, 8, 256, 64), as in
bench/attention.py; tiny (2, 2, 32, 16) for a smoke run.

Each scenario runs in a fresh interpreter with the default environment, timing fwd+bwd of, in
interleaved rounds (so that load that comes and goes hits every column alike):

- ``numpy_protected``: :class:`attention.MultiHeadAttention` (causal, float32, ``check="correct"``),
  ``numpy_off``: the same layer with ``check="off"``;
- ``torch_protected``: :class:`attention.torch.MultiheadAttention`, ``check="correct"``;
- ``torch_stock``: ``torch.nn.MultiheadAttention`` with the same weights (causal mask);
- ``numpy_protected_blas1``, ``torch_protected_blas1``: the protected ones with NumPy's BLAS
  forced to one thread (``threadpoolctl`` around the call, as ``OPENBLAS_NUM_THREADS=1`` would).

Scenarios: ``idle`` (nothing started) and ``loaded``: one ``python -c "while True: pass"``
process started before the interpreter and stopped after. Each record names the CPU and the
machine's load (``/proc/loadavg`` before and after: other work on the machine shows there).

The issue-25 targets (benchmarks, not timed tests): in ``loaded``, ``torch_protected`` and
``numpy_protected`` within 1.3x of their ``_blas1`` runs and within 1.5x of ``torch_stock``; in
``idle``, no slower than before the thread policy (bench/NOTES.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import timing  # noqa: E402

CASES = {"small": (4, 4, 128, 32), "medium": (2, 8, 256, 64), "tiny": (2, 2, 32, 16)}
SCENARIOS = ("idle", "loaded")
BURNER = "while True: pass"


def measure(cases: list[str], repeats: int, warmup: int) -> list[dict[str, Any]]:
    """In this interpreter: median fwd+bwd ms of the four layers at each case."""
    import numpy as np
    import torch
    from threadpoolctl import ThreadpoolController

    from attention.torch import MultiheadAttention
    from bench.attention import Case

    controller = ThreadpoolController()

    def blas1(fn: Any) -> Any:
        def run() -> None:
            with controller.limit(limits=1, user_api="blas"):
                fn()
        return run

    out = []
    for name in cases:
        b, h, s, hd = CASES[name]
        d = h * hd
        case = Case(np, CASES[name], "float32")
        torch.manual_seed(0)
        stock = torch.nn.MultiheadAttention(d, h, batch_first=True)
        protected = MultiheadAttention(d, h, batch_first=True)
        protected.load_state_dict(stock.state_dict())
        x = torch.randn(b, s, d, requires_grad=True)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)

        def step(module: torch.nn.Module) -> None:
            y, _ = module(x, x, x, attn_mask=mask, need_weights=False, is_causal=True)
            y.backward(torch.ones_like(y))

        fns = {"numpy_protected": lambda: case.both("correct"),
               "numpy_off": lambda: case.both("off"),
               "torch_protected": lambda: step(protected), "torch_stock": lambda: step(stock)}
        fns.update({f"{k}_blas1": blas1(fns[k]) for k in ("numpy_protected", "torch_protected")})
        ms = timing.time_many(fns, repeats, warmup, gpu=False)
        out.append({"case": name, "shape": list(CASES[name]), "ms": ms})
    return out


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unavailable"


def run_scenario(scenario: str, cases: list[str], repeats: int) -> dict[str, Any]:
    """One scenario in a fresh interpreter (and the burner process when loaded)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    burner = subprocess.Popen([sys.executable, "-c", BURNER]) if scenario.startswith("loaded") \
        else None
    try:
        before = _loadavg()
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                               "--cases", ",".join(cases), "--repeats", str(repeats)],
                              env=env, capture_output=True, text=True, check=False)
        after = _loadavg()
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    if done.returncode:
        raise SystemExit(f"{scenario}: the worker failed:\n{done.stderr}")
    return {"scenario": scenario, "loadavg_before": before, "loadavg_after": after,
            "load": ("one 'python -c \"while True: pass\"' process" if burner is not None
                     else "none started"),
            "records": json.loads(done.stdout.strip().splitlines()[-1])}


def summary(results: list[dict[str, Any]]) -> str:
    """Text table: ms per layer and scenario, and the ratios the targets name."""
    lines = []
    for r in results:
        for rec in r["records"]:
            ms = rec["ms"]
            cells = "  ".join(f"{k} {v:.2f}" for k, v in ms.items())
            ratios = ", ".join(
                [f"{k}/stock {ms[k] / ms['torch_stock']:.2f}" for k in ("torch_protected",
                                                                        "numpy_protected")]
                + [f"{k}/blas1 {ms[k] / ms[k + '_blas1']:.2f}" for k in ("torch_protected",
                                                                        "numpy_protected")])
            lines.append(f"{r['scenario']:7s} {rec['case']:7s} {cells}\n{'':16s}{ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="results file to write")
    parser.add_argument("--cases", default="small,medium")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - CASES.keys())
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {sorted(CASES)}")
    if args.worker:
        print(json.dumps(measure(cases, args.repeats, warmup=2)))
        return 0
    scenarios = args.scenarios.split(",")
    bad = sorted(set(scenarios) - set(SCENARIOS))
    if bad:
        parser.error(f"unknown scenario(s) {bad}; known: {list(SCENARIOS)}")
    results = []
    for scenario in scenarios:
        results.append(run_scenario(scenario, cases, args.repeats))
        print(summary(results[-1:]), flush=True)
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"device": timing.device_name(), "date": timing.now(),
                                        "scenarios": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
