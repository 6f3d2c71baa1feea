"""Compile every CUDA kernel (abftgemm's and attention's) through NVRTC, as CuPy does at run time,
without a GPU.

CuPy's ``RawModule`` compiles with ``core.assemble_cupy_compiler_options`` (include paths, C++
standard), then ``-ftz=true``, then ``-arch=sm_XX --device-as-default-execution-space`` (and
``--pch`` when enabled). Its public ``compile_using_nvrtc`` looks the arch up on the current
device, so it fails on a machine without a GPU; this script therefore appends the last options
itself and runs CuPy's own NVRTC program wrapper, with the sources, options and name expressions
that :mod:`abftgemm.kernels` and :mod:`attention.kernels` give the runtime.

Run ``python scripts/compile_kernels.py [sm_80 sm_90 ...]``; exits non-zero with the NVRTC log on
the first failure.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from abftgemm import kernels  # noqa: E402
from attention import kernels as attention_kernels  # noqa: E402

#: Every kernel registry: package name -> module with MODULES, source() and NVRTC_OPTIONS.
REGISTRIES = {"abftgemm": kernels, "attention": attention_kernels}


def nvrtc_options(arch: str, options: Sequence[str] = kernels.NVRTC_OPTIONS) -> tuple[str, ...]:
    """The full NVRTC option list CuPy 14 uses for a ``RawModule`` built with ``options``.

    Parameters
    ----------
    arch
        Target such as ``"sm_90"``; CuPy passes ``-arch=sm_XX`` to produce a cubin.
    options
        The options given to ``cupy.RawModule``.
    """
    from cupy._core import core
    from cupy.cuda import compiler, nvrtc

    opts = core.assemble_cupy_compiler_options(tuple(options))
    opts += ("-ftz=true", f"-arch={arch}", "--device-as-default-execution-space")
    # Mirrors compiler._compile_using_nvrtc_no_warning: PCH only changes compile speed, but the
    # point of this check is to hand NVRTC what the runtime hands it.
    if compiler._use_pch and nvrtc.getVersion() >= (12, 8):
        opts += ("--pch",)
    return opts


def compile_source(
    source: str, name_expressions: Iterable[str], arch: str, filename: str = "kernel.cu",
    options: Sequence[str] = kernels.NVRTC_OPTIONS,
) -> dict[str, str]:
    """Compile ``source`` for ``arch`` and return name expression -> lowered (mangled) name.

    Raises
    ------
    RuntimeError
        With the NVRTC log and the options used, if compilation fails.
    """
    from cupy.cuda import compiler

    names = tuple(name_expressions)
    opts = nvrtc_options(arch, options)
    program = compiler._NVRTCProgram(
        source, filename, name_expressions=names or None, method="cubin"
    )
    try:
        _, mapping = program.compile(opts)
    except compiler.CompileException as e:
        raise RuntimeError(
            f"NVRTC failed to compile {filename} for {arch}\noptions: {' '.join(opts)}\n{e}"
        ) from e
    return mapping or {}


def ptx(source: str, name_expressions: Iterable[str], arch: str = "compute_90",
        filename: str = "kernel.cu", options: Sequence[str] = kernels.NVRTC_OPTIONS) -> str:
    """The PTX NVRTC makes of ``source`` for virtual ``arch``, with the runtime's options (as
    :func:`compile_source`, which builds a cubin instead)."""
    from cupy.cuda import compiler

    program = compiler._NVRTCProgram(source, filename, name_expressions=tuple(name_expressions)
                                     or None, method="ptx")
    try:
        text, _ = program.compile(nvrtc_options(arch, options))
    except compiler.CompileException as e:
        raise RuntimeError(f"NVRTC failed to compile {filename} to PTX for {arch}\n{e}") from e
    return text.decode() if isinstance(text, bytes) else text


def compile_all(archs: Sequence[str] = ("sm_80", "sm_90")) -> list[str]:
    """Compile every file of every registry in :data:`REGISTRIES` for each arch in ``archs``.

    Returns
    -------
    list of str
        One ``"package/file arch name_expression"`` line per compiled kernel.

    Raises
    ------
    RuntimeError
        With the NVRTC log, on the first file that fails to compile.
    """
    done = []
    for package, registry in REGISTRIES.items():
        for filename, names in registry.MODULES.items():
            path = f"{package}/{filename}"
            for arch in archs:
                compile_source(registry.source(filename), names, arch, path,
                               registry.NVRTC_OPTIONS)
                done += [f"{path} {arch} {name}" for name in names]
    return done


def main(argv: Sequence[str]) -> int:
    """Compile for the archs in ``argv`` (default sm_80 and sm_90) and print what was built."""
    try:
        built = compile_all(tuple(argv) or ("sm_80", "sm_90"))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print("\n".join(built))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
