"""Vectorizable float32 ``exp`` and ``log`` and max reductions for the numba softmax kernels.

LLVM vectorizes a numba loop only when every call in it is inlined and branch-free, and it does
not vectorize floating-point max reductions unless NaNs are excluded (fast-math ``nnan``, which
the kernels cannot promise: non-finite data must pass through). Called in a loop, ``math.exp``
and ``math.log`` are scalar library calls (``expf`` cost most of a softmax row), so:

- :func:`exp_like` and :func:`log_like` are inline polynomial versions for float32 (Cephes'
  ``expf``/``logf`` coefficients; 1 and 2 ulp from float64 references over the ranges used),
  and ``math.exp``/``math.log`` for float64 layers; :func:`exp_unflushed` is :func:`exp_like`
  without its flush, for arguments known to lie above it;
- :func:`ordered_key` maps a float to an integer of its width and of the same order, so that a
  max over floats runs as an integer max reduction, which LLVM vectorizes
  (:func:`from_ordered_key` maps the largest back; a float32 row's max then runs eight lanes
  wide).

All are compiled into their callers (``inline="always"`` overloads of branch-free code). numba
types int32 arithmetic as int64, which would make the vector loops run 64-bit lanes and convert
int64 to float one lane at a time (AVX2 has no instruction for it), so the float32 versions' bit
manipulations are LLVM intrinsics written in 32 bits (bench/NOTES.md has the timings).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
import numba
from numba import types
from numba.extending import intrinsic, overload


def _bitcast(name: str, to: Any, frm: Any, llvm_to: Any) -> Any:
    @intrinsic
    def cast(typingctx: Any, x: Any) -> Any:  # noqa: ARG001 (numba's intrinsic signature)
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:  # noqa: ARG001
            return builder.bitcast(args[0], llvm_to)
        return to(frm), codegen

    cast.__name__ = name
    return cast


_f32_from_bits = _bitcast("_f32_from_bits", types.float32, types.int32, ir.FloatType())
_f32_bits = _bitcast("_f32_bits", types.int32, types.float32, ir.IntType(32))
_f64_from_bits = _bitcast("_f64_from_bits", types.float64, types.int64, ir.DoubleType())
_f64_bits = _bitcast("_f64_bits", types.int64, types.float64, ir.IntType(64))

_I32 = ir.IntType(32)


def _i32(v: int) -> Any:
    return ir.Constant(_I32, v)


# numba types int32 arithmetic as int64: the vectorized loops then run 64-bit lanes and convert
# int64 to float one lane at a time (AVX2 has no such instruction). These helpers emit their
# integer steps in 32 bits.
@intrinsic
def _flip32(typingctx: Any, b: Any) -> Any:  # noqa: ARG001 (numba's intrinsic signature)
    """Reverse the patterns of negative float32s (an involution): the int32 order is then the
    float order."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:  # noqa: ARG001
        sign = builder.ashr(args[0], _i32(31))
        return builder.xor(args[0], builder.and_(sign, _i32(0x7FFFFFFF)))
    return types.int32(types.int32), codegen


@intrinsic
def _log2_split(typingctx: Any, x: Any) -> Any:  # noqa: ARG001
    """``(e, m)`` of a positive normal float32 ``x = m * 2**e``, ``m`` in [sqrt(1/2), sqrt(2)),
    both float32: the exponent of ``x / sqrt(1/2)`` and the rest, by integer arithmetic on the
    bits (INF gives ``(128, 1)``, NaN an ``e`` of 128 or more and a finite ``m``)."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:  # noqa: ARG001
        bits = builder.bitcast(args[0], _I32)
        e = builder.ashr(builder.sub(bits, _i32(0x3F3504F3)), _i32(23))  # 0x3F3504F3: sqrt(1/2)
        m = builder.bitcast(builder.sub(bits, builder.shl(e, _i32(23))), ir.FloatType())
        return context.make_tuple(builder, sig.return_type, (builder.sitofp(e, ir.FloatType()), m))
    return types.UniTuple(types.float32, 2)(types.float32), codegen


@intrinsic
def _pow2(typingctx: Any, n: Any) -> Any:  # noqa: ARG001
    """``2**n`` for an integer-valued float32 ``n`` in [-126, 127], as float32."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:  # noqa: ARG001
        k = builder.fptosi(args[0], _I32)
        bits = builder.shl(builder.add(k, _i32(127)), _i32(23))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(types.float32), codegen


#: Below this, ``exp`` would be subnormal (arithmetic on subnormals costs ~100x): flushed to 0.
EXP_FLUSH = -87.3


def exp_like(x: Any) -> Any:
    """``exp(x)`` in the precision of ``x`` (numba only). For float32, ``x`` must be at most
    88.7 or ``-inf`` (not NaN: the softmax's ``z - max z``); results below ``exp(-87.3)`` (about
    1.2e-38) are 0."""
    raise NotImplementedError("only callable from numba-compiled code")


def exp_unflushed(x: Any) -> Any:
    """``exp(x)`` in the precision of ``x`` (numba only) for ``x`` above :data:`EXP_FLUSH`'s
    half (float32: at most 88.7; a NaN gives NaN): :func:`exp_like` without its flush, for a
    check that makes the exponential again at half the argument."""
    raise NotImplementedError("only callable from numba-compiled code")


def ordered_key(v: Any) -> Any:
    """An integer of ``v``'s width (int32 for float32, int64 for float64) in the order of ``v``
    among floats that are not NaN (-inf lowest; a positive NaN lands above +inf, a negative one
    below -inf), for a max reduction LLVM vectorizes (numba only)."""
    raise NotImplementedError("only callable from numba-compiled code")


def from_ordered_key(k: Any) -> Any:
    """The float of an :func:`ordered_key` (its inverse; numba only)."""
    raise NotImplementedError("only callable from numba-compiled code")


def like(x: Any, v: float) -> Any:
    """``v`` in the precision of ``x``, a float32/float64 number or array (numba only), so that
    arithmetic with it runs in that precision (a float32 row then vectorizes eight lanes wide;
    the scalar float64 ``exp`` had been most of the forward kernel's time)."""
    raise NotImplementedError("only callable from numba-compiled code")


def log_like(x: Any) -> Any:
    """``log(x)`` in the precision of ``x`` (numba only). For float32, ``x`` must be a positive
    normal number (anything else gives a finite meaningless value, for the caller to mask)."""
    raise NotImplementedError("only callable from numba-compiled code")


@numba.njit(cache=True, inline="always")
def _exp_poly(xc: Any) -> Any:
    """Cephes' ``expf`` of a float32 ``xc`` in [-87.3, 88.72]."""
    n = np.floor(xc * np.float32(1.44269504088896341) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _pow2(n)


def _expf(x):  # noqa: ANN001, ANN202 (numba compares signatures)
    xc = min(max(x, np.float32(EXP_FLUSH)), np.float32(88.72283))
    return _exp_poly(xc) * np.float32(x >= np.float32(EXP_FLUSH))


def _expf_unflushed(x):  # noqa: ANN001, ANN202
    return _exp_poly(min(x, np.float32(88.72283)))  # NaN stays NaN (Python's min)


def _logf(x):  # noqa: ANN001, ANN202 (numba compares signatures)
    e, m = _log2_split(x)
    f = m - np.float32(1.0)
    z = f * f
    y = np.float32(7.0376836292e-2)
    y = y * f - np.float32(1.1514610310e-1)
    y = y * f + np.float32(1.1676998740e-1)
    y = y * f - np.float32(1.2420140846e-1)
    y = y * f + np.float32(1.4249322787e-1)
    y = y * f - np.float32(1.6668057665e-1)
    y = y * f + np.float32(2.0000714765e-1)
    y = y * f - np.float32(2.4999993993e-1)
    y = y * f + np.float32(3.3333331174e-1)
    y = y * f * z + np.float32(-2.12194440e-4) * e - np.float32(0.5) * z
    return f + y + np.float32(0.693359375) * e


@overload(exp_like, inline="always")
def _exp_like_impl(x):  # noqa: ANN001, ANN202 (numba compares signatures)
    if x == types.float32:
        return _expf
    return lambda x: math.exp(x)


@overload(exp_unflushed, inline="always")
def _exp_unflushed_impl(x):  # noqa: ANN001, ANN202
    if x == types.float32:
        return _expf_unflushed
    return lambda x: math.exp(x)


@overload(like, inline="always")
def _like_impl(x, v):  # noqa: ANN001, ANN202 (numba compares signatures)
    if (x.dtype if isinstance(x, types.Array) else x) == types.float32:
        return lambda x, v: np.float32(v)
    return lambda x, v: np.float64(v)


@overload(log_like, inline="always")
def _log_like_impl(x):  # noqa: ANN001, ANN202
    if x == types.float32:
        return _logf
    return lambda x: math.log(x)


@numba.njit(cache=True, inline="always")
def _flip64(b: Any) -> Any:
    """:func:`_flip32` for 64-bit patterns (int64 arithmetic is numba's own width)."""
    return b ^ ((b >> np.int64(63)) & np.int64(0x7FFFFFFFFFFFFFFF))


@overload(ordered_key, inline="always")
def _ordered_key_impl(v):  # noqa: ANN001, ANN202
    if v == types.float32:
        return lambda v: _flip32(_f32_bits(v))
    return lambda v: _flip64(_f64_bits(v))


@overload(from_ordered_key, inline="always")
def _from_ordered_key_impl(k):  # noqa: ANN001, ANN202
    if k == types.int32:
        return lambda k: _f32_from_bits(_flip32(k))
    return lambda k: _f64_from_bits(_flip64(k))
