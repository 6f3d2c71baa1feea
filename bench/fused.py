"""The fused protected attention core on the CPU, fwd+bwd, float32, causal (or not), in one run:

- ``fused``: :mod:`attention.fused` with its checks (``check="correct"``);
- ``fused_off``: the same core, ``check="off"``;
- ``core_fused`` and ``core_fused_off``: the same core as the layers and PyTorch modules run it,
  :func:`attention.core.core_forward` and ``core_backward`` (``core="fused"``), which add the
  final checks of O, dV and dK and the finiteness scans, checked and ``check="off"``;
- ``core``: the unfused protected :mod:`attention.core`;
- ``torch_sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (CPU, causal) forward and
  ``backward``, with PyTorch's own threads.

The library's cases each keep a workspace from call to call, as the layer and the PyTorch modules
keep theirs (scratch arrays and recycled outputs: :class:`attention.workspace.Workspace`).

``fused`` and ``fused_off`` are timed in interleaved rounds of their own (``bench.timing.
time_many``), then ``core_fused`` and ``core_fused_off`` likewise, then ``core`` and
``torch_sdpa`` each in a block of rounds of its own: in one set
of rounds with them, the fused core ran 1.2-2x slower right after the unfused core (whose
products run on OpenBLAS's threads, which keep spinning) or PyTorch, so its times measured what
ran before it (bench/NOTES.md). Prints the medians and the ratios to ``fused_off`` and to
``torch_sdpa``, with the CPU and the load. ``--cpu-time`` runs PyTorch and
the library on one thread (``abftgemm.set_threads(1)``: the fused core's numba pool too) and
times that thread's CPU time (``time.thread_time``), which other load on the machine inflates far
less than wall time: run it in two checkouts, one after the other and again, to compare commits.

    PYTHONPATH=. python bench/fused.py [--shapes 1x8x1024x64,1x8x4096x64] [--repeats 5]
                                       [--no-causal] [--cpu-time]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import abftgemm  # noqa: E402
from attention._cpu_fused import BR  # noqa: E402
from attention._cpu_tile_gemm import gemm_rows  # noqa: E402
from attention.context import Context  # noqa: E402
from attention.core import core_backward, core_forward  # noqa: E402
from attention.fused import fused_backward, fused_forward  # noqa: E402
from attention.workspace import Workspace  # noqa: E402
from bench.timing import device_name, time_many  # noqa: E402


def _cases(batch: int, heads: int, seq: int, d: int, causal: bool
           ) -> dict[str, Callable[[], Any]]:
    rng = np.random.default_rng(0)
    n = batch * heads
    q, k, v, do = (rng.standard_normal((n, seq, d)).astype(np.float32) for _ in range(4))

    def fused(check: str) -> Callable[[], Any]:
        ws = Workspace()

        def run() -> Any:
            ctx = Context(check=check)
            _, saved = fused_forward(q, k, v, ctx, causal=causal, workspace=ws)
            return fused_backward(saved, do, ctx, ws)
        return run

    def core_fused(check: str) -> Callable[[], Any]:
        ws = Workspace()

        def run() -> Any:
            ctx = Context(check=check)
            _, saved = core_forward(q, k, v, ctx, causal=causal, core="fused", workspace=ws)
            return core_backward(saved, do, ctx, workspace=ws)
        return run

    core_ws = Workspace()

    def core() -> Any:
        ctx = Context()
        _, saved = core_forward(q, k, v, ctx, causal=causal, core="unfused", workspace=core_ws)
        return core_backward(saved, do, ctx, workspace=core_ws)

    cases = {"fused": fused("correct"), "fused_off": fused("off"),
             "core_fused": core_fused("correct"), "core_fused_off": core_fused("off"),
             "core": core}
    try:
        import torch
    except ImportError:
        return cases
    tq, tk, tv = (torch.from_numpy(x.reshape(batch, heads, seq, d)).requires_grad_()
                  for x in (q, k, v))
    tdo = torch.from_numpy(do.reshape(batch, heads, seq, d))

    def sdpa() -> Any:
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        return torch.autograd.grad(out, (tq, tk, tv), tdo)

    cases["torch_sdpa"] = sdpa
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x8x1024x64,1x8x4096x64",
                        help="comma-separated batch x heads x seq x head_dim")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time (time.thread_time)")
    args = parser.parse_args()
    clock = time.perf_counter
    if args.cpu_time:
        abftgemm.set_threads(1)
        clock = time.thread_time
        try:
            import torch
            torch.set_num_threads(1)
        except ImportError:
            pass
    print(f"device: {device_name()}; load average: {os.getloadavg()}")
    kind = ("causal" if args.causal else "not causal") + (", one thread's CPU time"
                                                           if args.cpu_time else "")
    for shape in args.shapes.split(","):
        b, h, s, d = (int(x) for x in shape.split("x"))
        cases = _cases(b, h, s, d, args.causal)
        blocks = [("fused", "fused_off"), ("core_fused", "core_fused_off")] + [
            (name,) for name in cases if "fused" not in name]
        times = {}
        for block in blocks:
            times.update(time_many({name: cases[name] for name in block}, args.repeats,
                                   warmup=1, gpu=False, clock=clock))
        print(f"\n({b}, {h}, {s}, {d}) fp32 {kind} fwd+bwd, median ms of {args.repeats} "
              f"(tile products: {gemm_rows(np.dtype(np.float32), d, BR)} rows per BLAS call):")
        for name, ms in times.items():
            line = f"  {name:14s} {ms:9.1f} ms   x{ms / times['fused_off']:.2f} vs fused_off"
            if "torch_sdpa" in times:
                line += f"   x{ms / times['torch_sdpa']:.2f} vs torch_sdpa"
            print(line)
        print(f"  core_fused / core_fused_off: x{times['core_fused'] / times['core_fused_off']:.2f}")
        print(f"  load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
