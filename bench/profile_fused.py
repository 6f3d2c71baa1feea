"""Where the fused attention core's time goes where it runs, function by function: its forward
and backward in a loop on one thread (or, with ``--layer``, the causal layer's training step,
``bench/attention.py``'s, on the policy's threads), sampled by Linux ``perf`` with a symbol map
of every numba function, once unprotected (``check="off"``) and once checked (``"correct"``).

    PYTHONPATH=. python bench/profile_fused.py [--shape 1x8x1024x64] [--seconds 8] [--top 30]
                                               [--layer]

Prints the CPU, then per function (numba kernels by module and name, the BLAS kernels and the
rest by their symbol, a stripped library's code by the library's name) the milliseconds of CPU
time one forward + backward spends in it in each mode (the calling thread's for the core, the
process's for the layer), and the difference: what the checks cost in place, beside what
``bench/fused_tiles.py`` measures on one isolated tile. In ``--layer`` runs the OpenMP pool's
waiting shows as its library (``libgomp``): the worker spinning while the calling thread runs
alone. Numba loads cached functions as object code, without the modules whose
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
from collections.abc import Callable
from pathlib import Path

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


def _core(shape: tuple[int, ...]) -> Callable[[str], None]:
    """The fused core's forward + backward on random operands, one thread."""
    import numpy as np

    import abftgemm
    from attention.context import Context
    from attention.fused import fused_backward, fused_forward
    from attention.workspace import Workspace
    batch, heads, seq, d = shape
    abftgemm.set_threads(1)
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((batch * heads, seq, d)).astype(np.float32)
                   for _ in range(4))
    ws = Workspace()

    def call(mode: str) -> None:
        ctx = Context(check=mode)
        _, saved = fused_forward(q, k, v, ctx, causal=True, workspace=ws)
        fused_backward(saved, do, ctx, ws)
    return call


def _layer(shape: tuple[int, ...]) -> Callable[[str], None]:
    """The causal layer's forward + backward, ``bench/attention.py``'s case."""
    import numpy as np

    from bench.attention import Case
    case = Case(np, shape, "float32")
    return case.both


def profile(call: Callable[[str], None], mode: str, seconds: float,
            clock: Callable[[], float]) -> tuple[dict, float]:
    """``perf``'s share of each symbol over ``seconds`` of calls in ``mode``, and the CPU ms a
    call by ``clock`` (this thread's, or the process's)."""
    handle, record = tempfile.mkstemp(prefix="abft-perf-", suffix=".data")
    os.close(handle)
    perf = subprocess.Popen(["perf", "record", "-q", "-p", str(os.getpid()), "-o", record],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches
    calls, start, wall = 0, clock(), time.perf_counter()
    while time.perf_counter() - wall < seconds:
        call(mode)
        calls += 1
    per_call = (clock() - start) / calls * 1e3
    perf.send_signal(signal.SIGINT)
    perf.wait()
    report = subprocess.run(["perf", "report", "-i", record, "--no-children", "--sort",
                             "dso,sym", "--stdio"], capture_output=True, text=True,
                            check=True).stdout
    os.unlink(record)
    shares: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        found = re.match(r"\s*([\d.]+)%\s+(.+?)\s+\[[.k]\]\s+(\S+)", line)
        if found:
            share, library, symbol = float(found.group(1)) / 100, found.group(2), found.group(3)
            unnamed = symbol.startswith("0x")  # a stripped library's code: named by the library
            shares[library if unnamed else short_name(symbol)] += share
    return shares, per_call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1x8x1024x64", help="batch x heads x seq x head_dim")
    parser.add_argument("--seconds", type=float, default=8.0, help="sampled seconds a mode")
    parser.add_argument("--top", type=int, default=30, help="functions listed")
    parser.add_argument("--layer", action="store_true",
                        help="the layer's training step instead of the fused core alone")
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
    from bench.timing import device_name
    shape = tuple(int(x) for x in args.shape.split("x"))
    call = (_layer if args.layer else _core)(shape)
    for mode in MODES * 2:  # compile, then warm
        call(mode)
    mapped = write_symbol_map(f"/tmp/perf-{os.getpid()}.map")
    clock = time.process_time if args.layer else time.thread_time
    results = {mode: profile(call, mode, args.seconds, clock) for mode in MODES}
    os.unlink(f"/tmp/perf-{os.getpid()}.map")
    shutil.rmtree(cache, ignore_errors=True)
    what = "the layer's step" if args.layer else "the fused core, one thread"
    print(f"{device_name(np)}, {args.shape} fp32 causal fwd+bwd, {what}, {mapped} numba "
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
