"""Measure how close clean rounding error comes to the detection threshold (must stay below 1).

For adversarial clean inputs (all-positive, identical rows, badly scaled rows/columns, mixed signs,
long k) it prints, per dtype, the largest ratio |predicted - observed| / threshold over every row
and column checksum. Run: ``python scripts/calibrate_thresholds.py [--backend cupy]``.
"""
from __future__ import annotations

import argparse

import numpy as np

import abftgemm
from abftgemm.checksums import SUPPORTED_DTYPES


def cases(rng: np.random.Generator, m: int, k: int, n: int, big: float):
    """Named clean operand pairs in float64 (cast to the dtype under test by the caller).

    ``big`` is the largest magnitude the product may reach without overflowing the dtype.
    """
    yield "normal", rng.standard_normal((m, k)), rng.standard_normal((k, n))
    yield "positive", rng.random((m, k)), rng.random((k, n))
    yield "identical rows", np.tile(rng.random((1, k)), (m, 1)), rng.random((k, n))
    yield "constant", np.full((m, k), 0.1), np.full((k, n), 0.3)
    yield "constant small", np.full((m, k), 0.01), np.full((k, n), 0.013)
    e = 3 if big > 1e30 else 1  # decades of scaling the dtype can hold without overflow
    scale_r = 10.0 ** rng.integers(-e, e + 1, size=(m, 1))
    scale_c = 10.0 ** rng.integers(-e, e + 1, size=(1, n))
    yield "scaled rows/cols", rng.standard_normal((m, k)) * scale_r, rng.standard_normal((k, n)) * scale_c
    s = min(1e3, np.sqrt(big / (16 * k)))
    yield "large", rng.standard_normal((m, k)) * s, rng.random((k, n)) * s


def _largest(dtype) -> float:
    import ml_dtypes
    return float(ml_dtypes.finfo(dtype).max)


def worst_ratio(xp, dtype, a64, b64) -> float:
    a, b = xp.asarray(a64.astype(dtype)), xp.asarray(b64.astype(dtype))
    result = abftgemm.verify(abftgemm.matmul(a, b, check="off"), a, b)
    assert result.clean, f"false positive: {result.report.summary()}"
    return result.worst_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    args = parser.parse_args()
    xp = __import__(args.backend)
    rng = np.random.default_rng(0)
    shapes = [(64, 64, 64), (64, 192, 64), (64, 256, 64), (256, 1024, 256), (128, 8192, 128),
              (2048, 64, 512)]
    print(f"{'dtype':10s} {'case':18s} {'m,k,n':>16s} {'max |d|/tau':>12s}")
    for dtype in SUPPORTED_DTYPES:
        worst = 0.0
        for m, k, n in shapes:
            for label, a64, b64 in cases(rng, m, k, n, _largest(dtype)):
                r = worst_ratio(xp, dtype, a64, b64)
                worst = max(worst, r)
                print(f"{str(dtype):10s} {label:18s} {f'{m},{k},{n}':>16s} {r:12.3g}")
        print(f"{str(dtype):10s} {'WORST':18s} {'':16s} {worst:12.3g}")


if __name__ == "__main__":
    main()
