"""The fused core's checks on the CPU as one thread's work: ``fused_forward`` + ``fused_backward``
(float32, no final checks) with ``check="correct"`` and ``check="off"``, alternated, the CPU time
of each call (``time.process_time``, which load from other processes inflates far less than wall
time), the medians and their ratio. Run it in two checkouts, one after the other and again, to
compare commits on a machine whose wall times drift.

    NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        PYTHONPATH=. python bench/fused_cpu_time.py [--label NAME] [--rounds 7]

Cases: (8, 4, 128, 64) not causal (the tiny Hugging Face models' attention: one tile a head)
and (1, 8, 1024, 64) causal.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention.context import Context  # noqa: E402
from attention.fused import fused_backward, fused_forward  # noqa: E402

CASES = (((8, 4, 128, 64), False), ((1, 8, 1024, 64), True))


def _call(shape: tuple[int, int, int, int], causal: bool) -> Callable[[str], Any]:
    batch, heads, seq, d = shape
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((batch * heads, seq, d)).astype(np.float32)
                   for _ in range(4))

    def run(check: str) -> Any:
        ctx = Context(check=check)
        _, saved = fused_forward(q, k, v, ctx, causal=causal)
        return fused_backward(saved, do, ctx)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    parts = []
    for shape, causal in CASES:
        run = _call(shape, causal)
        times: dict[str, list[float]] = {"correct": [], "off": []}
        for check in times:  # compile and warm up
            run(check)
        for _ in range(args.rounds):
            for check, seen in times.items():
                start = time.process_time()
                run(check)
                seen.append(time.process_time() - start)
        on, off = (float(np.median(times[c])) * 1e3 for c in ("correct", "off"))
        parts.append(f"{shape} causal={causal}: checked {on:.1f} ms, off {off:.1f} ms, "
                     f"ratio {on / off:.2f}")
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(args.label, " | ".join(parts), f"| load {load}")


if __name__ == "__main__":
    main()
