"""What skipping the zero blocks of causal attention's ``P`` and ``dS`` saves on the CPU.

Usage::

    python bench/causal_triangles.py [--repeats N] [--cases small,medium,long]

A causal layer's ``P`` and ``dS`` are lower triangular (their transposes upper), and the pass
tables mark the four products that read them as ``a`` (``Step.a_triangle``): ``P V``, ``dS K``,
``P^T dC`` and ``dS^T Q`` multiply only the row blocks' columns their triangle can hold
(:func:`abftgemm._cpu_triangles.triangular_matmul`). Only the lower triangle of the scores and of
``dP`` is read (``Step.out_triangle``): their row blocks are computed up to their last column
(:func:`abftgemm._cpu_triangles.lower_product`). This script times, interleaved in one process:

- ``pair``: one lower and one upper product of the case's ``(batch*heads, seq, seq) x (..., seq,
  head_dim)`` shape, whole and triangular;
- ``scores``: the ``(batch*heads, seq, head_dim) x (..., head_dim, seq)`` product, whole and
  lower;
- ``layer``: the causal layer's forward + backward, protected and ``check="off"``, with the
  table as it is and with the six promises removed (every product whole).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from abftgemm._cpu_triangles import lower_product, triangular_matmul  # noqa: E402
from attention import MultiHeadAttention  # noqa: E402
from attention import passes  # noqa: E402
from bench import timing  # noqa: E402

CASES = {"small": (4, 4, 128, 32), "medium": (2, 8, 256, 64), "long": (1, 8, 1024, 64)}


def pair_times(shape: tuple[int, int, int, int], repeats: int) -> dict[str, float]:
    b, h, s, hd = shape
    rng = np.random.default_rng(0)
    p = np.tril(rng.random((b * h, s, s), dtype=np.float32))
    v = rng.random((b * h, s, hd), dtype=np.float32)
    out = np.empty_like(v)

    def pair(triangles: bool) -> None:
        triangular_matmul(p, v, out, "lower" if triangles else None)
        triangular_matmul(p.transpose(0, 2, 1), v, out, "upper" if triangles else None)

    q = rng.random((b * h, s, hd), dtype=np.float32)
    k_t = rng.random((b * h, s, hd), dtype=np.float32).transpose(0, 2, 1)
    scores = np.empty_like(p)
    return timing.time_many({"whole": lambda: pair(False), "triangular": lambda: pair(True),
                             "scores whole": lambda: np.matmul(q, k_t, out=scores),
                             "scores lower": lambda: lower_product(q, k_t, scores)},
                            repeats, 2, gpu=False)


def layer_times(shape: tuple[int, int, int, int], repeats: int) -> dict[str, float]:
    b, h, s, hd = shape
    layer = MultiHeadAttention(h * hd, h, causal=True, dtype="float32", seed=0, core="unfused")
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal((b, s, h * hd)).astype(np.float32) for _ in range(2))
    table = (passes.FORWARD, passes.BACKWARD)
    whole = tuple(tuple(dataclasses.replace(s, a_triangle=None, out_triangle=None) for s in t)
                  for t in table)

    def step(check: str, tables: tuple) -> None:
        passes.FORWARD, passes.BACKWARD = tables
        layer.check = check
        _, cache = layer.forward(x)
        layer.backward(dy, cache)

    try:
        return timing.time_many(
            {f"{check} {name}": (lambda c=check, r=routes: step(c, r))
             for check in ("correct", "off") for name, routes in (("triangular", table),
                                                                   ("whole", whole))},
            repeats, 2, gpu=False)
    finally:
        passes.FORWARD, passes.BACKWARD = table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", default="small,medium,long")
    args = parser.parse_args(argv)
    print(f"{timing.device_name(np)}; medians of {args.repeats} (ms)")
    for name in args.cases.split(","):
        shape = CASES[name]
        pair = pair_times(shape, args.repeats)
        layer = layer_times(shape, max(3, args.repeats // (4 if name == "long" else 1)))
        print(f"{name:7s} {str(shape):17s} pair: whole {pair['whole']:.3f} triangular "
              f"{pair['triangular']:.3f} | scores: whole {pair['scores whole']:.3f} lower "
              f"{pair['scores lower']:.3f} | layer protected: whole {layer['correct whole']:.2f} "
              f"triangular {layer['correct triangular']:.2f} | off: whole {layer['off whole']:.2f}"
              f" triangular {layer['off triangular']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
