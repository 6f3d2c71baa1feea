"""The fused attention core called from the main thread and from another Python thread (a web
server's worker, a thread pool), fwd+bwd, side by side in one run.

Usage::

    PYTHONPATH=. python bench/other_thread.py [--shape 8x1024x64] [--repeats 7]

Each round times one call from the main thread, then one from a new thread; the medians and
their ratio are printed with the CPU and the load. Before the library set its BLAS thread count
from any thread (threadpoolctl ignores all but the first thread to set it), the other thread's
calls ran the tile products' BLAS at the full count inside numba's pool (bench/NOTES.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention.context import Context  # noqa: E402
from attention.fused import fused_backward, fused_forward  # noqa: E402
from bench.timing import device_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8x1024x64", help="heads x length x head dim")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    n, length, d = (int(x) for x in args.shape.split("x"))
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((n, length, d)).astype(np.float32) for _ in range(4))

    def call() -> float:
        start = time.perf_counter()
        ctx = Context()
        out, saved = fused_forward(q, k, v, ctx, causal=True)
        fused_backward(saved, do, ctx)
        return time.perf_counter() - start

    def in_thread() -> float:
        result: list[float] = []
        worker = threading.Thread(target=lambda: result.append(call()))
        worker.start()
        worker.join()
        return result[0]

    call()
    in_thread()  # compile and warm both
    times: dict[str, list[float]] = {"main thread": [], "other thread": []}
    for _ in range(args.repeats):
        times["main thread"].append(call())
        times["other thread"].append(in_thread())
    med = {k: statistics.median(v) for k, v in times.items()}
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{device_name(np)}, load {load}; fused fwd+bwd, causal, float32, ({n}, {length}, {d}), "
          f"median of {args.repeats}:")
    print(", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in med.items())
          + f"; other / main {med['other thread'] / med['main thread']:.2f}")


if __name__ == "__main__":
    main()
