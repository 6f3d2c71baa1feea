"""Each backend implements every method of the protocols of abftgemm/backend.py that it claims.

Checked statically with ``inspect``, without running anything: a method must exist and take the
protocol's parameters by the same names, kinds and order, with a default wherever the protocol
has one; anything it adds must be optional. The CUDA backend's modules import CuPy at the top,
so they are loaded with the CuPy on the machine, or the stand-in of tests/cuda_on_cpu.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import pytest

from abftgemm.backend import Backend, RowPrefixes, Workspace
from conftest import CUDA_ON_CPU, GPU

_OPTIONAL_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def protocol_problems(cls: type, protocol: type) -> list[str]:
    """What ``cls`` lacks of ``protocol`` (empty when it implements all of it)."""
    problems = [f"attribute {name} missing" for name in inspect.get_annotations(protocol)
                if not hasattr(cls, name)]
    for name, wanted in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(wanted):
            continue
        impl = getattr(cls, name, None)
        if not inspect.isfunction(impl):
            problems.append(f"{name} missing")
            continue
        want = list(inspect.signature(wanted).parameters.values())
        got = list(inspect.signature(impl).parameters.values())
        shape = [(p.name, p.kind, p.default is p.empty) for p in want]
        if [(p.name, p.kind, p.default is p.empty) for p in got[:len(want)]] != shape:
            problems.append(f"{name}{inspect.signature(impl)}, protocol "
                            f"{name}{inspect.signature(wanted)}")
        extra = [p.name for p in got[len(want):]
                 if p.default is p.empty and p.kind not in _OPTIONAL_KINDS]
        if extra:
            problems.append(f"{name} requires {extra} beyond the protocol")
    return problems


@contextlib.contextmanager
def _cupy_modules() -> Iterator[None]:
    """CuPy importable: the real one, or the stand-in (skip when neither is usable)."""
    if GPU is not None:
        yield
        return
    if CUDA_ON_CPU is None:
        pytest.skip("no CuPy and no CUDA-on-CPU stand-in")
    from cuda_on_cpu import standin

    with standin.installed():
        yield


def _cpu_classes() -> tuple[type, type]:
    from abftgemm._cpu import CpuBackend
    from abftgemm._cpu_plan import CpuWorkspace

    return CpuBackend, CpuWorkspace


def _cuda_classes() -> tuple[type, type]:
    with _cupy_modules():
        from abftgemm._cuda import CupyBackend
        from abftgemm._cuda_plan import CudaWorkspace

    return CupyBackend, CudaWorkspace


@pytest.mark.parametrize("classes", [_cpu_classes, _cuda_classes], ids=["numpy", "cupy"])
def test_backend_and_workspace_implement_their_protocols(classes: Any):
    backend, workspace = classes()
    assert protocol_problems(backend, Backend) == []
    assert protocol_problems(workspace, Workspace) == []


def test_the_cpu_backend_computes_row_prefixes():
    """The CPU backend's ``row_limits`` returns limits, so it provides what they need."""
    backend, _ = _cpu_classes()
    assert protocol_problems(backend, RowPrefixes) == []


def test_protocol_problems_finds_what_is_missing_or_different():
    class Partial:
        name = "partial"

        def gemm(self, a, b, out, bias, buffers, triangle=None, out_triangle=None):
            """An extra required parameter in the protocol's place."""

        def row_limits(self, m, n, dtype, *, rows=None):
            """An optional extra: fine."""

    problems = protocol_problems(Partial, Backend)
    assert "attribute xp missing" in problems and "synchronize missing" in problems
    assert any(p.startswith("gemm(") for p in problems)
    assert not any(p.startswith("row_limits") for p in problems)
