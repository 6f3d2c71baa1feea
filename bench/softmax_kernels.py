"""Time the CPU softmax kernels of the attention core on their own, against NumPy's plain math.

Usage::

    python bench/softmax_kernels.py [--repeats 15]

For the scores of the attention benchmark's CPU shapes (``(batch*heads, seq, seq)`` float32,
causal): the forward kernel (``attention._cpu_softmax.forward``: row checksums of the scores,
masked softmax, with and without its invariant check) against a NumPy softmax (max, ``exp``,
sum, divide; no mask, no checksums), and the backward kernel (``dS = P (dP - r)``, dP's row
checksums, with and without its check) against NumPy's ``P * (dP - sum(P dP))``; with the check
each kernel also makes the column encodings of its output and of its transpose, as the layer
asks. Best of ``repeats`` (ms): the kernels' own cost, without the GEMMs around them. Results:
bench/NOTES.md.
"""
from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``attention`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from abftgemm.checksums import smallest_normal
from attention import _cpu_softmax
from attention._cpu_softmax import BackwardCheck, ForwardCheck, Masks, Observe
from attention.softmax import LOG_CHECK_FLOOR, backward_tolerance


def encodings(rows: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Buffers for the encodings the checked kernels make on their write (as the layer uses)."""
    return np.zeros((3, rows, seq)), np.zeros((3, rows, seq))  # field-major (abftgemm.checksums)

#: (batch*heads, seq) of bench/attention.py's CPU cases
SHAPES = {"small": (16, 128), "medium": (16, 256)}


def best_ms(fn: object, repeats: int) -> float:
    fn()  # compile or load, and warm the caches
    return min(timeit.repeat(fn, number=1, repeat=repeats)) * 1e3


def forward_times(rows: int, seq: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    scores = (rng.standard_normal((rows, seq, seq)) * 8).astype(np.float32)
    probs, stats, errors = np.empty_like(scores), np.zeros((rows, seq, 5)), np.zeros(3)
    scale = np.float32(0.125)
    masks, observe = Masks(None, None, True, 1), Observe(stats, None)

    def kernel(check: bool) -> object:
        checked = ForwardCheck(LOG_CHECK_FLOOR, smallest_normal(probs.dtype), errors,
                               *encodings(rows, seq)) if check else None
        return lambda: _cpu_softmax.forward(scores, scale, probs, masks, observe, checked)

    def plain() -> None:
        z = scores * scale
        z -= z.max(axis=-1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=-1, keepdims=True)

    return {"kernel": best_ms(kernel(False), repeats),
            "kernel+check": best_ms(kernel(True), repeats), "numpy": best_ms(plain, repeats)}


def backward_times(rows: int, seq: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    dp = rng.standard_normal((rows, seq, seq)).astype(np.float32)
    p = np.tril(rng.random((rows, seq, seq))).astype(np.float32)  # causal, as the forward
    p /= p.sum(axis=-1, keepdims=True)
    ds, stats, result = np.empty_like(dp), np.zeros((rows, seq, 5)), np.array([-1.0, 0, 0])
    u, tiny = backward_tolerance(np.dtype(np.float32), seq)

    def kernel(check: bool) -> object:
        scale = np.float32(0.125 if check else 1.0)
        checked = BackwardCheck(u, tiny, result, *encodings(rows, seq)) if check else None
        return lambda: _cpu_softmax.backward(dp, p, scale, True, ds, Observe(stats, None),
                                             checked, None)

    def plain() -> None:
        np.multiply(p, dp - (p * dp).sum(axis=-1, keepdims=True), out=ds)

    return {"kernel": best_ms(kernel(False), repeats),
            "kernel+check": best_ms(kernel(True), repeats), "numpy": best_ms(plain, repeats)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print(f"{'case':8s} {'step':9s} {'kernel':>8s} {'+check':>8s} {'numpy':>8s}  (ms, best of "
          f"{args.repeats})")
    for name, (rows, seq) in SHAPES.items():
        for step, times in (("forward", forward_times(rows, seq, args.repeats)),
                            ("backward", backward_times(rows, seq, args.repeats))):
            print(f"{name:8s} {step:9s} {times['kernel']:8.3f} {times['kernel+check']:8.3f} "
                  f"{times['numpy']:8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
