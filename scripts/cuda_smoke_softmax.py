"""GPU check of the attention softmax kernels (``attention/kernels/softmax.cu``) against the NumPy
path of the same steps (numba kernels), through :func:`attention.softmax_steps.forward_step` and
:func:`attention.softmax_steps.backward_step`.

Run from the repository root on a GPU machine: ``python scripts/cuda_smoke_softmax.py``. Prints
one PASS/FAIL line per case and exits 1 if any case failed. Covers every dtype, rows that stay in
registers and rows that are re-read, unaligned rows, cross-attention shapes, key masks (one batch
element fully masked), causality, additive masks with -inf, the fused path and the fault-hook path
(compute, hook, check), and a corrupted output that each check must flag.
"""
from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import cupy
import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from abftgemm.checksums import accumulation_dtype, unit_roundoff  # noqa: E402
from attention.softmax_steps import backward_step, forward_step  # noqa: E402
from attention.workspace import Workspace  # noqa: E402
from cuda_smoke import host_dtype, to_device, widen  # noqa: E402  (scripts/ is on sys.path)

DTYPES = ("float16", "bfloat16", "float32", "float64")
RNG = numpy.random.default_rng(4321)
BATCH, HEADS, HEAD_DIM = 2, 3, 64
# (seq_q, seq_k): 1 and 7 (rows start at varying 16-byte offsets), 64, 300 (cached for 16-bit
# types only), 1100 (re-read for every type), and a cross-attention shape.
SHAPES = ((1, 1), (7, 7), (64, 64), (300, 300), (1100, 1100), (5, 700))
STATS_RTOL = 1e-12  # float64 sums of the same values in another order


def _inputs(dtype: str, seq_q: int, seq_k: int, mask: str) -> dict:
    """Host (float64) scores, dP and masks, and their device copies."""
    scores = RNG.standard_normal((BATCH * HEADS, seq_q, seq_k)) * 3.0
    dp = RNG.standard_normal(scores.shape)
    keys = add = None
    if mask in ("keys", "keys causal"):
        keys = RNG.random((BATCH, seq_k)) < 0.8
        keys[1] = False  # a batch element whose rows see no key
    if mask == "additive":
        add = RNG.standard_normal(scores.shape)
        add[:, :, -1] = -numpy.inf
    host = {"scores": scores.astype(host_dtype(dtype)), "dp": dp.astype(host_dtype(dtype)),
            "keys": keys, "add": add, "causal": mask.endswith("causal")}
    dev = {"scores": to_device(scores, dtype), "dp": to_device(dp, dtype),
           "keys": None if keys is None else cupy.asarray(keys),
           "add": None if add is None else cupy.asarray(add), "causal": host["causal"]}
    return {"host": host, "dev": dev}


def _steps(xp, data: dict, hook: Callable | None = None) -> tuple:
    """Forward then backward step on one backend; returns both and their observed stats."""
    inp = SimpleNamespace(head_dim=HEAD_DIM, n_heads=HEADS, causal=data["causal"],
                          key_visible=data["keys"], attn_add=data["add"])
    ctx = SimpleNamespace(check="correct", fault_hook=hook)
    s, dp = data["scores"], data["dp"]
    f_plan = SimpleNamespace(row_limits=None, observed=xp.zeros(s.shape[:2] + (5,)))
    b_plan = SimpleNamespace(row_limits=None, observed=xp.zeros(s.shape[:2] + (5,)))
    ws = Workspace()
    fwd = forward_step(inp, s, xp.empty_like(s), ctx, ws, f_plan)
    bwd = backward_step(dp, fwd.probs, xp.empty_like(dp), 1 / math.sqrt(HEAD_DIM), ctx, ws, b_plan)
    return fwd, bwd, f_plan.observed, b_plan.observed


def _host64(x) -> numpy.ndarray:
    if isinstance(x, cupy.ndarray):
        return cupy.asnumpy(widen(x))
    return numpy.asarray(x).astype(numpy.float32 if x.dtype.itemsize == 2 else x.dtype) \
        .astype(numpy.float64)


def check(dtype: str, seq_q: int, seq_k: int, mask: str, hooked: bool) -> str:
    """'' when the GPU steps agree with the NumPy ones and both checks pass, else why not."""
    data = _inputs(dtype, seq_q, seq_k, mask)
    seen = []
    hook = (lambda site, c: seen.append(site)) if hooked else None
    cpu = _steps(numpy, data["host"], hook)
    gpu = _steps(cupy, data["dev"], hook)
    why = []
    for name, step in (("cpu forward", cpu[0]), ("gpu forward", gpu[0]),
                       ("cpu backward", cpu[1]), ("gpu backward", gpu[1])):
        ok, worst, tol = step.verdict()
        if not ok:
            why.append(f"{name} check failed ({worst:.3g} > {tol:.3g})")
    # Each backend's P is within (2 max|z| + L + 8) u_acc + u_out (relative) of the exact
    # softmax (tests/test_softmax_checks.py), so the two differ by at most twice that.
    u_out, u_acc = unit_roundoff(host_dtype(dtype)), unit_roundoff(accumulation_dtype(
        host_dtype(dtype)))
    p_cpu, p_gpu = _host64(cpu[0].probs), _host64(gpu[0].probs)
    z = numpy.abs(_host64(data["host"]["scores"])) / math.sqrt(HEAD_DIM)
    if data["host"]["add"] is not None:
        z = z + numpy.abs(numpy.where(numpy.isfinite(data["host"]["add"]), data["host"]["add"], 0))
    rel = 2 * ((2 * z.max() + seq_k + 8) * u_acc + u_out)
    tiny = 2.0**-24 if dtype == "float16" else 2.0**-125 if dtype != "float64" else 1e-300
    bad = int((numpy.abs(p_gpu - p_cpu) > rel * numpy.abs(p_cpu) + tiny).sum())
    if bad:
        why.append(f"{bad} probabilities differ beyond {rel:.3g} relative")
    # dS: (L + 4) u_acc * scale * P (|dP| + sum |P dP|) per backend, plus the store (u_out);
    # twice that between them. Both use their own P, which differ by the bound above.
    dp = _host64(data["host"]["dp"])
    scale = 1 / math.sqrt(HEAD_DIM)
    terms = numpy.abs(p_cpu * dp).sum(-1, keepdims=True)
    bound = 2 * ((seq_k + 4) * u_acc + u_out + rel) * scale * p_cpu * (numpy.abs(dp) + terms)
    ds_cpu, ds_gpu = _host64(cpu[1].ds), _host64(gpu[1].ds)
    bad = int((numpy.abs(ds_gpu - ds_cpu) > bound + tiny).sum())
    if bad:
        why.append(f"{bad} dS entries differ")
    for name, a, b in (("score", cpu[2], gpu[2]), ("dP", cpu[3], gpu[3])):
        if not numpy.allclose(cupy.asnumpy(b), a, rtol=STATS_RTOL, atol=1e-9):
            why.append(f"{name} row checksums differ")
    if hooked and seen.count("softmax") != 2:
        why.append(f"hook saw {seen}")
    return "; ".join(why)


def check_flags(dtype: str, site: str) -> str:
    """'' when a corrupted entry of the step's output makes its GPU check fail."""
    data = _inputs(dtype, 64, 64, "none")["dev"]

    def corrupt(name, c):
        if name == site:
            c[0, 0, 0] = c[0, 0, 0] * 2 + 1  # through the element dtype (16-bit P, fp32 dS)

    fwd, bwd, _, _ = _steps(cupy, data, corrupt)
    step = fwd if site == "softmax" else bwd
    ok, worst, tol = step.verdict()
    return "" if not ok else f"{site} corruption not flagged ({worst:.3g} <= {tol:.3g})"


def cases() -> Iterator[tuple[str, Callable[[], str]]]:
    for dtype in DTYPES:
        for seq_q, seq_k in SHAPES:
            for mask in ("none", "keys", "keys causal", "additive"):
                for hooked in (False, True):
                    if hooked and seq_k > 300:
                        continue
                    if seq_k > 1000 and mask not in ("none", "keys causal"):
                        continue  # the long rows' other masks: the device time is short
                    name = f"{dtype} {seq_q}x{seq_k} {mask}{' hook' if hooked else ''}"
                    yield name, (lambda d=dtype, q=seq_q, k=seq_k, m=mask, h=hooked:
                                 check(d, q, k, m, h))
        if dtype != "bfloat16":  # CuPy has no bfloat16 arithmetic for the corrupting hook
            for site in ("softmax", "softmax_backward"):
                yield f"{dtype} corrupted {site}", (lambda d=dtype, s=site: check_flags(d, s))


def main() -> int:
    """Run every case; 0 when all pass."""
    failures = 0
    for name, case in cases():
        try:
            why = case()
        except Exception:
            why = traceback.format_exc(limit=4).strip().replace("\n", " | ")
        failures += bool(why)
        print(f"{'FAIL' if why else 'PASS'} {name}{': ' + why if why else ''}", flush=True)
    print(f"{failures} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
