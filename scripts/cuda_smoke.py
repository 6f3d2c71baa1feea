"""Quick GPU check of :mod:`abftgemm._cuda` against plain CuPy float64 arithmetic.

Run from the repository root on a GPU machine: ``python scripts/cuda_smoke.py``. Prints one
PASS/FAIL line per case and exits 1 if any case failed. bfloat16 data is moved and widened through
its bits, so the reference needs no CuPy bfloat16 arithmetic.
"""
from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import cupy
import ml_dtypes
import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from abftgemm import _cuda  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32", "float64")
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
UINT = {2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}
RNG = numpy.random.default_rng(1234)
# Reductions accumulate in float64 in another order than the reference: allow for that only.
REDUCE_TOL = {"rtol": 1e-12, "atol": 1e-6, "equal_nan": True}


def host_dtype(name: str) -> numpy.dtype:
    """The NumPy dtype called ``name`` (bfloat16 from ml_dtypes)."""
    return numpy.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)


def to_device(host: numpy.ndarray, dtype: str) -> cupy.ndarray:
    """Round ``host`` to ``dtype`` on the host and upload the bits."""
    h = numpy.ascontiguousarray(host.astype(host_dtype(dtype)))
    return cupy.asarray(h.view(UINT[h.itemsize])).view(h.dtype)


def widen(x: cupy.ndarray) -> cupy.ndarray:
    """Exact float64 copy of ``x`` (bfloat16 widened through its bits)."""
    if x.dtype.name == "bfloat16":
        bits = x.view(cupy.uint16).astype(cupy.uint32) << 16
        return bits.view(cupy.float32).astype(cupy.float64)
    return x.astype(cupy.float64)


def integers(*shape: int) -> numpy.ndarray:
    """Small integers: every dtype holds them exactly and fp32 accumulates them exactly."""
    return RNG.integers(-4, 5, size=shape).astype(numpy.float64)


def layouts(host: numpy.ndarray, dtype: str) -> Iterator[tuple[str, cupy.ndarray]]:
    """The same matrices (batch, r, c) in every layout the backend distinguishes."""
    nb, r, c = host.shape
    yield "C", to_device(host, dtype)
    yield "T", to_device(host.transpose(0, 2, 1).copy(), dtype).transpose(0, 2, 1)
    padded = numpy.zeros((nb, r, c + 3))
    padded[:, :, 1:c + 1] = host
    yield "pitch+offset", to_device(padded, dtype)[:, :, 1:c + 1]
    yield "reversed(copy)", to_device(host[:, ::-1].copy(), dtype)[:, ::-1]


# ------------------------------------------------------------------------------------- gemm


def check_gemm(a: cupy.ndarray, b: cupy.ndarray, bias: cupy.ndarray | None, dtype: str) -> str:
    """'' when backend gemm matches float64 cupy.matmul within output rounding, else why not."""
    batch = max(a.shape[0], b.shape[0])
    out = cupy.empty((batch, a.shape[1], b.shape[2]), dtype=a.dtype)
    _cuda.backend().gemm(a, b, out, bias)
    a64, b64 = widen(a), widen(b)
    ref = cupy.matmul(a64, b64)
    scale = cupy.matmul(cupy.abs(a64), cupy.abs(b64))
    if bias is not None:
        ref += widen(bias)
        scale += cupy.abs(widen(bias))
    err = cupy.abs(widen(out) - ref) - 2 * EPS[dtype] * scale
    worst = float(err.max())
    return "" if worst <= 0 else f"error exceeds rounding by {worst:g}"


def gemm_cases() -> Iterator[tuple[str, Callable[[], str]]]:
    """(name, check) for every dtype, layout pair, broadcast and bias."""
    for dtype in DTYPES:
        for m, k, n in ((33, 40, 17), (128, 256, 96), (1, 7, 1)):
            ha, hb = integers(3, m, k), integers(3, k, n)
            for la, a in layouts(ha, dtype):
                for lb, b in layouts(hb, dtype):
                    yield (f"gemm {dtype} {m}x{k}x{n} a={la} b={lb}",
                           lambda a=a, b=b, d=dtype: check_gemm(a, b, None, d))
            bias = to_device(integers(n), dtype)
            a, b = to_device(ha, dtype), to_device(hb, dtype)
            yield (f"gemm {dtype} {m}x{k}x{n} bias",
                   lambda a=a, b=b, bias=bias, d=dtype: check_gemm(a, b, bias, d))
            yield (f"gemm {dtype} {m}x{k}x{n} broadcast a",
                   lambda a=a[:1], b=b, d=dtype: check_gemm(a, b, None, d))
            yield (f"gemm {dtype} {m}x{k}x{n} broadcast b + bias",
                   lambda a=a, b=b[:1], bias=bias, d=dtype: check_gemm(a, b, bias, d))
            b_t = dict(layouts(hb[:1], dtype))["T"]
            yield (f"gemm {dtype} {m}x{k}x{n} transposed broadcast b",
                   lambda a=a, b=b_t, d=dtype: check_gemm(a, b, None, d))


# ------------------------------------------------------------------------------- reductions


def reference_reduce(x: cupy.ndarray, coef: cupy.ndarray | None, batch: int, rows: bool):
    """The five fields per vector with plain cupy float64 ops; shape (batch, vectors, 5)."""
    v = widen(x)
    v = v if rows else v.transpose(0, 2, 1)  # vectors along the last axis
    v = cupy.broadcast_to(v, (batch,) + v.shape[1:])
    length = v.shape[2]
    if coef is None:
        c0 = c2 = cupy.ones(length)
        c1 = cupy.arange(1, length + 1, dtype=cupy.float64) / length
    else:
        c0, c1, c2 = (coef[j][:, None, :] for j in range(3))  # coef (3, batch or 1, length)
    bad = ~cupy.isfinite(v)
    index = cupy.arange(length, dtype=cupy.float64)
    return cupy.stack([
        (c0 * v).sum(-1), (c1 * v).sum(-1), (c2 * cupy.abs(v)).sum(-1),
        bad.sum(-1).astype(cupy.float64), cupy.where(bad, index, -1.0).max(-1),
    ], axis=-1)


def check_reduce(x: cupy.ndarray, coef: cupy.ndarray | None, batch: int, rows: bool) -> str:
    """'' when the backend's row/col reduction matches :func:`reference_reduce`, else why not."""
    vectors = x.shape[1] if rows else x.shape[2]
    out = cupy.full((batch, vectors, 5), 7.0)  # garbage the kernels must overwrite
    (_cuda.backend().row_reduce if rows else _cuda.backend().col_reduce)(x, coef, out)
    ref = reference_reduce(x, coef, batch, rows)
    if not bool(cupy.allclose(out, ref, **REDUCE_TOL)):
        bad = int((~cupy.isclose(out, ref, **REDUCE_TOL)).sum())
        return f"{bad} fields differ"
    return ""


def reduce_cases() -> Iterator[tuple[str, Callable[[], str]]]:
    """(name, check) for every dtype, layout, direction and coefficient kind, with INF/NaN."""
    # (batch, r, c): tiny, odd and misaligned, and tall-and-narrow so columns split into chunks
    shapes = ((3, 5, 7), (2, 67, 133), (2, 3000, 70))
    for dtype in DTYPES:
        for batch, r, c in shapes:
            host = RNG.standard_normal((batch, r, c)) * 3
            host[0, r // 2, c // 3] = numpy.inf
            host[-1, r - 1, 0] = numpy.nan
            host[-1, 0, c - 1] = -numpy.inf
            for layout, x in layouts(host, dtype):
                for rows in (True, False):
                    length = c if rows else r
                    kind = "row" if rows else "col"
                    coefs = {"none": None,
                             "coef": cupy.asarray(RNG.standard_normal((3, batch, length))),
                             "coef bcast": cupy.asarray(RNG.standard_normal((3, 1, length)))}
                    for cname, coef in coefs.items():
                        yield (f"{kind}_reduce {dtype} {batch}x{r}x{c} x={layout} {cname}",
                               lambda x=x, coef=coef, b=batch, rows=rows:
                               check_reduce(x, coef, b, rows))
                    yield (f"{kind}_reduce {dtype} {batch}x{r}x{c} x={layout} broadcast x",
                           lambda x=x[:1], b=batch, rows=rows: check_reduce(x, None, b, rows))


def main() -> int:
    """Run every case; 0 when all pass."""
    failures = 0
    for name, case in (*gemm_cases(), *reduce_cases()):
        try:
            why = case()
        except Exception:
            why = traceback.format_exc(limit=3).strip().replace("\n", " | ")
        failures += bool(why)
        print(f"{'FAIL' if why else 'PASS'} {name}{': ' + why if why else ''}")
    print(f"{failures} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
