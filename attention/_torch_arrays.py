"""PyTorch tensors as the array modules see them, and the thread policy of a pass on them.

Shared by the PyTorch wrappers (:mod:`attention.torch`, :mod:`attention.torch_core`,
:mod:`attention.torch_linear`) and the bodies of their custom operators.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

from abftgemm.tensors import to_array
from abftgemm.threads import blas_scope


def threads(t: torch.Tensor) -> blas_scope | contextlib.nullcontext:
    """The library's thread policy for a pass on ``t``'s device: on the CPU, PyTorch's intra-op
    threads count as busy cores (:mod:`abftgemm.threads`)."""
    return blas_scope(torch.get_num_threads()) if t.is_cpu else contextlib.nullcontext()


def recomputing() -> bool:
    """Whether autograd runs a backward on this thread: a forward now is the recomputation of
    a checkpointed one (activation checkpointing), whose findings add to the step's report
    instead of replacing it."""
    return torch._C._current_graph_task_id() != -1


def array(t: torch.Tensor) -> Any:
    return to_array(t.detach(), "attention input")


def mask_array(t: torch.Tensor) -> Any:
    """The array of a mask tensor whose values the backward reads: a copy where the core would
    otherwise hold a view of the tensor's memory (a float64 mask; the core converts others to a
    float64 array of its own). A compiler reuses the memory of a tensor the autograd graph did
    not save, and a caller may change it in place: the backward reads the mask of the forward
    (as ``scaled_dot_product_attention`` does), whatever happens to the tensor."""
    a = array(t)
    return a.copy() if t.dtype == torch.float64 else a


def autocast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` cast to the ``torch.autocast`` dtype of their device where autocast is on and
    all of them are floating point (as PyTorch's own layers run under it), else as given;
    float64 tensors are never cast (as autocast leaves them); a tensor passed twice is cast
    once, so self-attention's one input stays one tensor."""
    given = [t for t in tensors if t is not None]
    device = given[0].device.type
    if not _autocast_available(device) or not torch.is_autocast_enabled(device) \
            or not all(t.is_floating_point() for t in given):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    cast: dict[int, torch.Tensor] = {}
    for t in given:
        if id(t) not in cast:
            cast[id(t)] = t if t.dtype == torch.float64 else t.to(dtype)
    return tuple(None if t is None else cast[id(t)] for t in tensors)


def _autocast_available(device: str) -> bool:
    """Whether ``torch.autocast`` knows device type ``device``: ``torch.is_autocast_enabled``
    raises for the others (``meta``, on which the layers compute shapes only)."""
    available = getattr(torch.amp, "is_autocast_available", None)  # PyTorch >= 2.4
    return device in ("cpu", "cuda") if available is None else available(device)


def dropout_arrays(drawn: torch.Tensor | None) -> tuple[Any, int | None]:
    """``(dropout_keep, dropout_seed)`` of the operators' dropout argument (as
    :func:`attention.torch_functional._dropout_draw` draws it): a bool mask becomes the array
    ``dropout_keep``, an int64 tensor ``(1,)`` the seed of the fused core's keep decisions."""
    if drawn is None:
        return None, None
    if drawn.dtype == torch.int64 and tuple(drawn.shape) == (1,):
        return None, int(drawn.item())
    return array(drawn).copy(), None  # the unfused backward reads it: mask_array's reasons


def eager(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on ``tensors`` may skip its custom operator's dispatch and run the
    operator's bodies under a ``torch.autograd.Function``: not while ``torch.compile`` or a
    tracer records the call, and only on plain tensors and Parameters on a real device (not
    fake, meta or other tensor subclasses)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return all(t is None or (type(t) in _PLAIN and t.device.type != "meta") for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def first_order(backward: Callable[..., Any]) -> Callable[..., Any]:
    """An eager ``autograd.Function.backward`` that refuses ``create_graph=True`` (grad mode on
    in the backward): the protected backward is not differentiable, and under
    ``once_differentiable`` a gradient of a loss linear in the output came back without a graph,
    so a gradient penalty trained on the first-order gradient alone, silently; on the custom
    operators' eager backward it names the cause, where PyTorch's "no autograd formula" error
    came only when the first gradient was differentiated. Not while a compiler traces the
    backward (its graph, not grad mode, decides there)."""
    @functools.wraps(backward)
    def checked(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            raise RuntimeError(
                "second-order gradients (create_graph=True) are not supported by the protected "
                "attention and linear layers: their backward is not differentiable")
        return backward(ctx, *grads)
    return checked


def refuse_weights_gradient(d_weights: torch.Tensor | None) -> None:
    """Raise where a loss reached the attention weights a protected call returned (a non-zero
    gradient): the protected backward has no path for it, and dropping it would train on a
    wrong gradient without a word."""
    if d_weights is not None and d_weights.numel() and bool(torch.any(d_weights != 0)):
        raise NotImplementedError(
            "a loss reached the attention weights of a protected attention call, and their "
            "gradient is not propagated: detach the weights (weights.detach()) for such a loss, "
            "or compute it with an unprotected attention module")
