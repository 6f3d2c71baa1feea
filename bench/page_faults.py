"""Minor page faults and CPU time of one attention core fwd+bwd through the PyTorch core
(``attention.torch_core.ProtectedCore``, which keeps a workspace), fused and unfused, against
``torch.nn.functional.scaled_dot_product_attention``; one thread.

A page fault is the first write to a page the kernel has just handed out (about 3 us per 4 KiB
page on a virtual machine), so a call that allocates its multi-megabyte outputs afresh while the
C allocator keeps returning their pages pays that on every call. Whether it does depends on what
the process allocated before, so compare a case across commits in a process of its own
(``--cases fused``, then ``--cases unfused``, ...).

    PYTHONPATH=. python bench/page_faults.py [--shape 8x4x128x64] [--calls 20] [--no-causal]
                                             [--cases fused,fused_off,unfused,torch_sdpa]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import abftgemm  # noqa: E402
from bench.timing import device_name  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _measure(run: Callable[[], Any], calls: int) -> tuple[float, float]:
    """``(page faults a call, median CPU ms a call)`` after three warm-up calls."""
    for _ in range(3):
        run()
    times = []
    before = _faults()
    for _ in range(calls):
        start = time.thread_time()
        run()
        times.append(time.thread_time() - start)
    return (_faults() - before) / calls, 1e3 * statistics.median(times)


def main() -> None:
    import torch

    from attention.torch_core import ProtectedCore

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8x4x128x64", help="batch x heads x seq x head_dim")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cases", default="fused,fused_off,unfused,torch_sdpa")
    args = parser.parse_args()
    torch.set_num_threads(1)
    abftgemm.set_threads(1)
    b, h, s, d = (int(x) for x in args.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g, requires_grad=True) for _ in range(3))
    d_out = torch.randn(b, h, s, d, generator=g)

    def protected(core: str, check: str) -> Callable[[], Any]:
        module = ProtectedCore(core=core, check=check)

        def run() -> None:
            out, _ = module(q, k, v, None, None, args.causal)
            out.backward(d_out)
        return run

    def sdpa() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        out.backward(d_out)

    known = {"fused": lambda: protected("fused", "correct"),
             "fused_off": lambda: protected("fused", "off"),
             "unfused": lambda: protected("unfused", "correct"), "torch_sdpa": lambda: sdpa}
    names = args.cases.split(",")
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {sorted(known)}")
    cases = {name: known[name]() for name in names}
    print(f"{device_name()}; ({b}, {h}, {s}, {d}) fp32 {'causal' if args.causal else 'full'} "
          f"fwd+bwd, one thread, {args.calls} calls each")
    for name, run in cases.items():
        faults, ms = _measure(run, args.calls)
        print(f"  {name:11s} {faults:8.1f} page faults a call   {ms:7.2f} ms CPU (median)")


if __name__ == "__main__":
    main()
