"""PyTorch tensors in and out of :func:`abftgemm.matmul`, without copies.

CPU tensors become NumPy arrays (``Tensor.numpy`` / ``torch.from_numpy``) and CUDA tensors CuPy
arrays (DLPack) that share their memory; the result comes back as a tensor on the same device
sharing the result array's memory. bfloat16, which NumPy's DLPack import does not know, travels
as its 16-bit patterns. torch is imported only when a tensor is passed (``sys.modules``), so the
package works without it.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, ContextManager, Iterator

import ml_dtypes
import numpy


def is_tensor(x: object) -> bool:
    """True when ``x`` is a torch tensor (without importing torch)."""
    return any_tensor(x)


def any_tensor(*xs: object) -> bool:
    """True when any of ``xs`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and any(isinstance(x, torch.Tensor) for x in xs)


def to_array(t: Any, label: str) -> Any:
    """The NumPy (CPU) or CuPy (CUDA) array sharing ``t``'s memory.

    Raises
    ------
    TypeError
        For a tensor that records gradients (``abftgemm.matmul`` is not differentiable: call it
        under ``torch.no_grad()`` or use ``attention.torch``) or on another device type.
    """
    torch = sys.modules["torch"]
    if t.requires_grad and torch.is_grad_enabled():
        raise TypeError(f"matmul: {label} requires grad, and abftgemm.matmul records no autograd "
                        "graph; call it under torch.no_grad() (or use attention.torch for a "
                        "differentiable protected layer)")
    if t.is_neg() or t.is_conj():  # a lazy negation (torch._neg_view) has no array of its own
        if label == "out":
            raise TypeError(f"matmul: {label} has its negative or conjugate bit set; pass a "
                            "tensor with memory of its own")
        t = t.resolve_neg().resolve_conj()
    if t.is_cpu and t.dtype != torch.bfloat16:
        return t.detach().numpy()  # NumPy's own view of the memory: as DLPack, a tenth the cost
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"matmul: {label} is on {t.device}; abftgemm takes CPU and CUDA tensors")
    # bfloat16 crosses as its bit patterns, bool as bytes (some PyTorch versions export no bool
    # through DLPack)
    bits = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}.get(t.dtype)
    source = t.detach() if bits is None else t.detach().view(bits)
    if t.is_cuda:
        import cupy

        x = cupy.from_dlpack(source)
    else:
        x = source.numpy()
    if bits is None:
        return x
    return x.view(ml_dtypes.bfloat16 if t.dtype == torch.bfloat16 else bool)


def device_scope(t: Any) -> ContextManager[None]:
    """For a CUDA tensor ``t``: a context in which ``t``'s device is current (for PyTorch and
    CuPy) and CuPy launches on PyTorch's current stream of that device, so that work on CUDA
    tensors is ordered with PyTorch's own before and after (tensors written in place, gradients
    handed to autograd). Nothing for other tensors (CPU; :func:`to_array` refuses the rest)."""
    return _cuda_scope(t.device) if t.is_cuda else contextlib.nullcontext()


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (which older PyTorch streams lack)."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self._ptr


@contextlib.contextmanager
def _cuda_scope(device: Any) -> Iterator[None]:
    import cupy

    torch = sys.modules["torch"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index), cupy.cuda.Device(index):
        stream = torch.cuda.current_stream(index)
        with cupy.cuda.Stream.from_external(_StreamHandle(stream.cuda_stream)):
            yield


def to_tensor(x: Any) -> Any:
    """The torch tensor sharing the memory of NumPy or CuPy array (or NumPy scalar) ``x``."""
    torch = sys.modules["torch"]
    if isinstance(x, numpy.generic):  # vector @ vector: a NumPy scalar, as a 0-d tensor
        x = numpy.asarray(x)
    # bfloat16 is a "V" (void) dtype; reading a dtype's name is a Python call, so only for those
    if x.dtype.kind == "V" and x.dtype.name == "bfloat16":
        return to_tensor(x.view(numpy.int16)).view(torch.bfloat16)
    if type(x) is numpy.ndarray and min(x.strides, default=0) >= 0:
        return torch.from_numpy(x)  # shares the memory, as DLPack, at a tenth the cost
    return torch.from_dlpack(x)


def tensor_matmul(matmul: Callable[..., Any], a: Any, b: Any, out: Any | None,
                  bias: Any | None, **options: Any) -> Any:
    """``matmul`` on the arrays behind tensors ``a``, ``b`` (and ``out``, ``bias``); the result
    as a tensor (``out`` itself when given), followed by the report and checksums as arrays.

    Never traced by ``torch.compile``: the call is a graph break, run as written (Dynamo
    tracing into the NumPy and Numba code of the protection failed on its own internals, or
    would rewrite it); ``fullgraph=True`` raises."""
    return _untraced()(matmul, a, b, out, bias, **options)


@functools.cache
def _untraced() -> Callable[..., Any]:
    """:func:`_tensor_matmul` behind ``torch.compiler.disable``, made once."""
    return sys.modules["torch"].compiler.disable(_tensor_matmul)


def _tensor_matmul(matmul: Callable[..., Any], a: Any, b: Any, out: Any | None,
                   bias: Any | None, **options: Any) -> Any:
    if is_tensor(a) and is_tensor(b) and a.dtype != b.dtype:  # as torch.matmul: no promotion
        raise TypeError(f"matmul: a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    written = out if is_tensor(out) else None
    if written is not None:
        _check_out(written)
    with device_scope(next(x for x in (a, b, out, bias) if is_tensor(x))):
        arrays = {label: to_array(x, label) if is_tensor(x) else x
                  for label, x in (("a", a), ("b", b), ("out", out), ("bias", bias))}
        try:
            result = matmul(arrays["a"], arrays["b"], arrays["out"], bias=arrays["bias"],
                            **options)
        except (TypeError, ValueError):
            raise  # refused before anything was written
        except BaseException:
            _written(written)  # out's contents are unspecified: it may have been written
            raise
        _written(written)
        c, *extras = result if isinstance(result, tuple) else (result,)
        c = out if out is not None else to_tensor(c)
    return (c, *extras) if extras else c


def _check_out(out: Any) -> None:
    """Refuse, as PyTorch's ``out=`` does, an ``out`` that PyTorch forbids writing in place:
    an inference tensor outside ``torch.inference_mode``, or one whose elements share memory
    (an expanded tensor: each element would receive the last of the values written to it)."""
    torch = sys.modules["torch"]
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError("matmul: out is an inference tensor, which cannot be written in place "
                         "outside torch.inference_mode(); pass a tensor made outside it (or clone "
                         "it)")
    if any(stride == 0 and size > 1 for stride, size in zip(out.stride(), out.shape)):
        raise ValueError(f"matmul: out (shape {tuple(out.shape)}, strides {out.stride()}) has "
                         "elements that share memory (an expanded tensor); pass a tensor with "
                         "memory of its own for each element (clone it)")


def _written(out: Any | None) -> None:
    """Tell autograd that tensor ``out`` was written in place (its version counter, as
    PyTorch's ``out=`` and in-place operations advance it), so that a backward that saved it
    raises instead of reading the new values."""
    if out is not None:
        sys.modules["torch"]._C._increment_version([out])
