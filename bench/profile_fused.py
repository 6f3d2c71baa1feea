"""Where the fused attention core's time goes where it runs, function by function: its forward
and backward in a loop on one thread, sampled by Linux ``perf`` with a symbol map of every
numba function, once unprotected (``check="off"``) and once checked (``"correct"``).

    PYTHONPATH=. python bench/profile_fused.py [--shape 1x8x1024x64] [--seconds 8] [--top 30]

Prints the CPU, then per function (numba kernels by module and name, the BLAS kernels and the
rest by their symbol) the milliseconds of one forward + backward each mode spends in it, and
the difference: what the checks cost in place, beside what ``bench/fused_tiles.py`` measures on
one isolated tile. Numba loads cached functions as object code, without the modules whose
addresses the map needs, so everything is compiled afresh into a temporary cache first (about
a minute). Needs ``perf`` and leave to record this process (``perf_event_paranoid`` <= 2).
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

MODES = ("off", "correct")


def short_name(symbol: str) -> str:
    """``attention._cpu_fused._probs_ratio`` for numba's mangled ``_ZN9attention10_cpu_fused12
    _probs_ratioB4v139...``; any other symbol as it is."""
    if not symbol.startswith("_ZN"):
        return symbol
    parts, at = [], 3
    while at < len(symbol) and symbol[at].isdigit():
        digits = re.match(r"\d+", symbol[at:]).group()
        at += len(digits)
        parts.append(symbol[at:at + int(digits)])
        at += int(digits)
    return ".".join(parts) if parts else symbol


def write_symbol_map(path: str) -> int:
    """``perf``'s map of JIT code (``start size name`` a line, hexadecimal) for every function
    of every compiled numba overload in this process; a function's size is the distance to the
    next one's start. Returns the number of functions."""
    from numba.core.registry import CPUDispatcher
    starts: dict[int, str] = {}
    seen: set[int] = set()
    for obj in gc.get_objects():
        if not isinstance(obj, CPUDispatcher):
            continue
        for cres in obj.overloads.values():
            library = cres.library
            if id(library) in seen:
                continue
            seen.add(id(library))
            module = getattr(library, "_final_module", None)
            for fn in module.functions if module is not None else ():
                if not fn.is_declaration:
                    address = library.get_pointer_to_function(fn.name)
                    if address:
                        starts[address] = fn.name
    ordered = sorted(starts)
    ends = ordered[1:] + [ordered[-1] + 4096] if ordered else []
    with open(path, "w") as out:
        out.writelines(f"{here:x} {min(end - here, 1 << 20):x} {starts[here]}\n"
                       for here, end in zip(ordered, ends))
    return len(ordered)


def _call(q: Any, k: Any, v: Any, do: Any, mode: str, ws: Any) -> None:
    from attention.context import Context
    from attention.fused import fused_backward, fused_forward
    ctx = Context(check=mode)
    _, saved = fused_forward(q, k, v, ctx, causal=True, workspace=ws)
    fused_backward(saved, do, ctx, ws)


def profile(mode: str, seconds: float, operands: tuple, ws: Any) -> tuple[dict, float]:
    """``perf``'s share of each symbol over ``seconds`` of calls in ``mode``, and the thread's CPU
    ms a call."""
    handle, record = tempfile.mkstemp(prefix="abft-perf-", suffix=".data")
    os.close(handle)
    perf = subprocess.Popen(["perf", "record", "-q", "-p", str(os.getpid()), "-o", record],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches
    calls, start, wall = 0, time.thread_time(), time.perf_counter()
    while time.perf_counter() - wall < seconds:
        _call(*operands, mode, ws)
        calls += 1
    per_call = (time.thread_time() - start) / calls * 1e3
    perf.send_signal(signal.SIGINT)
    perf.wait()
    report = subprocess.run(["perf", "report", "-i", record, "--no-children", "--sort", "sym",
                             "--stdio"], capture_output=True, text=True, check=True).stdout
    os.unlink(record)
    shares: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        found = re.match(r"\s*([\d.]+)%\s+\[[.k]\]\s+(\S+)", line)
        if found:
            shares[short_name(found.group(2))] += float(found.group(1)) / 100
    return shares, per_call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1x8x1024x64", help="batch x heads x seq x head_dim")
    parser.add_argument("--seconds", type=float, default=8.0, help="sampled seconds a mode")
    parser.add_argument("--top", type=int, default=30, help="functions listed")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        print("perf is not installed (linux-tools): nothing to profile with", file=sys.stderr)
        return 2
    cache = tempfile.mkdtemp(prefix="abft-profile-numba-")
    if "numba" in sys.modules:
        raise RuntimeError("numba was imported before its cache could be moved")
    os.environ["NUMBA_CACHE_DIR"] = cache  # compile afresh: the functions' modules in memory
    import numpy as np
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import abftgemm
    from attention.workspace import Workspace
    from bench.timing import device_name
    batch, heads, seq, d = (int(x) for x in args.shape.split("x"))
    abftgemm.set_threads(1)
    rng = np.random.default_rng(0)
    operands = tuple(rng.standard_normal((batch * heads, seq, d)).astype(np.float32)
                     for _ in range(4))
    ws = Workspace()
    for mode in MODES * 2:  # compile, then warm
        _call(*operands, mode, ws)
    mapped = write_symbol_map(f"/tmp/perf-{os.getpid()}.map")
    results = {mode: profile(mode, args.seconds, operands, ws) for mode in MODES}
    os.unlink(f"/tmp/perf-{os.getpid()}.map")
    shutil.rmtree(cache, ignore_errors=True)
    print(f"{device_name(np)}, {args.shape} fp32 causal fwd+bwd, one thread, {mapped} numba "
          f"functions mapped; ms of one call's CPU time")
    ms = {mode: {name: share * per_call for name, share in shares.items()}
          for mode, (shares, per_call) in results.items()}
    names = sorted(set(ms["off"]) | set(ms["correct"]), key=lambda n: -ms["correct"].get(n, 0))
    print(f"{'function':58s} {'off':>8s} {'correct':>8s} {'added':>8s}")
    for name in names[:args.top]:
        off, on = ms["off"].get(name, 0.0), ms["correct"].get(name, 0.0)
        print(f"{name[:58]:58s} {off:8.2f} {on:8.2f} {on - off:8.2f}")
    off, on = results["off"][1], results["correct"][1]
    print(f"{'total':58s} {off:8.2f} {on:8.2f} {on - off:8.2f}   (x{on / off:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
