"""Validate matmul operands and view them as 3-D ``(batch or 1, rows, cols)`` arrays."""
from __future__ import annotations

from typing import Any

import numpy as np

from abftgemm.backend import array_module
from abftgemm.checksums import check_dtype


class Operands:
    """Validated operands reshaped to 3-D ``(batch or 1, rows, cols)`` and the shape to restore."""

    def __init__(self, xp: Any, a: Any, b: Any, bias: Any | None, batch_shape: tuple[int, ...],
                 squeeze: tuple[int, ...]):
        self.xp, self.a, self.b, self.bias = xp, a, b, bias
        self.batch_shape, self.squeeze = batch_shape, squeeze
        self.dtype = a.dtype
        self.batch = int(np.prod(batch_shape, dtype=np.int64))
        self.m, self.k, self.n = a.shape[1], a.shape[2], b.shape[2]

    @classmethod
    def prepare(cls, a: Any, b: Any, bias: Any | None) -> "Operands":
        xp = array_module(a, b, bias)
        for label, x in (("a", a), ("b", b)):
            if x.ndim == 0:
                raise ValueError(f"matmul: operand {label} is 0-d; it needs at least one dimension")
        dtype = check_dtype(a.dtype)
        if b.dtype != dtype:
            raise TypeError(f"matmul: operands have different dtypes {a.dtype} and {b.dtype}; "
                            "cast one of them first")
        squeeze = []
        if a.ndim == 1:
            a, squeeze = a[None, :], squeeze + [-2]
        if b.ndim == 1:
            b, squeeze = b[:, None], squeeze + [-1]
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(f"matmul: inner dimensions differ: a is {a.shape}, b is {b.shape}")
        try:
            batch_shape = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        except ValueError:
            raise ValueError(f"matmul: batch dimensions do not broadcast: a is {a.shape}, "
                             f"b is {b.shape}") from None
        if bias is not None:
            if bias.shape != (b.shape[-1],):
                raise ValueError(f"matmul: bias must have shape ({b.shape[-1]},), got {bias.shape}")
            if bias.dtype != dtype:
                raise TypeError(f"matmul: bias dtype {bias.dtype} differs from operands' {dtype}")
            bias = xp.ascontiguousarray(bias)
        return cls(xp, _as_3d(xp, a, batch_shape), _as_3d(xp, b, batch_shape), bias, batch_shape,
                   tuple(squeeze))

    def restore(self, out: Any) -> Any:
        c = out.reshape(self.batch_shape + (self.m, self.n))
        for axis in self.squeeze:
            c = c.squeeze(axis) if axis == -1 else c.squeeze(-2)
        return c


def _as_3d(xp: Any, x: Any, batch_shape: tuple[int, ...]) -> Any:
    """``x`` as ``(batch, r, c)`` or ``(1, r, c)`` (broadcast), copying only if it must."""
    r, c = x.shape[-2:]
    if int(np.prod(x.shape[:-2], dtype=np.int64)) == 1:
        return x.reshape(1, r, c)
    if x.shape[:-2] != batch_shape:  # partial broadcast, e.g. (2,1,m,k) against (1,3,k,n)
        x = xp.broadcast_to(x, batch_shape + (r, c))
    return x.reshape(-1, r, c)


def item(op: Operands, b: int) -> Operands:
    """The single product ``b`` of a batched product, as an :class:`Operands` of batch 1."""
    def pick(x: Any) -> Any:
        i = b if x.shape[0] > 1 else 0
        return x[i:i + 1]
    return Operands(op.xp, pick(op.a), pick(op.b), op.bias, (1,), ())
