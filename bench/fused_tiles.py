"""What one tile of the fused attention core costs on the CPU, step by step: each numba leaf of
:mod:`attention._cpu_fused` timed on one ``BR x BC`` tile (head dimension ``--dim``), in a
compiled loop (no dispatch from Python in the time), with the sum of the steps a forward tile and
a backward tile run, unprotected and with their checks.

    PYTHONPATH=. python bench/fused_tiles.py [--dtype float32] [--dim 64] [--calls 3000] [--rows R]

Prints microseconds of the thread's CPU time per call (other load on the machine inflates it far
less than wall time), the CPU and the load. One thread (the leaves are serial).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from abftgemm.cpu_kernels import blas_gemm  # noqa: E402
from abftgemm.threads import one_blas_thread  # noqa: E402
from attention import _cpu_fused as K  # noqa: E402
from attention._cpu_tile_gemm import gemm_rows  # noqa: E402
from attention.fused_rules import (coefficients, dscores_entry_tolerance,  # noqa: E402
                                   probs_tolerance)
from bench.timing import device_name  # noqa: E402

#: The steps of a tile, in the order the drivers run them: (name, checked only, forward, backward).
STEPS = (("S = Q K^T", False, 1, 1), ("mask and scale", False, 1, 1),
         ("running max", False, 1, 0), ("exp", False, 1, 1), ("row sums", False, 1, 0),
         ("O += P V", False, 1, 0), ("dV += P^T dO", False, 0, 1), ("dP = dO V^T", False, 0, 1),
         ("dS", False, 0, 1), ("dK += dS^T Q", False, 0, 1), ("dQ += dS K", False, 0, 1),
         ("predict (S, dP)", True, 1, 2), ("observe columns (S fwd)", True, 1, 0),
         ("observe rows (S, dP bwd)", True, 0, 2), ("judge", True, 1, 2),
         ("softmax invariant", True, 1, 1), ("carry O checksums", True, 1, 0),
         ("carry transposed (dV, dK)", True, 0, 2), ("carry dQ checksums", True, 0, 1),
         ("dS invariant", True, 0, 1))


@numba.njit
def _run(step: int, calls: int, q: Any, k: Any, s: Any, p: Any, m: Any, alpha: Any, l: Any,
         enc: Any, wide: Any, pred: Any, obs: Any, info: Any, oc: Any, cols3: Any, acc: Any,
         g_rows: int, dd: Any, ds: Any, dp: Any, coef: Any, tol_p: Any, tol_ds: Any, scale: Any,
         one: Any) -> None:
    """``calls`` calls of step ``step`` (:data:`STEPS`) on one tile."""
    kt = np.ascontiguousarray(k.T)  # the kernels' layout (_cpu_fused._transpose_block)
    none = np.empty(0, s.dtype)
    nokeep = np.empty((0, 0), np.uint8)
    visible = np.ones(0, np.bool_)
    add = np.zeros((0, 0))
    keys = np.zeros(0)
    w = K._weights(s.shape[0])
    for _ in range(calls):
        if step == 0 or step == 7:
            blas_gemm(q, kt, s, 0.0, False, False, g_rows)
        elif step == 1:
            K._mask(s, scale, 0, 0, False, visible, add, keys)
        elif step == 2:
            K._new_max(s, m, alpha)
        elif step == 3:
            K._exp_rows(s, m, p)
        elif step == 4:
            K._sum_rows(p, alpha, l)
        elif step == 5:
            K._rescale(acc, alpha)
            blas_gemm(p, k, acc, 1.0, False, False, g_rows)
        elif step == 10:
            blas_gemm(p, k, acc, 1.0, False, False, g_rows)
        elif step == 6 or step == 9:
            blas_gemm(p, q, acc, 1.0, True, False, g_rows)
        elif step == 8:
            K._dscores(p, dp, dd, nokeep, one, ds)
        elif step == 11:
            K._predict(k, enc, pred)
        elif step == 12:
            K._col_sums(s, w, cols3)
        elif step == 13:
            K._observe_rows(s, obs)
        elif step == 14:
            K._judge(pred, obs, s.shape[1], coef, info)
        elif step == 15:
            K._probs_ratio(s, p, m, tol_p, info)
        elif step == 16:
            K._carry(p, nokeep, one, wide, 0, alpha, oc, False)
        elif step == 17:
            K._carry(p, nokeep, one, wide, 0, none, cols3, True)
        elif step == 18:
            K._carry(ds, nokeep, one, wide, 0, none, oc[:, :3], False)
        elif step == 19:
            K._dscores_ratio(ds, p, dp, dd, nokeep, one, tol_ds, info)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rows", type=int, default=0,
                        help="rows of a tile product per BLAS call (default: measured)")
    args = parser.parse_args()
    dt = np.dtype(args.dtype)
    rows, cols, d = K.BR, K.BC, args.dim
    g_rows = args.rows or gemm_rows(dt, d, rows)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((rows, d)).astype(dt)
    k = rng.standard_normal((cols, d)).astype(dt)
    s = (q @ k.T * dt.type(d ** -0.5)).astype(dt)
    m = s.max(axis=1)
    p = np.exp(s - m[:, None]).astype(dt)
    dp = rng.standard_normal((rows, cols)).astype(dt)
    dd = (p * dp).sum(axis=1).astype(dt)
    ds = (p * (dp - dd[:, None])).astype(dt)
    arrays = dict(q=q, k=k, s=s, p=p, m=m, alpha=np.ones(rows, dt), l=np.zeros(rows, dt),
                  enc=rng.standard_normal((3, d)), wide=rng.standard_normal((3, max(rows, cols))),
                  pred=np.zeros((max(rows, cols), 3)), obs=np.zeros((max(rows, cols), 3)),
                  info=np.zeros(6), oc=np.zeros((rows, 4)), cols3=np.zeros((3, cols)),
                  acc=np.zeros((rows, d), dt), g_rows=g_rows, dd=dd,
                  ds=ds, dp=dp, coef=coefficients(d, cols, dt), tol_p=probs_tolerance(dt),
                  tol_ds=dscores_entry_tolerance(dt), scale=dt.type(1.0), one=dt.type(1.0))
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"{device_name()}, {args.dtype}, tile {rows} x {cols}, head dim {d}, "
          f"{g_rows} rows per BLAS call, load {load}")
    cost = {}
    for i, (name, _, _, _) in enumerate(STEPS):
        work = {key: (v.copy() if isinstance(v, np.ndarray) else v) for key, v in arrays.items()}
        with one_blas_thread():  # as the kernels run their tile products
            _run(i, 1, **work)
            start = time.thread_time()
            _run(i, args.calls, **work)
            cost[name] = (time.thread_time() - start) / args.calls * 1e6
        print(f"  {name:28s} {cost[name]:7.2f} us")
    for phase, col in (("forward", 2), ("backward", 3)):
        plain = sum(cost[st[0]] * st[col] for st in STEPS if not st[1])
        checks = sum(cost[st[0]] * st[col] for st in STEPS if st[1])
        print(f"{phase} tile: {plain:.1f} us unprotected + {checks:.1f} us of checks "
              f"({checks / plain:.2f}x)")


if __name__ == "__main__":
    main()
