"""Vectorizable float32 ``exp`` and ``log`` and max reductions for the numba softmax kernels.

LLVM vectorizes a numba loop only when every call in it is inlined and branch-free, and it does
not vectorize floating-point max reductions unless NaNs are excluded (fast-math ``nnan``, which
the kernels cannot promise: non-finite data must pass through). Called in a loop, ``math.exp``
and ``math.log`` are scalar library calls (``expf`` cost most of a softmax row), so:

- :func:`exp_like` and :func:`log_f64` are inline polynomial versions for float32 (Cephes'
  ``expf``/``logf`` coefficients; 1 and 2 ulp from float64 references over the ranges used),
  and ``math.exp``/``math.log`` for float64 layers;
- :func:`nonnegative_key` maps a non-negative float to its bit pattern, an integer of the same
  order, so that a max over such floats runs as an integer max reduction, which LLVM vectorizes
  (:func:`from_nonnegative_key` maps the largest back); :func:`ordered_key` and
  :func:`from_ordered_key` do the same for floats of either sign, in their own width (a float32
  row's max then runs eight lanes wide: the softmax row took 4.1 -> 2.9 ms at 16 x 256 x 256).

All are compiled into their callers (``inline="always"`` overloads of branch-free code; the
bit casts are LLVM ``bitcast`` intrinsics).
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

#: Below this, ``exp`` would be subnormal (arithmetic on subnormals costs ~100x): flushed to 0.
EXP_FLUSH = -87.3


def exp_like(x: Any) -> Any:
    """``exp(x)`` in the precision of ``x`` (numba only). For float32, ``x`` must be at most
    88.7 or ``-inf`` (not NaN: the softmax's ``z - max z``); results below ``exp(-87.3)`` (about
    1.2e-38) are 0."""
    raise NotImplementedError("only callable from numba-compiled code")


def ordered_key(v: Any) -> Any:
    """An integer of ``v``'s width (int32 for float32, int64 for float64) in the order of ``v``
    among floats that are not NaN (-inf lowest; a positive NaN lands above +inf, a negative one
    below -inf), for a max reduction LLVM vectorizes (numba only)."""
    raise NotImplementedError("only callable from numba-compiled code")


def from_ordered_key(k: Any) -> Any:
    """The float of an :func:`ordered_key` (its inverse; numba only)."""
    raise NotImplementedError("only callable from numba-compiled code")


def log_f64(x: Any) -> float:
    """``log(x)`` as a float64 (numba only). For float32, ``x`` must be a positive normal
    number (anything else gives a finite meaningless value, for the caller to mask)."""
    raise NotImplementedError("only callable from numba-compiled code")


def _expf(x):  # noqa: ANN001, ANN202 (numba compares signatures)
    xc = min(max(x, np.float32(EXP_FLUSH)), np.float32(88.72283))
    y = xc * np.float32(1.44269504088896341) + np.float32(0.5)
    t = np.int32(y)
    n_int = t - np.int32(np.float32(t) > y)  # floor(x log2(e) + 1/2)
    n = np.float32(n_int)
    r = xc - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    two_n = _f32_from_bits((n_int + np.int32(127)) << np.int32(23))
    return p * two_n * np.float32(x >= np.float32(EXP_FLUSH))


def _logf(x):  # noqa: ANN001, ANN202 (numba compares signatures)
    bits = _f32_bits(x)
    e = np.float32(((bits >> np.int32(23)) & np.int32(0xFF)) - np.int32(126))
    m = _f32_from_bits((bits & np.int32(-2139095041)) | np.int32(0x3F000000))  # in [0.5, 1)
    below = np.float32(m < np.float32(0.707106781186547524))
    e = e - below
    f = m - np.float32(1.0) + below * m  # m - 1, or 2m - 1 below sqrt(1/2)
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
    return np.float64(f + y + np.float32(0.693359375) * e)


@overload(exp_like, inline="always")
def _exp_like_impl(x):  # noqa: ANN001, ANN202 (numba compares signatures)
    if x == types.float32:
        return _expf
    return lambda x: math.exp(x)


@overload(log_f64, inline="always")
def _log_f64_impl(x):  # noqa: ANN001, ANN202
    if x == types.float32:
        return _logf
    return lambda x: math.log(x)


@numba.njit(cache=True, inline="always")
def _flip32(b: Any) -> Any:
    """Reverse the patterns of negative floats (an involution): the integer order is then the
    float order. numba widens int32 arithmetic to int64, so the result is cast back, or a float32
    row would take 64-bit keys and decode them as float64 garbage."""
    return np.int32(b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@numba.njit(cache=True, inline="always")
def _flip64(b: Any) -> Any:
    """:func:`_flip32` for 64-bit patterns."""
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


@numba.njit(cache=True, inline="always")
def nonnegative_key(v: float) -> int:
    """An int64 with the order of ``max(v, 0)`` among non-negative floats (NaN: 0), for a max
    reduction kept in registers: LLVM vectorizes an integer max, not a float max that must keep
    NaNs. :func:`from_nonnegative_key` turns the largest back into the float."""
    return _f64_bits(v if v > 0 else 0.0)


@numba.njit(cache=True, inline="always")
def from_nonnegative_key(k: int) -> float:
    """The float of a :func:`nonnegative_key`."""
    return _f64_from_bits(k)
