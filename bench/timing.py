"""Shared timing helpers for the benchmarks (GEMM now, attention later).

Conventions:

- every time is a median in milliseconds over ``repeats`` timed calls after ``warmup`` untimed ones;
- CPU times use :func:`time.perf_counter` (or the ``clock`` given); GPU times use a pair of CUDA
  events around each call (recorded on the current CuPy stream) and synchronize on the end event;
- bandwidth is a device-to-device copy, counted as bytes read + bytes written, in TB/s (1e12 B/s);
  a *floor* is ``nbytes`` moved at that bandwidth;
- CuPy is imported only inside functions, so this module imports on a machine without CUDA.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

Fn = Callable[[], Any]


# ------------------------------------------------------------------------------------ timing


def time_cpu(fn: Fn, repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in ms (``time.perf_counter``)."""
    return time_many({"fn": fn}, repeats, warmup, gpu=False)["fn"]


def time_gpu(fn: Fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median GPU time of ``fn()`` in ms, from CUDA events on the current CuPy stream."""
    return time_many({"fn": fn}, repeats, warmup, gpu=True)["fn"]


def time_many(fns: Mapping[str, Fn], repeats: int, warmup: int, *, gpu: bool,
              events: Callable[[], tuple[Any, Any]] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median ms of each function, timed in interleaved rounds, the rounds' orders those of a
    balanced Latin square (:func:`round_order`).

    Interleaving puts clock and thermal drift on every function alike, which matters for the
    protected/unprotected ratio more than for either time alone. Varying the order so that every
    function runs right after every other as often puts what one leaves behind (a thread pool
    still spinning after PyTorch's or OpenBLAS's work, a cache full of its data) on every
    function alike; in one fixed order (or its rotations, which keep each function's
    predecessor) it would fall on the same function every round. ``events``, when given, makes a
    ``(start, stop)`` pair of objects with ``record()``, ``synchronize()`` and
    ``elapsed_time(stop)`` (used for PyTorch, whose work runs on PyTorch's own stream).
    ``clock`` times CPU calls (seconds; :func:`time.thread_time` for one thread's CPU time).
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    for _ in range(max(warmup, 0)):
        for fn in fns.values():
            fn()
    if gpu:
        _synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(repeats):
        for i in round_order(r, len(items)):
            name, fn = items[i]
            samples[name].append(_time_once_gpu(fn, events) if gpu else _time_once_cpu(fn, clock))
    return {name: statistics.median(v) for name, v in samples.items()}


def round_order(r: int, n: int) -> list[int]:
    """Round ``r``'s order of ``n`` functions in a balanced Latin square (Williams' design): over
    ``n`` consecutive rounds (``2 n`` when ``n`` is odd) each function runs right after each
    other exactly once."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = [(x + r) % n for x in first]
    return row[::-1] if n % 2 and (r // n) % 2 else row


def _time_once_cpu(fn: Fn, clock: Callable[[], float]) -> float:
    t0 = clock()
    fn()
    return (clock() - t0) * 1e3


def _cupy_events() -> tuple[Any, Any]:
    import cupy

    return cupy.cuda.Event(), cupy.cuda.Event()


def _time_once_gpu(fn: Fn, events: Callable[[], tuple[Any, Any]] | None) -> float:
    start, stop = (events or _cupy_events)()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    if type(start).__module__.startswith("torch"):  # torch.cuda.Event
        return float(start.elapsed_time(stop))
    import cupy

    return float(cupy.cuda.get_elapsed_time(start, stop))


def _synchronize() -> None:
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    cupy.cuda.Device().synchronize()


def torch_events() -> tuple[Any, Any]:
    """A ``(start, stop)`` pair of ``torch.cuda.Event(enable_timing=True)`` for :func:`time_many`."""
    import torch

    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


# --------------------------------------------------------------------------------- bandwidth


def copy_bandwidth_TBps(xp: Any = np, nbytes: int | None = None, repeats: int | None = None) -> float:
    """Copy bandwidth in TB/s (bytes read + bytes written per second, 1 TB = 1e12 B).

    On CuPy: a device-to-device copy of a ``nbytes`` buffer (default 1 GiB), timed with CUDA
    events, median of ``repeats`` (default 20). On NumPy: ``numpy.copyto`` of a 256 MiB buffer
    (default), perf_counter, median of ``repeats`` (default 7). Counting read + write is how
    bench/NOTES.md quotes copy bandwidths (4.12 TB/s on the H200).
    """
    if _is_cupy(xp):
        import cupy

        nbytes = nbytes or (1 << 30)
        src = cupy.ones(nbytes // 4, dtype=cupy.float32)  # touched, never zeros
        dst = cupy.empty_like(src)
        ms = time_gpu(lambda: cupy.copyto(dst, src), repeats or 20, 3)
        moved = 2 * src.nbytes
        del src, dst
        cupy.get_default_memory_pool().free_all_blocks()
    else:
        nbytes = nbytes or (256 << 20)
        src = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.empty_like(src)
        ms = time_cpu(lambda: np.copyto(dst, src), repeats or 7, 1)
        moved = 2 * src.nbytes
        del src, dst
    return moved / (ms * 1e-3) / 1e12


def floor_ms(nbytes: float, TBps: float) -> float:
    """Time to move ``nbytes`` at ``TBps`` (TB/s), in ms."""
    return float(nbytes) / (TBps * 1e12) * 1e3


# ------------------------------------------------------------------------------------ memory


def peak_memory_bytes(fn: Fn) -> dict[str, int]:
    """Device memory a call of ``fn`` needs beyond what is already in use.

    CuPy's pool does not track a high-water mark, so: free the cached blocks, call ``fn``,
    synchronize, and report how much the pool grew (``reserved``: an upper bound on the peak of the
    temporaries, since a freed block is reused rather than released) and how many bytes stay used
    afterwards (``retained``: results still referenced, e.g. the returned product if kept).
    """
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    used0, total0 = pool.used_bytes(), pool.total_bytes()
    result = fn()
    _synchronize()
    out = {"reserved": int(pool.total_bytes() - total0), "retained": int(pool.used_bytes() - used0)}
    del result
    return out


def free_gpu_memory() -> None:
    """Release every cached block of CuPy's default pools (call between benchmark cases)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


# ------------------------------------------------------------------------------------ device


def _is_cupy(xp: Any) -> bool:
    return getattr(xp, "__name__", "") == "cupy"


def device_name(xp: Any = np) -> str:
    """GPU name (CuPy) or CPU model (NumPy), e.g. ``NVIDIA H200`` or ``AMD EPYC (2 cores)``."""
    if _is_cupy(xp):
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "cpu"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} ({cores} cores)"


def slug(text: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``: lowercase, runs of other characters become one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def today() -> str:
    """Local date, ``YYYY-MM-DD``."""
    return _dt.date.today().isoformat()


def now() -> str:
    """Local date and time, ISO 8601 to the second."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def default_results_path(xp: Any = np, root: str | os.PathLike = "bench/results") -> Path:
    """``bench/results/<YYYY-MM-DD>-<device-slug>.json`` (``-cpu`` for NumPy runs)."""
    tag = slug(device_name(xp)) if _is_cupy(xp) else "cpu"
    return Path(root) / f"{today()}-{tag}.json"


# ----------------------------------------------------------------------------------- results


def make_record(group: str, case: str, dtype: str, shape: Iterable[int], protected_ms: float,
                unprotected_ms: float, floor: float, peers: Mapping[str, Any] | None = None,
                **extra: Any) -> dict[str, Any]:
    """One result record; ``ratio`` is protected / unprotected. Extra keys are kept as given."""
    record = {"group": group, "case": case, "dtype": dtype, "shape": [int(s) for s in shape],
              "protected_ms": float(protected_ms), "unprotected_ms": float(unprotected_ms),
              "ratio": float(protected_ms) / float(unprotected_ms) if unprotected_ms else None,
              "floor_ms": float(floor), "peers": dict(peers or {})}
    record.update(extra)
    return record


def write_results(path: str | os.PathLike, device: str, records: list[dict[str, Any]],
                  copy_TBps: float, **meta: Any) -> Path:
    """Write ``{"device","date","copy_TBps","records":[...]}`` (plus ``meta`` keys) as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"device": device, "date": now(), "copy_TBps": float(copy_TBps), **meta,
           "records": list(records)}
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n", encoding="utf-8")
    return path


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def format_table(records: list[dict[str, Any]]) -> str:
    """Aligned text table: group, case, dtype, protected, unprotected, ratio, floor, peers."""
    header = ["group", "case", "dtype", "prot ms", "unprot ms", "ratio", "floor ms", "peers (ms)"]
    rows = [header]
    for r in records:
        peers = ", ".join(f"{k} {_fmt(v)}" for k, v in r.get("peers", {}).items())
        rows.append([r["group"], r["case"], r["dtype"], _fmt(r["protected_ms"]),
                     _fmt(r["unprotected_ms"]), _fmt(r["ratio"], ratio=True), _fmt(r["floor_ms"]),
                     peers])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _fmt(v: Any, ratio: bool = False) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    v = float(v)
    if ratio:
        return f"{v:.3f}"
    if v >= 100:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.3f}"
    return f"{v:.4f}"
