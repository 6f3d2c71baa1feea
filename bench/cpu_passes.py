"""Time each checksum pass of the CPU backend on its own, with the matrix in cache and in memory.

Usage::

    python bench/cpu_passes.py [--size 2048] [--dtype float32] [--repeats 21]

The protected 2048^3 product reads four matrices after its GEMM (A once, B twice, C once); this
script times those reductions one by one, so a kernel change can be judged without the GEMM's
noise. "hot": the same matrix again (it stays in the 32 MB L3). "memory": after reading a 64 MB
buffer, as after a GEMM (in the real call the passes run 0.05-0.1 ms slower still: the GEMM
leaves dirty lines to write back). Also times one plain streaming read as the
memory floor (NumPy column sums: one sequential read, vectorized across columns). Results and their history: bench/NOTES.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make ``abftgemm`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from abftgemm import _cpu


def median_ms(fn: Callable[[], object], repeats: int, before: Callable[[], object]) -> float:
    """Median time of ``fn()`` in ms, each call preceded by an untimed ``before()``."""
    fn()
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    n = args.size
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, n, n)).astype(args.dtype)
    coef = rng.standard_normal((3, 1, n))  # an encoding (3, batch, L), as B's rows are to A's
    out_col, out_row = np.empty((1, n, 5)), np.empty((1, n, 5))
    be = _cpu.backend()
    flush = np.ones(64 * 1024 * 1024 // 8)
    passes = {
        "row sums, default weights (B's encoding)": lambda: be.row_reduce(x, None, out_row),
        "row sums, coefficient vectors": lambda: be.row_reduce(x, coef, out_row),
        "column sums, coefficients (B's prediction)": lambda: be.col_reduce(x, coef, out_col),
        "both, default weights (C)": lambda: be.both_reduce(x, None, None, out_col, out_row),
        "both, row coefficients (A)": lambda: be.both_reduce(x, None, coef, out_col, out_row),
        "streaming read: NumPy column sums (floor)": lambda: x.sum(axis=1),
    }
    print(f"{n}x{n} {args.dtype}, median of {args.repeats} (ms)")
    print(f"{'pass':45s} {'hot':>7s} {'memory':>7s}")
    for name, fn in passes.items():
        hot = median_ms(fn, args.repeats, lambda: None)
        cold = median_ms(fn, args.repeats, flush.sum)
        print(f"{name:45s} {hot:7.3f} {cold:7.3f}")


if __name__ == "__main__":
    main()
