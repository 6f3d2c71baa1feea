"""GEMM benchmark: protected (``check="correct"``, no fault) vs unprotected (``check="off"``).

Usage::

    python bench/gemm.py [--backend numpy|cupy] [--json PATH] [--quick] [--repeats N]

Prints an aligned table (group, case, dtype, protected ms, unprotected ms, ratio, floor ms, peers)
and, with ``--json``, writes the results file (see :func:`bench.timing.write_results`). A GPU run
writes ``bench/results/<YYYY-MM-DD>-<device-slug>.json`` when ``--json`` is given without a path.
The JSON is rewritten after every case, so a run cut short still leaves what it measured.

Groups
------
CPU (``--backend numpy``):

- ``cpu-square``: 512^3 and 2048^3 float32, the targets (ratio <= 1.15 and <= 1.06);
- ``cpu-batched``: 8 x 256^3 float32 (target ratio <= 1.25);
- ``cpu-dtype``: 512^3 float64 and float16 (information);
- ``cpu-cold``: the first protected call in a fresh process, with the numba kernels already cached
  on disk (load only), and with an empty cache (compile), against the first unprotected call.

GPU (``--backend cupy``), dtypes float16, bfloat16 (``ml_dtypes.bfloat16`` CuPy arrays), float32:

- ``gemm-projection``: (1, 16384, 4096, 4096) and (1, 4096, 1024, 1024) as 2-D products;
- ``gemm-batched``: 128 x (512,64,512), (512,512,64), (2048,128,2048), (2048,2048,128);
- ``gemm-chained``: the projection shapes called as attention calls them: ``a_checksums`` from an
  earlier product's ``return_checksums=True``, and ``return_checksums=True``.

Shapes are ``(batch, m, k, n)``: ``C(batch, m, n) = A(batch, m, k) @ B(batch, k, n)``. Inputs are
standard normal scaled by ``1/sqrt(k)`` (never zeros). ``floor_ms`` is one read of C at the copy
bandwidth measured in the same run. Peers: ``numpy.matmul`` on the CPU (the CPU targets are
``abftgemm.matmul / numpy.matmul``) and, for float32/float64, ``numpy.matmul+thin``, the
machine's floor for a one-direction check (:func:`thin_gemm_floor`); ``backend.gemm`` (our
cuBLAS call with a preallocated output, no Python wrapper), ``cupy.matmul`` and ``torch.matmul``
(when importable) on the GPU. ``--groups`` selects groups by name (any group runs on either
backend; the GPU groups on NumPy are a dry run of the code path).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``abftgemm`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import abftgemm
from bench import timing

Shape = tuple[int, int, int, int]  # (batch, m, k, n)

CPU_GROUPS = ("cpu-square", "cpu-batched", "cpu-dtype", "cpu-cold")
GPU_GROUPS = ("gemm-projection", "gemm-batched", "gemm-chained")
GPU_DTYPES = ("float16", "bfloat16", "float32")
THIN_FLOOR = "numpy.matmul+thin"  # the peer of thin_gemm_floor

#: CPU targets: protected/unprotected ratio at (shape, dtype) (default options: the column
#: fast path of a cached plan).
CPU_TARGETS = {((1, 512, 512, 512), "float32"): 1.15, ((8, 256, 256, 256), "float32"): 1.25,
               ((1, 2048, 2048, 2048), "float32"): 1.06}


def cases(group: str, quick: bool) -> list[tuple[Shape, str]]:
    """``(shape, dtype)`` of every case of ``group`` (shrunk with ``quick``)."""
    if group == "cpu-square":
        sizes = (128, 256) if quick else (512, 2048)
        return [((1, s, s, s), "float32") for s in sizes]
    if group == "cpu-batched":
        return [((2, 64, 64, 64) if quick else (8, 256, 256, 256), "float32")]
    if group == "cpu-dtype":
        s = 128 if quick else 512
        return [((1, s, s, s), "float64"), ((1, s, s, s), "float16")]
    if group in ("gemm-projection", "gemm-chained"):
        shapes = [(1, 2048, 1024, 1024), (1, 1024, 512, 512)] if quick else \
            [(1, 16384, 4096, 4096), (1, 4096, 1024, 1024)]
    elif group == "gemm-batched":
        b = 16 if quick else 128
        shapes = [(b, 512, 64, 512), (b, 512, 512, 64), (b, 2048, 128, 2048), (b, 2048, 2048, 128)]
    else:
        raise ValueError(f"unknown group {group!r}")
    return [(s, d) for s in shapes for d in GPU_DTYPES]


def thin_gemm_floor(a: np.ndarray, b: np.ndarray) -> Callable[[], np.ndarray]:
    """``numpy.matmul`` followed by the three thin GEMMs that verify one direction at BLAS speed.

    With ``E`` the two weight rows ``(1, ..., 1)`` and ``(1, 2, ..., m) / m``, the column check
    needs ``E^T A``, ``(E^T A) B`` and ``E^T C``: one read each of A, B and C. Done by the BLAS
    (float accumulation, no magnitude sums), that is the least a one-direction check can cost
    on a machine, so ``floor_ratio_vs_numpy`` is what the CPU targets are measured against.
    """
    lead, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-1]
    e = np.stack([np.ones(m), np.arange(1, m + 1) / m]).astype(a.dtype)
    enc = np.empty(lead + (2, k), a.dtype)
    pred, obs = np.empty(lead + (2, n), a.dtype), np.empty(lead + (2, n), a.dtype)

    def run() -> np.ndarray:
        c = np.matmul(a, b)
        np.matmul(e, a, out=enc)
        np.matmul(enc, b, out=pred)
        np.matmul(e, c, out=obs)
        return c

    return run


def case_name(shape: Shape) -> str:
    return "x".join(map(str, shape))


# --------------------------------------------------------------------------------- data


def dtype_of(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def random_array(xp: Any, shape: tuple[int, ...], dtype: str, scale: float, seed: int) -> Any:
    """Standard normal times ``scale`` in ``dtype`` (bfloat16 rounded to nearest even via bits)."""
    if xp is np:
        x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    else:
        x = xp.random.RandomState(seed).standard_normal(shape, dtype=xp.float32)
    x *= np.float32(scale)
    if dtype == "float32":
        return x
    if dtype == "bfloat16":
        u = x.view(xp.uint32)
        u += (u >> 16) & xp.uint32(1)
        u += xp.uint32(0x7FFF)
        bits = (u >> 16).astype(xp.uint16)
        del x, u
        return bits.view(dtype_of("bfloat16"))
    return x.astype(dtype)


def operands(xp: Any, shape: Shape, dtype: str, seed: int = 0) -> tuple[Any, Any]:
    """``A (m, k)``, ``B (k, n)`` for batch 1 (2-D products), else ``(batch, m, k)``, ``(batch, k, n)``."""
    batch, m, k, n = shape
    lead = () if batch == 1 else (batch,)
    scale = 1 / math.sqrt(k)
    return (random_array(xp, lead + (m, k), dtype, scale, seed),
            random_array(xp, lead + (k, n), dtype, 1.0, seed + 1))


# ----------------------------------------------------------------------------- the runner


class Runner:
    """Times cases on one backend and collects records."""

    def __init__(self, xp: Any, repeats: int, warmup: int, json_path: Path | None,
                 cold_runs: int, cold_compile: bool):
        self.xp, self.gpu = xp, xp is not np
        self.repeats, self.warmup = repeats, warmup
        self.json_path, self.cold_runs, self.cold_compile = json_path, cold_runs, cold_compile
        self.device = timing.device_name(xp)
        self.records: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.copy_TBps = timing.copy_bandwidth_TBps(xp)
        self.torch = _import_torch() if self.gpu else None

    # -- helpers
    def time(self, fns: dict[str, Callable[[], Any]], events: Any = None) -> dict[str, float]:
        return timing.time_many(fns, self.repeats, self.warmup, gpu=self.gpu, events=events)

    def floor(self, shape: Shape, dtype: str) -> float:
        batch, m, _, n = shape
        return timing.floor_ms(batch * m * n * dtype_of(dtype).itemsize, self.copy_TBps)

    def free(self) -> None:
        if self.gpu:
            timing.free_gpu_memory()

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        peers = ", ".join(f"{k} {v:.4g}" for k, v in record["peers"].items())
        print(f"{record['group']} {record['case']} {record['dtype']}: protected "
              f"{record['protected_ms']:.4g} ms, unprotected {record['unprotected_ms']:.4g} ms, "
              f"ratio {record['ratio']:.3f}, floor {record['floor_ms']:.3g} ms"
              + (f"; {peers}" if peers else ""), flush=True)
        self.save()

    def save(self) -> None:
        if self.json_path is not None:
            timing.write_results(self.json_path, self.device, self.records, self.copy_TBps,
                                 backend="cupy" if self.gpu else "numpy", repeats=self.repeats,
                                 warmup=self.warmup, notes=self.notes, host=_host_info())

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            print(f"# note: {text}", file=sys.stderr, flush=True)

    # -- cases
    def plain_case(self, group: str, shape: Shape, dtype: str) -> None:
        xp = self.xp
        a, b = operands(xp, shape, dtype)
        c, report = abftgemm.matmul(a, b, return_report=True)
        flags = len(report.events)
        if flags:
            self.note(f"{group} {case_name(shape)} {dtype}: {flags} false flag(s) on clean data")
        del c
        fns = {"protected": lambda: abftgemm.matmul(a, b),
               "unprotected": lambda: abftgemm.matmul(a, b, check="off"),
               "protected-both": lambda: abftgemm.matmul(a, b, directions="both")}
        peers: dict[str, Any] = {}
        extra: dict[str, Any] = {"flags": flags}
        if self.gpu:
            fns.update(self._gpu_peers(a, b, shape, dtype))
        else:
            fns["numpy.matmul"] = lambda: np.matmul(a, b)
            if dtype in ("float32", "float64"):
                fns[THIN_FLOOR] = thin_gemm_floor(a, b)
        times = self.time(fns)
        peers.update({k: v for k, v in times.items() if k not in ("protected", "unprotected")})
        if self.gpu:
            peers.update(self._torch_peer(a, b, dtype))
            extra["memory_bytes"] = {
                "protected": timing.peak_memory_bytes(lambda: abftgemm.matmul(a, b)),
                "unprotected": timing.peak_memory_bytes(lambda: abftgemm.matmul(a, b, check="off"))}
        target = CPU_TARGETS.get((shape, dtype)) if not self.gpu else None
        if target is not None:
            extra["target_ratio"] = target
        if not self.gpu:  # the targets compare with numpy.matmul, as does the floor
            extra["ratio_vs_numpy"] = times["protected"] / times["numpy.matmul"]
            if THIN_FLOOR in times:
                extra["floor_ratio_vs_numpy"] = times[THIN_FLOOR] / times["numpy.matmul"]
        self._record(group, shape, dtype, times["protected"], times["unprotected"], peers, extra)

    def chained_case(self, shape: Shape, dtype: str) -> None:
        """``X @ W`` with X's encoding from the product that made X."""
        xp = self.xp
        _, m, k, n = shape
        x0, w0 = operands(xp, (1, m, k, k), dtype, seed=10)
        x, x_cs = abftgemm.matmul(x0, w0, return_checksums=True)  # the earlier product
        del x0, w0
        self.free()
        w = random_array(xp, (k, n), dtype, 1.0, seed=12)

        def chained() -> Any:
            return abftgemm.matmul(x, w, a_checksums=x_cs, return_checksums=True)

        c, report, _ = abftgemm.matmul(x, w, a_checksums=x_cs, return_checksums=True,
                                       return_report=True)
        flags = len(report.events)
        if flags:
            self.note(f"gemm-chained {case_name(shape)} {dtype}: {flags} false flag(s)")
        del c
        times = self.time({"protected": chained,
                           "unprotected": lambda: abftgemm.matmul(x, w, check="off"),
                           "abft-unchained": lambda: abftgemm.matmul(x, w)})
        extra: dict[str, Any] = {"flags": flags}
        if self.gpu:
            extra["memory_bytes"] = {
                "protected": timing.peak_memory_bytes(chained),
                "unprotected": timing.peak_memory_bytes(lambda: abftgemm.matmul(x, w, check="off"))}
        self._record("gemm-chained", shape, dtype, times["protected"], times["unprotected"],
                     {"abft-unchained": times["abft-unchained"]}, extra)

    def _record(self, group: str, shape: Shape, dtype: str, prot: float, unprot: float,
                peers: dict[str, Any], extra: dict[str, Any]) -> None:
        batch, m, k, n = shape
        extra.setdefault("unprotected_TFLOPs", 2 * batch * m * k * n / (unprot * 1e-3) / 1e12)
        self.add(timing.make_record(group, case_name(shape), dtype, shape, prot, unprot,
                                    self.floor(shape, dtype), peers, **extra))

    def _gpu_peers(self, a: Any, b: Any, shape: Shape, dtype: str) -> dict[str, Callable]:
        import cupy
        from abftgemm.backend import get_backend

        be = get_backend(cupy)
        batch, m, _, n = shape
        a3, b3 = a.reshape((-1,) + a.shape[-2:]), b.reshape((-1,) + b.shape[-2:])
        out = cupy.empty((batch, m, n), dtype=a.dtype)
        fns: dict[str, Callable] = {"backend.gemm": lambda: be.gemm(a3, b3, out, None)}
        try:
            cupy.matmul(a, b)
            cupy.cuda.Device().synchronize()
            fns["cupy.matmul"] = lambda: cupy.matmul(a, b)
        except Exception as exc:  # e.g. batched bf16 raises TypeError
            self.note(f"cupy.matmul skipped for {dtype} {case_name(shape)}: "
                      f"{type(exc).__name__}: {str(exc)[:120]}")
        return fns

    def _torch_peer(self, a: Any, b: Any, dtype: str) -> dict[str, float]:
        torch = self.torch
        if torch is None:
            return {}
        def timed() -> dict[str, float]:
            ta, tb = _to_torch(torch, a, dtype), _to_torch(torch, b, dtype)
            return self.time({"torch.matmul": lambda: torch.matmul(ta, tb)},
                             events=timing.torch_events)

        try:
            t = timed()
            torch.cuda.empty_cache()  # the torch copies went with timed()'s frame
            return t
        except Exception as exc:
            self.note(f"torch.matmul skipped for {dtype}: {type(exc).__name__}: {str(exc)[:120]}")
            return {}

    # -- cold start (CPU)
    def cold_case(self, shape: Shape) -> None:
        """First-call times in fresh processes: warm on-disk numba cache, then an empty one."""
        n = shape[1]
        def median_of(mode: str, env: dict[str, str] | None = None) -> dict[str, float]:
            runs = [_fresh_process(n, mode, env) for _ in range(self.cold_runs)]
            return {key: float(np.median([r[key] for r in runs])) for key in runs[0]
                    if isinstance(runs[0][key], (int, float))}
        warm_p, warm_u, warm_np = median_of("correct"), median_of("off"), median_of("numpy")
        numba_import = median_of("import-numba")["first_ms"]
        extra: dict[str, Any] = {
            "what": "first call in a fresh process; numba kernels cached on disk (load, no compile)",
            "import_abftgemm_ms": warm_p["import_ms"], "import_numba_ms": numba_import,
            "second_call_protected_ms": warm_p["second_ms"],
            "second_call_unprotected_ms": warm_u["second_ms"], "fresh_processes": self.cold_runs}
        self._record("cpu-cold", shape, "float32", warm_p["first_ms"], warm_u["first_ms"],
                     {"numpy.matmul": warm_np["first_ms"]}, extra)
        self.records[-1]["case"] += " first-call warm-cache"
        if self.cold_compile:
            with tempfile.TemporaryDirectory(prefix="abft-numba-cache-") as cache:
                cold = _fresh_process(n, "correct", {"NUMBA_CACHE_DIR": cache})
            self._record("cpu-cold", shape, "float32", cold["first_ms"], warm_u["first_ms"],
                         {"numpy.matmul": warm_np["first_ms"]},
                         {"what": "first call in a fresh process with an empty numba cache "
                                  "(NUMBA_CACHE_DIR=<new dir>): compile + run",
                          "second_call_protected_ms": cold["second_ms"]})
            self.records[-1]["case"] += " first-call empty-cache"
        self.save()


_COLD_SNIPPET = r"""
import json, sys, time
n, mode = int(sys.argv[1]), sys.argv[2]
t0 = time.perf_counter()
if mode == "import-numba":
    import numba
    print(json.dumps({"first_ms": (time.perf_counter() - t0) * 1e3}))
    raise SystemExit
import numpy as np
import abftgemm
t1 = time.perf_counter()
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n), dtype=np.float32) / np.float32(np.sqrt(n))
b = rng.standard_normal((n, n), dtype=np.float32)
call = (lambda: np.matmul(a, b)) if mode == "numpy" else (lambda: abftgemm.matmul(a, b, check=mode))
t2 = time.perf_counter(); call(); t3 = time.perf_counter(); call(); t4 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "first_ms": (t3 - t2) * 1e3,
                  "second_ms": (t4 - t3) * 1e3, "numba_loaded_by_import": "numba" in sys.modules}))
"""


def _fresh_process(n: int, mode: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    root = str(Path(__file__).resolve().parents[1])
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = root + os.pathsep + full_env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _COLD_SNIPPET, str(n), mode], env=full_env,
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _host_info() -> dict[str, Any]:
    """Thread settings and load average: CPU timings mean little on a loaded machine."""
    info: dict[str, Any] = {k: os.environ.get(k) for k in
                            ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS",
                             "MKL_NUM_THREADS") if os.environ.get(k)}
    info["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if hasattr(os, "getloadavg"):
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _import_torch() -> Any:
    try:
        import torch

        if torch.cuda.is_available():
            return torch
    except Exception:
        pass
    return None


def _to_torch(torch: Any, x: Any, dtype: str) -> Any:
    """The same data as a torch CUDA tensor (bf16 through its bits: int16 over DLPack)."""
    if dtype == "bfloat16":
        import cupy

        return torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


# -------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("numpy", "cupy"), default="numpy")
    p.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                   help="write the results file (no PATH: bench/results/<date>-<device>.json)")
    p.add_argument("--quick", action="store_true", help="small shapes and few repeats (< ~60 s)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per function (default: GPU 20, CPU 7; --quick: 5 / 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (GPU 3, CPU 1)")
    p.add_argument("--groups", default=None,
                   help=f"comma-separated groups (default: CPU {','.join(CPU_GROUPS)}; "
                        f"GPU {','.join(GPU_GROUPS)})")
    p.add_argument("--cold-runs", type=int, default=None,
                   help="fresh processes per cpu-cold measurement (default 3; --quick 1)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the empty-numba-cache (compile) measurement of cpu-cold "
                        "(skipped anyway with --quick)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = args.backend == "cupy"
    if gpu:
        import cupy as xp
    else:
        xp = np
    repeats = args.repeats or ((5 if args.quick else 20) if gpu else (3 if args.quick else 7))
    warmup = args.warmup if args.warmup is not None else ((2 if args.quick else 3) if gpu else 1)
    groups = args.groups.split(",") if args.groups else list(GPU_GROUPS if gpu else CPU_GROUPS)
    json_path = None
    if args.json is not None:
        json_path = Path(args.json) if args.json else timing.default_results_path(xp)
    runner = Runner(xp, repeats, warmup, json_path,
                    cold_runs=args.cold_runs or (1 if args.quick else 3),
                    cold_compile=not (args.quick or args.no_compile))
    print(f"# {runner.device}, {timing.now()}, copy {runner.copy_TBps:.4f} TB/s (read+write), "
          f"repeats {repeats}, warmup {warmup}" + (", quick" if args.quick else ""), flush=True)
    for group in groups:
        if group == "cpu-cold":
            if gpu:
                runner.note("cpu-cold skipped on the cupy backend")
                continue
            runner.cold_case(cases("cpu-square", args.quick)[0][0])
            continue
        for shape, dtype in cases(group, args.quick):
            if group == "gemm-chained":
                runner.chained_case(shape, dtype)
            else:
                runner.plain_case(group, shape, dtype)
            runner.free()  # the case's operands went with its frame
    print()
    print(timing.format_table(runner.records))
    for r in runner.records:
        if "ratio_vs_numpy" in r:
            floor = r.get("floor_ratio_vs_numpy")
            print(f"{r['case']} {r['dtype']}: protected / numpy.matmul {r['ratio_vs_numpy']:.3f}"
                  + (f", thin-GEMM floor / numpy.matmul {floor:.3f}" if floor else "")
                  + (f" (target {r['target_ratio']})" if "target_ratio" in r else ""))
    for text in runner.notes:
        print(f"note: {text}")
    runner.save()
    if json_path is not None:
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
