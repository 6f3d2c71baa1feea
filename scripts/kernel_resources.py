"""Registers, spills, stack and shared memory of every CUDA kernel, from ``ptxas -v`` through
NVRTC (no GPU needed): the sources, options and name expressions the runtime compiles.

Run ``python scripts/kernel_resources.py [sm_90]``; prints a Markdown table (bench/NOTES.md).
"""
from __future__ import annotations

import io
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compile_kernels  # noqa: E402

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?"
                   r"(?:, \d+ bytes cumulative stack size)?(?:, (\d+) bytes smem)?")


def resources(arch: str = "sm_90") -> list[tuple[str, int, int, int, int]]:
    """``(name expression, registers, spill bytes (stores + loads), stack bytes, smem bytes)``
    per kernel."""
    from cupy.cuda import compiler

    rows = []
    for package, registry in compile_kernels.REGISTRIES.items():
        for filename, names in registry.MODULES.items():
            options = compile_kernels.nvrtc_options(arch, registry.NVRTC_OPTIONS)
            program = compiler._NVRTCProgram(registry.source(filename), f"{package}/{filename}",
                                             name_expressions=names, method="cubin")
            log = io.StringIO()
            _, mapping = program.compile(options + ("--ptxas-options=-v",), log_stream=log)
            by_symbol = {v: k for k, v in mapping.items()}
            current, frame = None, None
            for line in log.getvalue().splitlines():
                if m := _ENTRY.search(line):
                    current = by_symbol.get(m.group(1), m.group(1))
                elif (m := _FRAME.search(line)) and current:
                    frame = tuple(int(g) for g in m.groups())
                elif (m := _USED.search(line)) and current and frame:
                    rows.append((current, int(m.group(1)), frame[1] + frame[2], frame[0],
                                 int(m.group(2) or 0)))
                    current, frame = None, None
    return rows


def main(argv: list[str]) -> int:
    arch = argv[0] if argv else "sm_90"
    print(f"| kernel ({arch}) | registers | spill bytes | stack bytes | shared bytes |")
    print("|---|---|---|---|---|")
    for name, regs, spills, stack, smem in resources(arch):
        print(f"| `{name}` | {regs} | {spills} | {stack} | {smem} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
