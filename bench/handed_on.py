"""Time a planned product that encodes its own ``a`` against one given ``a``'s encoding.

Usage::

    python bench/handed_on.py [--repeats 21]

A planned product predicts its column checksums from the column encoding of ``a``: made from
``a`` (one read of it), or handed on by an earlier product as ``a_checksums``, the way the
attention layer passes encodings between its sites, in the one layout every producer writes
(``(3, batch, k)``, field-major, :mod:`abftgemm.checksums`), read in place. Cases are the CPU attention layer's projections at its
medium shape: ``b`` read as given (``x @ W``) and ``b`` the transpose of a C-contiguous array (a
weight in PyTorch's layout; the layer's ``d_context`` and ``d_x``, which multiplies
``[dQ dK dV]`` by the stacked weights). Medians of interleaved rounds (ms): the plain
``np.matmul``, and execute + settle of the plan either way. Results: bench/NOTES.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``abftgemm`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from abftgemm import Checksums, ProtectedMatmul
from bench import timing

#: name: (m, k, n, b transposed)
CASES = {"proj": (512, 512, 512, False), "proj-bT": (512, 512, 512, True),
         "d_x-bT": (512, 1536, 512, True)}


def time_case(m: int, k: int, n: int, b_transposed: bool, repeats: int) -> dict[str, float]:
    """Median ms of the plain product, the plan encoding ``a``, the plan given its encoding."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = (rng.standard_normal((n, k), dtype=np.float32).T if b_transposed
         else rng.standard_normal((k, n), dtype=np.float32))
    out = np.empty((m, n), np.float32)
    encoded = ProtectedMatmul(a, b)
    encoded.execute(a, b, out=out)
    handed_on = Checksums(cols=encoded.a_encoding().cols.copy())  # as an earlier product made it
    encoded.settle()
    given = ProtectedMatmul(a, b)

    def run(plan: ProtectedMatmul, checksums: Checksums | None) -> None:
        plan.execute(a, b, out=out, a_checksums=checksums)
        plan.settle()

    return timing.time_many({"plain": lambda: np.matmul(a, b, out=out),
                             "encodes a": lambda: run(encoded, None),
                             "handed on": lambda: run(given, handed_on)},
                            repeats, warmup=2, gpu=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args(argv)
    print(f"{'case':8} {'m x k x n':>16} {'plain':>8} {'encodes a':>10} {'handed on':>10}  (ms)")
    for name, (m, k, n, bt) in CASES.items():
        t = time_case(m, k, n, bt, args.repeats)
        print(f"{name:8} {f'{m} x {k} x {n}':>16} {t['plain']:8.3f} {t['encodes a']:10.3f} "
              f"{t['handed on']:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
