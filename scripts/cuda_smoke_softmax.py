"""GPU check of :func:`abftgemm._cuda_softmax.softmax_rows` against plain CuPy float64 arithmetic.

Run from the repository root on a GPU machine: ``python scripts/cuda_smoke_softmax.py``. Prints
one PASS/FAIL line per case and exits 1 if any case failed. Covers every dtype, rows that stay in
registers and rows that are re-read, unaligned rows, non-contiguous and misaligned inputs, key
masks (one batch element fully masked), causal masking, and NaN/INF among the raw scores.
bfloat16 data is moved and widened through its bits, so the references need no CuPy bfloat16
arithmetic.
"""
from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import cupy
import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from abftgemm._cuda_softmax import softmax_rows  # noqa: E402
from cuda_smoke import to_device, widen  # noqa: E402  (scripts/ is on sys.path)

DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Unit roundoff of the stored dtype and of the arithmetic the kernel uses for it.
U_OUT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
U_ARITH = {"float16": 2.0**-24, "bfloat16": 2.0**-24, "float32": 2.0**-24, "float64": 2.0**-53}
#: Absolute slack for tiny probabilities: fp16 subnormal spacing; float32 arithmetic runs with
#: -ftz=true, so results below 2**-126 may be flushed to 0.
ATOL = {"float16": 2.0**-24, "bfloat16": 2.0**-125, "float32": 2.0**-125, "float64": 1e-300}
UINT = {2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}
RNG = numpy.random.default_rng(4321)
# Statistics accumulate in float64 in another order than the reference: allow for that only.
STATS_TOL = {"rtol": 1e-12, "atol": 1e-6, "equal_nan": True}
BATCH, HEADS = 2, 3
# 2048: exactly the register cache for 16-bit types (aligned rows), re-read for 32/64-bit;
# 2500: re-read for every type; 300 and 7: rows start at varying 16-byte offsets.
SEQS = (1, 7, 64, 300, 2048, 2500)


def visibility(key_mask: cupy.ndarray | None, causal: bool, batch: int, seq: int) -> cupy.ndarray:
    """Boolean (batch*heads, seq, seq): key j visible to query i."""
    vis = cupy.ones((batch, 1, seq, seq), dtype=bool)
    if key_mask is not None:
        vis = vis & key_mask[:, None, None, :]
    if causal:
        vis = vis & cupy.tril(cupy.ones((seq, seq), dtype=bool))
    return cupy.broadcast_to(vis, (batch, HEADS, seq, seq)).reshape(batch * HEADS, seq, seq)


def reference_probs(z: cupy.ndarray, vis: cupy.ndarray) -> cupy.ndarray:
    """The kernel's softmax semantics in float64 (see kernels/softmax.cu)."""
    neg_inf = cupy.float64(-numpy.inf)
    zv = cupy.where(vis, z, neg_inf)
    top = cupy.where(cupy.isnan(zv), neg_inf, zv).max(axis=-1, keepdims=True)  # NaN ignored
    top = cupy.where(cupy.isfinite(top), top, 0.0)
    e = cupy.where(vis, cupy.exp(zv - top), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    inv = cupy.where(total == 0, 0.0, 1.0 / cupy.where(total == 0, 1.0, total))
    return cupy.where(vis, e * inv, 0.0)


def reference_stats(v: cupy.ndarray) -> cupy.ndarray:
    """The five fields of abft_row_reduce (coef=None) per row of float64 ``v`` (..., len)."""
    length = v.shape[-1]
    weights = cupy.arange(1, length + 1, dtype=cupy.float64) / length
    bad = ~cupy.isfinite(v)
    index = cupy.arange(length, dtype=cupy.float64)
    return cupy.stack([
        v.sum(-1), (weights * v).sum(-1), cupy.abs(v).sum(-1),
        bad.sum(-1).astype(cupy.float64), cupy.where(bad, index, -1.0).max(-1),
    ], axis=-1)


def check(scores: cupy.ndarray, scale: float, key_mask: cupy.ndarray | None, causal: bool,
          dtype: str) -> str:
    """'' when probs and stats match the float64 references, else why not."""
    seq = scores.shape[1]
    batch = scores.shape[0] // HEADS
    probs, stats = softmax_rows(scores, scale, key_mask, causal, HEADS, seq)
    why = []
    if probs.shape != scores.shape or probs.dtype != scores.dtype or not probs.flags.c_contiguous:
        why.append(f"probs is {probs.dtype} {probs.shape}")
    if stats.shape != scores.shape[:2] + (5,) or stats.dtype != numpy.float64:
        why.append(f"stats is {stats.dtype} {stats.shape}")
    if why:
        return "; ".join(why)

    raw = widen(scores)
    z = raw * scale  # scale is a power of two or rounded the same way below
    if dtype != "float64":
        z = raw * float(numpy.float32(scale))
    vis = visibility(key_mask, causal, batch, seq)
    ref = reference_probs(z, vis)
    out = widen(probs)

    finite_z = cupy.where(cupy.isfinite(z), cupy.abs(z), 0.0)
    zmax = float(finite_z.max())
    rtol = 2 * U_OUT[dtype] + (32 + 8 * zmax + seq / 16) * U_ARITH[dtype]
    nan_ref, nan_out = cupy.isnan(ref), cupy.isnan(out)
    n_nan = int((nan_ref != nan_out).sum())
    if n_nan:
        why.append(f"{n_nan} probabilities differ in NaN-ness")
    diff = cupy.where(nan_ref | nan_out, 0.0, cupy.abs(out - ref))
    excess = diff - (rtol * cupy.abs(ref) + ATOL[dtype])
    n_bad = int((excess > 0).sum()) + int(cupy.isinf(out).sum())
    if n_bad:
        worst = float(excess.max())
        why.append(f"{n_bad} probabilities off (worst excess {worst:g}, rtol {rtol:g})")
    hidden_nonzero = int(((out != 0) & ~vis).sum())
    if hidden_nonzero:
        why.append(f"{hidden_nonzero} hidden probabilities not 0")

    ref_stats = reference_stats(raw)
    if not bool(cupy.allclose(stats, ref_stats, **STATS_TOL)):
        bad = int((~cupy.isclose(stats, ref_stats, **STATS_TOL)).sum())
        why.append(f"{bad} stats fields differ")
    return "; ".join(why)


def host_scores(seq: int, spread: float, inject: bool) -> numpy.ndarray:
    """Random (batch*heads, seq, seq) scores, with INF/NaN in a few rows when ``inject``."""
    host = RNG.standard_normal((BATCH * HEADS, seq, seq)) * spread
    if inject:
        host[0, 0, 0] = numpy.nan                         # visible under every mask: NaN row
        host[0, seq - 1, seq // 2] = numpy.nan             # hidden under causal when seq > 2
        host[1, seq // 2, seq - 1] = numpy.inf             # +INF row (causal hides it if seq > 1)
        host[HEADS, seq - 1, seq // 3] = -numpy.inf        # in the fully masked batch element
        host[-1, seq - 1, 0] = numpy.inf                    # INF and -INF: NaN sums
        host[-1, seq - 1, seq - 1] = -numpy.inf
        host[-2, 0, 0] = -numpy.inf                         # causal query 0: only key is -INF
    return host


def variants(host: numpy.ndarray, dtype: str) -> Iterator[tuple[str, cupy.ndarray]]:
    """The same scores C-contiguous, misaligned (contiguous at an odd element offset) and as a
    transposed view (copied by softmax_rows)."""
    yield "C", to_device(host, dtype)
    flat = to_device(numpy.concatenate([numpy.zeros(1), host.ravel()]), dtype)
    yield "offset", flat[1:].reshape(host.shape)
    yield "T view", to_device(host.transpose(0, 2, 1).copy(), dtype).transpose(0, 2, 1)


def masks(seq: int) -> Iterator[tuple[str, cupy.ndarray | None]]:
    """No mask, and a random key mask whose second batch element hides every key."""
    yield "no mask", None
    mask = RNG.random((BATCH, seq)) < 0.8
    mask[0, 0] = True
    mask[1] = False
    yield "key mask", cupy.asarray(mask)


def cases() -> Iterator[tuple[str, Callable[[], str]]]:
    """(name, check) for every dtype, length, layout, mask and causal setting."""
    for dtype in DTYPES:
        for seq in SEQS:
            for spread, inject, head_dim in ((3.0, True, 64), (300.0, False, 80)):
                host = host_scores(seq, spread, inject)
                scale = 1 / math.sqrt(head_dim)
                kinds = list(variants(host, dtype))
                if seq > 300:  # big: the plain layout covers the rest
                    kinds = kinds[:2] if spread == 3.0 else kinds[:1]
                for layout, scores in kinds:
                    for mname, key_mask in masks(seq):
                        for causal in (False, True):
                            name = (f"softmax {dtype} seq={seq} spread={spread:g} "
                                    f"hd={head_dim} {layout} {mname}"
                                    f"{' causal' if causal else ''}")
                            yield name, (lambda s=scores, sc=scale, m=key_mask, c=causal,
                                         d=dtype: check(s, sc, m, c, d))


def main() -> int:
    """Run every case; 0 when all pass."""
    failures = 0
    for name, case in cases():
        try:
            why = case()
        except Exception:
            why = traceback.format_exc(limit=3).strip().replace("\n", " | ")
        failures += bool(why)
        print(f"{'FAIL' if why else 'PASS'} {name}{': ' + why if why else ''}", flush=True)
    print(f"{failures} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
