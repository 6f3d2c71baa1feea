"""Every CUDA kernel compiles through NVRTC with the runtime's options; no GPU needed.

Needs CuPy (``cupy-cuda13x``) and an NVRTC library (``nvidia-cuda-nvrtc``); skips only when
CuPy's NVRTC binding cannot be used at all.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from abftgemm import kernels
from attention import kernels as attention_kernels
from attention.kernels.softmax_structs import ROWS, STRUCTS
from struct_layouts import layout_asserts, swapped

ROOT = Path(__file__).resolve().parents[1]


def _nvrtc_missing() -> str | None:
    """Why NVRTC is unusable here, or None when it works."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # ImportError, or the shared library failing to load
        return (
            f"CuPy's NVRTC is unavailable ({type(e).__name__}: {e}); "
            "pip install -e '.[kernels]'"
        )
    return None


# CI installs the "kernels" extra, so there a missing NVRTC is a failure, not a skip.
pytestmark = pytest.mark.skipif(_nvrtc_missing() is not None and not os.environ.get("CI"),
                                reason=str(_nvrtc_missing()))


@pytest.fixture(scope="module")
def compile_kernels():
    spec = importlib.util.spec_from_file_location(
        "compile_kernels", ROOT / "scripts" / "compile_kernels.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_kernel_compiles_for_sm80_and_sm90(compile_kernels):
    built = compile_kernels.compile_all(("sm_80", "sm_90"))
    expected = [
        f"{package}/{f} {arch} {name}"
        for package, registry in (("abftgemm", kernels), ("attention", attention_kernels))
        for f, names in registry.MODULES.items()
        for arch in ("sm_80", "sm_90")
        for name in names
    ]
    assert built == expected
    assert any(line.startswith("attention/softmax.cu") for line in built)


def test_no_widening_to_double_flushes_subnormals(compile_kernels):
    """CuPy compiles with -ftz=true, under which a plain float -> double conversion becomes
    cvt.ftz.f64.f32: subnormal float32 and bfloat16 elements would count as 0 in the float64
    checksums while the products keep them (a false flag repair cannot clear). The kernels widen
    through the float's bits instead; the PTX proves it for every kernel and dtype."""
    for package, registry in compile_kernels.REGISTRIES.items():
        for filename, names in registry.MODULES.items():
            text = compile_kernels.ptx(registry.source(filename), names, "compute_90",
                                       f"{package}/{filename}", registry.NVRTC_OPTIONS)
            assert ".entry" in text
            assert "cvt.ftz.f64" not in text, f"{package}/{filename} flushes when it widens"
    # the check itself sees a flushing conversion
    plain = compile_kernels.ptx(
        "__global__ void k(const float* x, double* y) { y[0] = x[0]; }", ["k"], "compute_90")
    assert "cvt.ftz.f64.f32" in plain


def test_every_dtype_has_both_reductions():
    names = kernels.MODULES[kernels.REDUCE_FILE]
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        assert kernels.instance(kernels.ROW_REDUCE, dtype) in names
        assert kernels.instance(kernels.COL_REDUCE, dtype) in names


def test_every_dtype_has_both_softmax_kernels():
    names = attention_kernels.MODULES[attention_kernels.SOFTMAX_FILE]
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        assert attention_kernels.instance(attention_kernels.SOFTMAX_FORWARD, dtype) in names
        assert attention_kernels.instance(attention_kernels.SOFTMAX_BACKWARD, dtype) in names


def test_nvrtc_lays_the_softmax_structs_out_as_numpy(compile_kernels):
    """The device compiler's layout of the softmax kernels' argument structs is their NumPy
    dtypes' (tests/struct_layouts.py; tests/test_softmax_structs.py checks the host compiler's)."""
    source = attention_kernels.source(attention_kernels.SOFTMAX_FILE)
    compile_kernels.compile_source(source + layout_asserts(STRUCTS), (), "sm_90",
                                   "attention/softmax.cu", attention_kernels.NVRTC_OPTIONS)
    drifted = (swapped(ROWS, "seq_q", "len"),) + STRUCTS[1:]
    with pytest.raises(RuntimeError, match=r"softmax::Rows::len is not at offset 8"):
        compile_kernels.compile_source(source + layout_asserts(drifted), (), "sm_90",
                                       "attention/softmax.cu", attention_kernels.NVRTC_OPTIONS)


def test_every_dtype_has_every_fused_kernel():
    names = attention_kernels.MODULES[attention_kernels.FUSED_FILE]
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for kernel in attention_kernels.FUSED_KERNELS:
            assert attention_kernels.instance(kernel, dtype) in names


def _complete_cuda_headers() -> Path | None:
    """A CUDA toolkit include directory whose mma.h can be used (it has crt/mma.h), or None."""
    roots = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda", *sorted(
        str(p) for p in Path("/usr/local").glob("cuda-*"))]
    for root in filter(None, roots):
        if (Path(root) / "include" / "crt" / "mma.h").is_file():
            return Path(root) / "include"
    return None


@pytest.mark.skipif(_complete_cuda_headers() is None,
                    reason="no CUDA toolkit headers with crt/mma.h on this machine")
def test_the_fused_core_uses_tensor_cores_where_cuda_headers_are_complete(compile_kernels):
    """fused.cu compiles its 16-bit tile products to wmma.mma where CuPy's include path has
    crt/mma.h (a CUDA toolkit), and to FMAs with the headers of the pip wheel, which lack it."""
    source = attention_kernels.source(attention_kernels.FUSED_FILE)
    names = attention_kernels.MODULES[attention_kernels.FUSED_FILE]
    options = attention_kernels.NVRTC_OPTIONS + (f"-I{_complete_cuda_headers()}",)
    text = compile_kernels.ptx(source, names, "compute_90", "attention/fused.cu", options)
    assert "wmma.mma.sync" in text
    assert "cvt.ftz.f64" not in text


def test_options_match_the_runtime(compile_kernels):
    opts = compile_kernels.nvrtc_options("sm_90")
    assert "--std=c++17" in opts
    assert "-ftz=true" in opts
    assert "-arch=sm_90" in opts
    assert "--device-as-default-execution-space" in opts


def test_nvrtc_only_errors_are_caught(compile_kernels):
    # INFINITY comes from a host header: nvcc accepts it, NVRTC does not (docs/design.md, Backends).
    source = "__global__ void k(float* x) { x[0] = INFINITY; }"
    with pytest.raises(RuntimeError, match="INFINITY"):
        compile_kernels.compile_source(source, ["k"], "sm_90")
