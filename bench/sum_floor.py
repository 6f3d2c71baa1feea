"""How far the CPU checks' column sums are from what this machine allows: the float64 column-sum
kernel every CPU check runs (:func:`abftgemm.cpu_kernels.sum_columns`: plain, location-weighted
and absolute sums, eight rows an update) on a fused core's tile and on a projection's output,
against two ways it could go faster:

- the same sums over two threads (numba's pool), each summing half the rows with the checks'
  kernel: faster only where one thread does not already read at the bandwidth the cores share;
- each update's eight rows summed in float32 (a tree, ``3 u`` of its terms' magnitude) before
  the float64 sum: half the vector work, at the price of a threshold that must grow by that
  error (printed as the largest difference from the float64 sums, relative to ``sum |x|``).

    PYTHONPATH=. python bench/sum_floor.py [--repeats 200]

Prints the CPU, the load, and the median wall time of each form (ms; the machine otherwise
idle: the two-thread form needs both cores), with the operand in cache ("hot") and after a 64
MiB read ("memory", as the layer's checks meet a product's output). Results and their reading:
bench/NOTES.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from abftgemm.cpu_kernels import FAST, sum_columns, wide_vectors  # noqa: E402
from bench.cpu_passes import median_ms  # noqa: E402
from bench.timing import device_name  # noqa: E402

#: (name, rows, columns): a fused tile, a projection's output, the fused input projection's.
SHAPES = (("fused tile", 128, 128), ("projection (1024, 512)", 1024, 512),
          ("input projection (1024, 1536)", 1024, 1536))


@numba.njit(fastmath=FAST)
def float64_sums(x: Any, w: Any, out: Any) -> None:
    """``out`` (3, cols) = the column sums of ``x`` as the checks take them (float64)."""
    out[:] = 0.0
    sum_columns(x, w, 0, x.shape[0], out)


@numba.njit(parallel=True, fastmath=FAST)
def two_thread_sums(x: Any, w: Any, out: Any) -> None:
    """:func:`float64_sums` with the rows split in two halves, one a thread, each summed by the
    checks' kernel into its own partial sums, added after."""
    parts = np.zeros((2,) + out.shape)
    m = x.shape[0]
    for t in numba.prange(2):
        sum_columns(x, w, t * m // 2, (t + 1) * m // 2, parts[t])
    out[:] = parts[0] + parts[1]


@numba.njit(fastmath={"contract"})
def float32_tree_sums(x: Any, w: Any, out: Any) -> None:
    """:func:`float64_sums` with each eight rows summed in float32 (a balanced tree, in this
    order: no reassociation) before the float64 sum; rows beyond a multiple of eight in
    float64. 512-bit vectors where the CPU has them (:func:`wide_vectors`)."""
    wide_vectors()
    out[:] = 0.0
    p0, p1, p2 = out[0], out[1], out[2]
    m = x.shape[0] - x.shape[0] % 8
    for i in range(0, m, 8):
        r0, r1, r2, r3 = x[i], x[i + 1], x[i + 2], x[i + 3]
        r4, r5, r6, r7 = x[i + 4], x[i + 5], x[i + 6], x[i + 7]
        w0, w1, w2, w3 = (np.float32(w[i]), np.float32(w[i + 1]), np.float32(w[i + 2]),
                          np.float32(w[i + 3]))
        w4, w5, w6, w7 = (np.float32(w[i + 4]), np.float32(w[i + 5]), np.float32(w[i + 6]),
                          np.float32(w[i + 7]))
        for j in range(x.shape[1]):
            v0, v1, v2, v3 = r0[j], r1[j], r2[j], r3[j]
            v4, v5, v6, v7 = r4[j], r5[j], r6[j], r7[j]
            p0[j] += np.float64(((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)))
            p1[j] += np.float64(((w0 * v0 + w1 * v1) + (w2 * v2 + w3 * v3))
                                + ((w4 * v4 + w5 * v5) + (w6 * v6 + w7 * v7)))
            p2[j] += np.float64(((abs(v0) + abs(v1)) + (abs(v2) + abs(v3)))
                                + ((abs(v4) + abs(v5)) + (abs(v6) + abs(v7))))
    for i in range(m, x.shape[0]):
        for j in range(x.shape[1]):
            v = np.float64(x[i, j])
            p0[j] += v
            p1[j] += w[i] * v
            p2[j] += abs(v)


#: The forms timed, in the order printed.
FORMS: dict[str, Callable[[Any, Any, Any], None]] = {
    "float64 (the checks)": float64_sums, "float64, two threads": two_thread_sums,
    "float32 eight-row trees": float32_tree_sums}


def relative_error(x: np.ndarray, got: np.ndarray) -> float:
    """The largest difference of ``got`` from NumPy's float64 sums of ``x`` (plain, weighted,
    absolute), relative to the column's ``sum |x|``."""
    x64 = x.astype(np.float64)
    w = np.arange(1, x.shape[0] + 1) / x.shape[0]
    want = np.stack([x64.sum(0), w @ x64, np.abs(x64).sum(0)])
    return float((np.abs(got - want) / np.abs(x64).sum(0)).max())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    print(f"{device_name()}, load {os.getloadavg()}; median wall ms of {args.repeats} "
          f"(numba threads: {numba.get_num_threads()})")
    rng = np.random.default_rng(0)
    flush = np.ones(64 * 1024 * 1024 // 8)  # read between calls: the operand in memory
    print(f"{'':28s} {'hot':>8s} {'memory':>8s}")
    for label, rows, cols in SHAPES:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        w = np.arange(1, rows + 1) / rows
        out = np.empty((3, cols))
        print(f"{label}, float32 {rows} x {cols}:")
        for name, form in FORMS.items():
            hot, cold = (median_ms(lambda form=form: form(x, w, out), args.repeats, before)
                         for before in (lambda: None, flush.sum))
            print(f"  {name:26s} {hot:8.4f} {cold:8.4f}   error {relative_error(x, out):.1e} "
                  "of sum |x|")


if __name__ == "__main__":
    main()
