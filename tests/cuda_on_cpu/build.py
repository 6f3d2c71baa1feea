"""Compile CUDA C sources for the CPU with the host C++ compiler, cached by content hash.

:func:`runtime_library` builds the SIMT runtime (``simt_runtime.cpp``, uninstrumented) once;
:func:`kernel_library` builds one CUDA source with its name expressions: the source as NVRTC
sees it, after ``simt.h``, compiled with ``-fsanitize=thread`` instrumentation (the runtime's hooks
check every load and store) and linked without libtsan, plus one ``simt_launch_<i>`` entry point
per name expression. Libraries go to ``$ABFT_SIMT_CACHE`` (default ``~/.cache/abftgemm-simt``),
named by the hash of everything that goes into them, so an edited kernel is rebuilt and an
unchanged one is not.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
# -ffp-contract=off: no fused multiply-adds the source did not ask for; -fno-strict-aliasing: the
# kernels reinterpret 16-byte vectors as element arrays, as CUDA allows.
COMMON_FLAGS = ("-std=c++20", "-O2", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing",
                "-fno-threadsafe-statics", "-Wno-unknown-pragmas")
KERNEL_FLAGS = ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0")


class BuildError(RuntimeError):
    """The host compiler rejected a source; the message holds its diagnostics."""


def cache_dir() -> Path:
    path = Path(os.environ.get("ABFT_SIMT_CACHE", Path.home() / ".cache" / "abftgemm-simt"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compiler_version() -> str:
    return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{what} failed ({' '.join(cmd[:2])} ...):\n{done.stderr[-6000:]}")


def _publish(tmp: Path, target: Path) -> Path:
    os.replace(tmp, target)  # atomic: parallel builds of the same library do not tear it
    return target


def runtime_library() -> Path:
    """Path of the built SIMT runtime."""
    source = (HERE / "simt_runtime.cpp").read_text() + (HERE / "simt_abi.h").read_text()
    target = cache_dir() / f"libsimt-{_digest(source, _compiler_version(), *COMMON_FLAGS)}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lib.so"
        _run([CXX, *COMMON_FLAGS, "-shared", "-I", str(HERE), str(HERE / "simt_runtime.cpp"),
              "-o", str(out), "-ldl"], "building the SIMT runtime")
        return _publish(out, target)


def kernel_source(code: str, name_expressions: tuple[str, ...], filename: str) -> str:
    """The translation unit for ``code``: simt.h, the source, one launcher per name expression."""
    lines = ['#include "simt.h"', f'#line 1 "{filename}"', code, "",
             "namespace { char simt_anchor; }  // finds this module's .bss (shared memory)"]
    for i, expr in enumerate(name_expressions):
        lines.append(f'extern "C" __attribute__((visibility("default"))) SIMT_UNCHECKED int '
                     f"simt_launch_{i}(const SimtLaunch* l) {{ return simt::launch(&{expr}, l, "
                     f"&simt_anchor); }}")
    return "\n".join(lines) + "\n"


def kernel_library(code: str, name_expressions: tuple[str, ...], filename: str = "kernel.cu",
                   defines: tuple[str, ...] = ()) -> Path:
    """Path of the built module of ``code``; entry point ``simt_launch_<i>`` launches
    ``name_expressions[i]``."""
    unit = kernel_source(code, name_expressions, filename)
    header = (HERE / "simt.h").read_text() + (HERE / "simt_abi.h").read_text()
    flags = (*COMMON_FLAGS, *KERNEL_FLAGS, *(f"-D{d}" for d in defines))
    target = cache_dir() / f"kernels-{_digest(unit, header, _compiler_version(), *flags)}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        src, obj, lib = Path(tmp) / "unit.cpp", Path(tmp) / "unit.o", Path(tmp) / "lib.so"
        src.write_text(unit)
        _run([CXX, *flags, "-I", str(HERE), "-I", str(HERE / "include"), "-c", str(src), "-o",
              str(obj)], f"compiling {filename} for the CPU")
        _run([CXX, "-shared", str(obj), "-o", str(lib)], f"linking {filename}")
        return _publish(lib, target)


def clear_cache() -> None:
    """Remove every cached library (they are rebuilt on demand)."""
    shutil.rmtree(cache_dir(), ignore_errors=True)
