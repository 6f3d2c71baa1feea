"""Per-step time of the protected CPU path (``check="correct"``, no fault), for bench/NOTES.md.

    python bench/profile_cpu.py [--sizes 512,2048] [--repeats 15] [--threads N]

Times, each on its own (median ms), the steps :func:`abftgemm.matmul` runs: operand preparation,
the GEMM, the four operand reductions of :func:`abftgemm.encode.predict`, the two product
reductions of :func:`abftgemm.encode.observe`, :func:`abftgemm.locate.verify`, and the whole call
with ``check="off"`` and ``"correct"``. Also times candidate replacements (not used by abftgemm):
``fastmath={"reassoc","contract"}`` row reduction (lets LLVM vectorize the dot products) and a fused
single pass computing the row AND column encodings of C. Read-only: nothing in abftgemm changes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba
import numpy as np
from numba import prange

import abftgemm
from abftgemm import _cpu
from abftgemm.backend import get_backend
from abftgemm.encode import observe, predict
from abftgemm.locate import verify
from abftgemm.operands import Operands
from bench import timing


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def _row_reduce_reassoc(x, coef, out):  # same as abftgemm._cpu._row_reduce, reassociation allowed
    batch, nrows = out.shape[0], out.shape[1]
    ncols = x.shape[2]
    for task in prange(batch * nrows):
        b, i = task // nrows, task % nrows
        xb = b if x.shape[0] > 1 else 0
        c = coef[b if coef.shape[0] > 1 else 0]
        row = x[xb, i]
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        for j in range(ncols):
            v = np.float64(row[j])
            s0 += c[j, 0] * v
            s1 += c[j, 1] * v
            s2 += c[j, 2] * abs(v)
        o = out[b, i]
        o[0], o[1], o[2], o[3], o[4] = s0, s1, s2, 0.0, -1.0


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def _row_reduce_w(x, w, out):
    """Default-coefficient row encoding of x (1, m, n): weights as one contiguous vector."""
    m, n = x.shape[1], x.shape[2]
    for i in prange(m):
        row = x[0, i]
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        for j in range(n):
            v = np.float64(row[j])
            s0 += v
            s1 += w[j] * v
            s2 += abs(v)
        out[i, 0], out[i, 1], out[i, 2] = s0, s1, s2


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def _fused_both(x, wr, wc, out_rows, out_cols_parts):
    """One pass over x (1, m, n): row encodings and per-thread-chunk partial column encodings."""
    m, n = x.shape[1], x.shape[2]
    nparts = out_cols_parts.shape[0]
    chunk = (m + nparts - 1) // nparts
    for p in prange(nparts):
        i0, i1 = p * chunk, min((p + 1) * chunk, m)
        cs0 = out_cols_parts[p, 0]
        cs1 = out_cols_parts[p, 1]
        cs2 = out_cols_parts[p, 2]
        cs0[:] = 0.0
        cs1[:] = 0.0
        cs2[:] = 0.0
        for i in range(i0, i1):
            row = x[0, i]
            w = wc[i]
            s0 = 0.0
            s1 = 0.0
            s2 = 0.0
            for j in range(n):
                v = np.float64(row[j])
                a = abs(v)
                s0 += v
                s1 += wr[j] * v
                s2 += a
                cs0[j] += v
                cs1[j] += w * v
                cs2[j] += a
            out_rows[i, 0], out_rows[i, 1], out_rows[i, 2] = s0, s1, s2


def _time_thread(fn, repeats: int, warmup: int) -> float:
    """Median ``time.thread_time`` of ``fn()`` in ms."""
    import statistics
    import time

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        samples.append((time.thread_time() - t0) * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="512,2048")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="numba threads (default: all)")
    p.add_argument("--thread-clock", action="store_true",
                   help="time with time.thread_time (CPU time of this thread: robust against other "
                        "load on the machine; meaningful only single-threaded, i.e. with "
                        "--threads 1 and OPENBLAS_NUM_THREADS=1)")
    args = p.parse_args(argv)
    if args.threads:
        numba.set_num_threads(args.threads)
    if args.thread_clock:
        timing_fn = _time_thread
    else:
        timing_fn = timing.time_cpu
    be = get_backend(np)
    bw = timing.copy_bandwidth_TBps(np)
    print(f"# {timing.device_name(np)}, numba threads {numba.get_num_threads()}, "
          f"clock {'thread_time' if args.thread_clock else 'perf_counter'}, "
          f"copy {bw * 1e3:.1f} GB/s (read+write)")
    for n in map(int, args.sizes.split(",")):
        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n), dtype=np.float32) / np.float32(np.sqrt(n))
        b = rng.standard_normal((n, n), dtype=np.float32)
        op = Operands.prepare(a, b, None)
        out = np.empty((1, n, n), np.float32)
        be.gemm(op.a, op.b, out, None)
        pc, pr = predict(be, op, None, None)
        oc, orow = observe(be, out)
        enc = np.empty((1, n, 5))
        be.col_reduce(op.a, None, enc)
        a_cols = np.ascontiguousarray(enc[..., :3])
        be.row_reduce(op.b, None, enc)
        b_rows = np.ascontiguousarray(enc[..., :3])
        e = lambda: np.empty((1, n, 5))
        steps = {
            "prepare+alloc": lambda: (Operands.prepare(a, b, None), np.empty((1, n, n), np.float32)),
            "gemm": lambda: be.gemm(op.a, op.b, out, None),
            "A col_reduce (encode A)": lambda: be.col_reduce(op.a, None, e()),
            "B row_reduce (encode B)": lambda: be.row_reduce(op.b, None, e()),
            "B col_reduce coef=A enc": lambda: be.col_reduce(op.b, a_cols, e()),
            "A row_reduce coef=B enc": lambda: be.row_reduce(op.a, b_rows, e()),
            "C col_reduce": lambda: be.col_reduce(out, None, e()),
            "C row_reduce": lambda: be.row_reduce(out, None, e()),
            "predict (4 reductions)": lambda: predict(be, op, None, None),
            "observe (2 reductions)": lambda: observe(be, out),
            "verify": lambda: verify(be, op, pc, pr, oc, orow),
            "matmul off": lambda: abftgemm.matmul(a, b, check="off"),
            "matmul correct": lambda: abftgemm.matmul(a, b),
            "numpy.matmul": lambda: np.matmul(a, b),
        }
        coef = _cpu._default_coef(n)
        parts = np.empty((numba.get_num_threads(), 3, n))
        wr = coef[0, :, 1].copy()
        steps["[candidate] C row_reduce reassoc"] = lambda: _row_reduce_reassoc(out, coef, e())
        steps["[candidate] C row_reduce reassoc w"] = lambda: _row_reduce_w(out, wr, np.empty((n, 3)))
        steps["[candidate] C rows+cols fused"] = lambda: _fused_both(out, wr, wr, np.empty((n, 3)),
                                                                   parts)
        times = {k: timing_fn(f, args.repeats, 2) for k, f in steps.items()}
        gemm_ms = times["gemm"]
        mb = n * n * 4 / 1e6
        print(f"\n## {n}x{n}x{n} float32: one matrix = {mb:.1f} MB, read floor "
              f"{timing.floor_ms(n * n * 4, bw / 2):.3f} ms at {bw / 2 * 1e3:.1f} GB/s read; "
              f"GEMM {2 * n ** 3 / gemm_ms / 1e6:.1f} GFLOP/s")
        print(f"{'step':36s} {'ms':>9s} {'% of gemm':>10s} {'GB/s':>8s}")
        for k, v in times.items():
            gbs = mb / v if ("reduce" in k or "fused" in k) else float("nan")
            print(f"{k:36s} {v:9.3f} {100 * v / gemm_ms:9.1f}% {gbs:8.1f}")
        parts_sum = sum(times[k] for k in list(times)[:8]) + times["verify"]
        print(f"{'sum of steps (prepare..C row, verify)':36s} {parts_sum:9.3f}")
        print(f"ratio correct/off: {times['matmul correct'] / times['matmul off']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
