"""PyTorch tensors as the array modules see them, and the thread policy of a pass on them.

On the CPU a pass runs the library's own GEMMs (:mod:`abftgemm._cpu_triangles`: the attention
products) as PyTorch's GEMM on the arrays' memory, on PyTorch's intra-op threads as the
unprotected layer's products run; NumPy's BLAS, next to PyTorch's spinning threads, gets one
thread (:mod:`abftgemm.threads`). The checks verify what that GEMM wrote as any product.

Shared by the PyTorch wrappers (:mod:`attention.torch`, :mod:`attention.torch_core`,
:mod:`attention.torch_linear`) and the bodies of their custom operators.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from abftgemm._cpu_triangles import gemm_engine
from abftgemm._torch import to_array
from abftgemm.threads import blas_scope


class _CpuPass:
    """The thread policy and GEMM engine of a pass on CPU tensors."""

    __slots__ = ("_scopes",)

    def __init__(self) -> None:
        self._scopes = (blas_scope(torch.get_num_threads()), gemm_engine(torch_gemm))

    def __enter__(self) -> None:
        for scope in self._scopes:
            scope.__enter__()

    def __exit__(self, *exc: object) -> None:
        for scope in reversed(self._scopes):
            scope.__exit__(*exc)


def threads(t: torch.Tensor) -> _CpuPass | contextlib.nullcontext:
    """The library's thread policy for a pass on ``t``'s device: on the CPU, PyTorch's intra-op
    threads count as busy cores (:mod:`abftgemm.threads`) and the library's GEMMs run as
    :func:`torch_gemm`."""
    return _CpuPass() if t.is_cpu else contextlib.nullcontext()


def torch_gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a @ b`` by PyTorch's GEMM on the arrays' memory (``out`` may be a strided view)."""
    torch.matmul(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))


def array(t: torch.Tensor) -> Any:
    return to_array(t.detach(), "attention input")


def eager(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on ``tensors`` may skip its custom operator's dispatch and run the
    operator's bodies under a ``torch.autograd.Function``: not while ``torch.compile`` or a
    tracer records the call, and only on plain tensors and Parameters on a real device (not
    fake, meta or other tensor subclasses)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return all(t is None or (type(t) in _PLAIN and t.device.type != "meta") for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
