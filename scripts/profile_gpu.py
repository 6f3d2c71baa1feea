"""Where the host time of a protected product goes on the GPU (cProfile, top functions).

Run: ``PYTHONPATH=. python scripts/profile_gpu.py``. Prints, for a 4096x1024x1024 fp16 product
and for a small attention forward+backward, the GPU time per call (CUDA events) protected vs
unprotected and the cProfile table of the protected calls sorted by own time.
"""
from __future__ import annotations

import cProfile
import pstats

import cupy
import numpy as np

import abftgemm
from attention import MultiHeadAttention


def gpu_ms(fn, n: int = 20) -> float:
    fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(n):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / n


def profile(label: str, fn, n: int = 30) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    cupy.cuda.Device().synchronize()
    prof.disable()
    print(f"--- {label}: cProfile of {n} calls, top 25 by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    rng = np.random.default_rng(0)
    a = cupy.asarray(rng.standard_normal((4096, 1024)).astype(np.float16))
    b = cupy.asarray(rng.standard_normal((1024, 1024)).astype(np.float16))
    on = lambda: abftgemm.matmul(a, b)  # noqa: E731
    off = lambda: abftgemm.matmul(a, b, check="off")  # noqa: E731
    print(f"matmul 4096x1024x1024 fp16: protected {gpu_ms(on):.3f} ms, off {gpu_ms(off):.3f} ms")
    profile("protected matmul", on)
    layer = MultiHeadAttention(1024, 16, causal=True, dtype="float16", xp=cupy)
    x = cupy.asarray(rng.standard_normal((8, 512, 1024)).astype(np.float16))

    def both(check: str):
        def run():
            layer.check = check
            y, cache = layer.forward(x)
            layer.backward(y, cache)
        return run
    print(f"attention (8,16,512,64) fp16 fwd+bwd: protected {gpu_ms(both('correct'), 5):.3f} ms, "
          f"off {gpu_ms(both('off'), 5):.3f} ms")
    profile("protected attention fwd+bwd", both("correct"), 5)


if __name__ == "__main__":
    main()
