"""CUDA sources shipped with abftgemm and what NVRTC is asked to build from them.

This module does not import CuPy: the runtime loader (:mod:`abftgemm._cuda`) and the GPU-less
compile check (``scripts/compile_kernels.py``) both read the source files, options and name
expressions from here, so the check compiles exactly what the runtime compiles.
"""
from __future__ import annotations

from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent

#: Options passed to ``cupy.RawModule``; CuPy adds its include paths, ``-ftz=true`` and the arch.
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)

#: NumPy dtype name -> CUDA element type the kernel templates are instantiated for.
CUDA_TYPES: dict[str, str] = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
                              "float64": "double"}

REDUCE_FILE = "reduce.cu"
REDUCE_INIT = "abft_reduce_init"
ROW_REDUCE = "abft_row_reduce"
COL_REDUCE = "abft_col_reduce"
FLAG = "abft_flag"

PLAN_FILE = "plan.cu"
#: The two verification launches of a planned product (abftgemm._cuda_plan).
PLAN_PREDICT = "abft_plan_predict"
PLAN_OBSERVE_FLAG = "abft_plan_observe_flag"


def instance(kernel: str, dtype_name: str) -> str:
    """The name expression of template ``kernel`` instantiated for NumPy dtype ``dtype_name``."""
    return f"{kernel}<{CUDA_TYPES[dtype_name]}>"


#: Source file -> every name expression compiled from it.
MODULES: dict[str, tuple[str, ...]] = {
    REDUCE_FILE: (REDUCE_INIT, FLAG)
    + tuple(instance(k, t) for k in (ROW_REDUCE, COL_REDUCE) for t in CUDA_TYPES),
    PLAN_FILE: tuple(instance(k, t) for k in (PLAN_PREDICT, PLAN_OBSERVE_FLAG) for t in CUDA_TYPES),
}


#: Device code every source needs (checksum accumulation), prepended rather than #include-d:
#: CuPy's kernel cache is keyed on the source text, which would not see a changed header.
PRELUDE = "checksum_acc.cuh"


def source(filename: str) -> str:
    """The text NVRTC compiles for ``filename`` (a key of :data:`MODULES`): prelude + file."""
    return (KERNEL_DIR / PRELUDE).read_text() + "\n" + (KERNEL_DIR / filename).read_text()
