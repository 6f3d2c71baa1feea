"""PyTorch tensors as the array modules see them, and the thread policy of a pass on them.

Shared by the PyTorch wrappers (:mod:`attention.torch`, :mod:`attention.torch_core`,
:mod:`attention.torch_linear`) and the bodies of their custom operators.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from abftgemm._torch import to_array
from abftgemm.threads import blas_scope


def threads(t: torch.Tensor) -> blas_scope | contextlib.nullcontext:
    """The library's thread policy for a pass on ``t``'s device: on the CPU, PyTorch's intra-op
    threads count as busy cores (:mod:`abftgemm.threads`)."""
    return blas_scope(torch.get_num_threads()) if t.is_cpu else contextlib.nullcontext()


def array(t: torch.Tensor) -> Any:
    return to_array(t.detach(), "attention input")
