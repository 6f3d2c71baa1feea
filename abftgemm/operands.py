"""Turn what the user passed to ``matmul`` into validated 3-D operands and an output description.

:meth:`Operands.prepare` is the one place where matmul's array semantics live (``np.matmul``'s
for NumPy arrays, ``cupy.matmul``'s for CuPy arrays): array-likes, dtype promotion, byte order,
0-d and 1-D operands, broadcasting, zero sizes and ``out=``. Downstream code sees only
:class:`Operands`, writes :meth:`Operands.buffer` and hands it to :meth:`Operands.deliver`.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from abftgemm.backend import array_module, astype, copy_into, is_cupy_array
from abftgemm.checksums import SUPPORTED_DTYPES

#: NumPy's float matmul loops, in the order it tries them (bfloat16 has no loop of its own).
_FLOAT_LOOPS = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64))
#: ndarray subclasses with matmul rules of their own, which NumPy honours: refused, not converted.
_REFUSED = (np.matrix, np.ma.MaskedArray)


class Operands:
    """Validated operands, viewed as 3-D, and the output the user asked for.

    ``xp`` is ``numpy`` or ``cupy``; ``a`` and ``b`` are ``(batch or 1, m, k)`` and
    ``(batch or 1, k, n)`` of the product's (promoted) ``dtype`` in native byte order, ``bias`` a
    contiguous ``(n,)`` array or None. ``shape`` is the result's: ``batch_shape + (m, n)`` less
    the dimension of a 1-D operand. ``out`` is the user's ``out=``, validated, and ``direct``
    whether the GEMM writes straight into it.
    """

    def __init__(self, xp: Any, a: Any, b: Any, bias: Any | None, batch_shape: tuple[int, ...],
                 shape: tuple[int, ...], out: Any | None = None):
        self.xp, self.a, self.b, self.bias = xp, a, b, bias
        self.batch_shape, self.shape, self.out = batch_shape, shape, out
        self.dtype = a.dtype
        self.batch = math.prod(batch_shape)
        self.m, self.k, self.n = a.shape[1], a.shape[2], b.shape[2]
        self.direct = out is not None and _writable_in_place(xp, out, self)

    @classmethod
    def prepare(cls, a: Any, b: Any, bias: Any | None = None, out: Any | None = None) -> "Operands":
        """Validate and normalize ``a @ b (+ bias)`` into ``out`` (each as :func:`abftgemm.matmul`
        takes it); raise before touching anything: TypeError for an unsupported dtype (named),
        ``np.matrix`` or a masked array, mixed NumPy and CuPy operands, or an ``out`` of the wrong
        kind or dtype; ValueError for a 0-d operand, mismatched inner or batch dimensions, or an
        ``out`` of the wrong shape or read-only."""
        a, b, bias, out = _arrays(a, b, bias, out)
        xp = array_module(a, b, bias)
        for label, x in (("a", a), ("b", b)):
            if x.ndim == 0:
                raise ValueError(f"matmul: operand {label} is 0-d; it needs at least one "
                                 "dimension (use * to scale by a scalar)")
        dtype = _promoted(a=a, b=b, bias=bias)
        a2, b2 = (a[None, :] if a.ndim == 1 else a), (b[:, None] if b.ndim == 1 else b)
        if a2.shape[-1] != b2.shape[-2]:
            raise ValueError(f"matmul: inner dimensions differ: a is {a.shape}, b is {b.shape}")
        try:
            batch_shape = _broadcast(a2.shape[:-2], b2.shape[:-2])
        except ValueError:
            raise ValueError(f"matmul: batch dimensions do not broadcast: a is {a.shape}, "
                             f"b is {b.shape}") from None
        m, n = a2.shape[-2], b2.shape[-1]
        shape = batch_shape + ((m,) if a.ndim > 1 else ()) + ((n,) if b.ndim > 1 else ())
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"matmul: bias must have shape ({n},), got {bias.shape}")
        if out is not None:
            _check_out(xp, out, shape, len(shape) - len(batch_shape), dtype)
        if bias is not None:
            bias = xp.ascontiguousarray(astype(bias, dtype))
        a3, b3 = (_as_3d(xp, astype(x, dtype), batch_shape) for x in (a2, b2))
        return cls(xp, a3, b3, bias, batch_shape, shape, out)

    def buffer(self) -> Any:
        """The C-contiguous ``(batch, m, n)`` array the product is computed in: ``out`` itself
        when it has the result's shape and dtype, is C-contiguous and overlaps no operand; else
        a new array."""
        if self.direct:
            return self.out.reshape(self.batch, self.m, self.n)
        return self.xp.empty((self.batch, self.m, self.n), dtype=self.dtype)

    def deliver(self, buf: Any) -> Any:
        """What ``matmul`` returns for the finished ``buf``: ``out`` (filled), a NumPy scalar for
        NumPy vector @ vector (CuPy returns 0-d arrays), else the result array."""
        result = buf.reshape(self.shape)
        if self.out is None:
            return result[()] if result.ndim == 0 and self.xp is np else result
        if not self.direct:
            copy_into(self.out, result)
        return self.out


def _arrays(a: Any, b: Any, bias: Any | None, out: Any | None) -> tuple[Any, Any, Any, Any]:
    """The inputs as arrays: NumPy array-likes converted, refused array types rejected."""
    if isinstance(out, tuple):  # NumPy's ufuncs also take out=(array,)
        if len(out) != 1:
            raise ValueError(f"matmul: out must be one array, got a tuple of {len(out)}")
        out = out[0]
    for label, x in (("a", a), ("b", b), ("bias", bias), ("out", out)):
        if isinstance(x, _REFUSED):
            raise TypeError(f"matmul: {label} is a {type(x).__name__}, whose own matmul rules a "
                            "protected product cannot follow; pass a plain array (np.asarray for "
                            "a matrix; fill or drop the masked values of a masked array)")
    if any(is_cupy_array(x) for x in (a, b, bias, out)):
        return a, b, bias, out  # as cupy.matmul: no conversion (array_module names a non-array)
    return np.asarray(a), np.asarray(b), None if bias is None else np.asarray(bias), out


def float_dtype(label: str, x: Any, caller: str = "matmul") -> np.dtype:
    """``x``'s dtype in native byte order if supported, else TypeError naming it and ``caller``."""
    dtype = x.dtype.newbyteorder("=")
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(t) for t in SUPPORTED_DTYPES)
        raise TypeError(f"{caller}: {label} has dtype {x.dtype}; abftgemm supports {names} "
                        "(integer, bool, complex and object arrays are not promoted: cast first)")
    return dtype


def _promoted(**arrays: Any) -> np.dtype:
    """The product's dtype: the common dtype when all agree (bfloat16 stays bfloat16, where
    NumPy computes in float32), else the first of NumPy's float matmul loops all cast to safely."""
    dtypes = {float_dtype(label, x) for label, x in arrays.items() if x is not None}
    if len(dtypes) == 1:
        return dtypes.pop()
    return next(t for t in _FLOAT_LOOPS if all(np.can_cast(d, t, "safe") for d in dtypes))


def _check_out(xp: Any, out: Any, shape: tuple[int, ...], core: int, dtype: np.dtype) -> None:
    """Raise unless ``out`` can receive a result of ``shape`` and ``dtype`` (see ``prepare``)."""
    if not (is_cupy_array(out) if xp is not np else isinstance(out, np.ndarray)):
        raise TypeError(f"matmul: out must be a {xp.__name__} array like the operands, "
                        f"got {type(out).__name__}")
    if xp is np:  # the result broadcasts to out's leading dimensions, never the other way round
        loop, result_loop = out.shape[:out.ndim - core], shape[:len(shape) - core]
        fits = (out.shape[out.ndim - core:] == shape[len(shape) - core:]
                and len(loop) >= len(result_loop)
                and all(r in (1, o) for r, o in zip(result_loop[::-1], loop[::-1])))
    else:
        fits = out.shape == shape
    if not fits:
        raise ValueError(f"matmul: out has shape {out.shape}; the product has shape {shape}")
    if xp is np and not out.flags.writeable:
        raise ValueError("matmul: out is read-only")
    if not np.can_cast(dtype, out.dtype, "same_kind") or (
            xp is not np and out.dtype.name == "bfloat16" and dtype != out.dtype):
        raise TypeError(f"matmul: cannot cast the {dtype} product to out's dtype {out.dtype} "
                        "with casting rule 'same_kind'")


def _writable_in_place(xp: Any, out: Any, op: Operands) -> bool:
    """Whether the GEMM may write straight into ``out`` (see :meth:`Operands.buffer`)."""
    if out.shape != op.shape or out.dtype != op.dtype or not out.flags.c_contiguous:
        return False
    for x in (op.a, op.b, op.bias):  # a loop, not any(generator): this runs on every execute
        if x is not None and xp.may_share_memory(out, x):
            return False
    return True


def _broadcast(s: tuple[int, ...], t: tuple[int, ...]) -> tuple[int, ...]:
    """``np.broadcast_shapes(s, t)``, without its cost in the common cases (equal, or one empty)."""
    if s == t or not t:
        return s
    return t if not s else np.broadcast_shapes(s, t)


def _as_3d(xp: Any, x: Any, batch_shape: tuple[int, ...]) -> Any:
    """``x`` as ``(batch, r, c)`` or ``(1, r, c)`` (broadcast), copying only if it must."""
    r, c = x.shape[-2:]
    if math.prod(x.shape[:-2]) == 1:
        return x.reshape(1, r, c)
    if x.shape[:-2] != batch_shape:  # partial broadcast, e.g. (2,1,m,k) against (1,3,k,n)
        x = xp.broadcast_to(x, batch_shape + (r, c))
    return x.reshape(math.prod(batch_shape), r, c)  # not -1: ambiguous when r or c is 0


def item(op: Operands, i: int) -> Operands:
    """The single product ``i`` of a batched product, as an :class:`Operands` of batch 1."""
    a, b = (x[i:i + 1] if x.shape[0] > 1 else x[:1] for x in (op.a, op.b))
    return Operands(op.xp, a, b, op.bias, (1,), (1, op.m, op.n))
