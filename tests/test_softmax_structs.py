"""The softmax kernels' argument structs have the same layout on both sides of a launch.

:mod:`attention.kernels.softmax_structs` declares each struct of ``namespace softmax`` in
``softmax.cu`` as a NumPy dtype, and the kernels read the bytes of those dtypes. The host C++
compiler checks the layouts here (:mod:`struct_layouts`); NVRTC checks them in
``tests/test_kernels_compile.py``; and every launch on the CPU compares each argument's size with
the kernel's parameter.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from attention import kernels
from attention.kernels.softmax_structs import ROWS, STRUCTS
from conftest import CUDA_ON_CPU
from struct_layouts import layout_asserts, swapped


def test_every_struct_the_kernels_take_is_declared_once():
    text = (kernels.KERNEL_DIR / kernels.SOFTMAX_FILE).read_text()
    names = [s.c_name for s in STRUCTS]
    assert set(re.findall(r"softmax::\w+", text)) == set(names)
    assert len(set(names)) == len(names)


@pytest.mark.cuda_on_cpu
@pytest.mark.skipif(CUDA_ON_CPU is None, reason="no CUDA-on-CPU backend here")
def test_the_host_compiler_lays_the_softmax_structs_out_as_numpy():
    from cuda_on_cpu import build

    source = kernels.source(kernels.SOFTMAX_FILE)
    build.kernel_library(source + layout_asserts(STRUCTS), (), "softmax_layout.cu")
    drifted = (swapped(ROWS, "seq_q", "len"),) + STRUCTS[1:]
    with pytest.raises(build.BuildError, match=r"softmax::Rows::len is not at offset 8"):
        build.kernel_library(source + layout_asserts(drifted), (), "softmax_layout.cu")


def test_a_struct_argument_is_one_element_of_its_dtype_with_c_padding():
    rows = ROWS(n=6, seq_q=3, len=5, causal=True)
    assert rows.shape == (1,) and rows.dtype.itemsize == 24  # 20 bytes of fields, 8-aligned
    assert rows.tobytes() == (np.int64(6).tobytes() + np.int32(3).tobytes()
                              + np.int32(5).tobytes() + np.int32(1).tobytes() + bytes(4))
