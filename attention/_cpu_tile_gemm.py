"""How many of ``c``'s rows the fused core's tile products take per BLAS call on the CPU
(:func:`abftgemm.cpu_kernels.blas_gemm`: ``c = op(a) @ op(b) + beta c`` on strided views, in
place, in pieces of ``c``'s rows). Some BLAS builds run small products on faster kernels than
larger ones (OpenBLAS's AVX-512 kernels, for ``m n k`` up to 10^6: a 128 x 128 x 64 float32
product in two pieces of 64 rows takes two thirds of the time of one call), others run the pieces
slower; the rows per call are measured once per process, dtype and head dimension
(:func:`gemm_rows`). A piece's elements are the same dot products as the whole product's, summed
over the same inner length.
"""
from __future__ import annotations

import functools
import time
from typing import Any

import numba
import numpy as np

from abftgemm.cpu_kernels import blas_gemm
from abftgemm.threads import one_blas_thread

#: A piece must beat one whole call by this factor to be taken (the two are within the timing's
#: noise otherwise, and one call is the plain choice).
_MARGIN = 0.9


@numba.njit(cache=True)
def _time_products(rows: int, calls: int, q: Any, kt: Any, s: Any, v: Any, o: Any) -> None:
    """``calls`` rounds of a tile's three kinds of products (``S = Q K^T``, ``O += P V``,
    ``dV += P^T dO``) in pieces of ``rows`` rows."""
    for _ in range(calls):
        blas_gemm(q, kt, s, 0.0, False, False, rows)
        blas_gemm(s, v, o, 1.0, False, False, rows)
        blas_gemm(s, v, o, 1.0, True, False, rows)


@functools.cache
def gemm_rows(dtype: np.dtype, d: int, tile: int) -> int:
    """The rows of ``c`` per BLAS call that run a ``tile x tile`` tile's products (head dimension
    ``d``, ``dtype`` float32 or float64) fastest here, single-threaded: ``tile``, or half or a
    quarter of it where that takes at most :data:`_MARGIN` of one call's time (each measured
    three times, alternately, the best taken). Measured once per process and arguments (a few
    milliseconds)."""
    rng = np.random.default_rng(0)
    q, v = (rng.standard_normal((tile, d)).astype(dtype) for _ in range(2))
    kt = rng.standard_normal((d, tile)).astype(dtype)
    s, o = np.empty((tile, tile), dtype), np.zeros((tile, d), dtype)
    choices = [r for r in (tile, tile // 2, tile // 4) if r >= 16] or [tile]
    best = dict.fromkeys(choices, np.inf)
    with one_blas_thread():
        _time_products(tile, 2, q, kt, s, v, o)  # compiled and warm
        for _ in range(3):
            for r in choices:
                start = time.perf_counter()
                _time_products(r, 8, q, kt, s, v, o)
                best[r] = min(best[r], time.perf_counter() - start)
    fastest = min(best, key=best.get)
    return fastest if best[fastest] <= _MARGIN * best[tile] else tile
