"""Rounding-error model -> per-vector detection thresholds: docs/design.md, "Thresholds: a
rounding model, not constants"; derived and measured in docs/thresholds.md. The same functions
give the tests' tolerances.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from ml_dtypes import finfo

from abftgemm.checksums import accumulation_dtype, smallest_normal, unit_roundoff

#: Safety factor on the accumulation term, calibrated on adversarial clean data: constant operands
#: (uniform attention probabilities) round systematically per block; 8 keeps their |d|/tau near 0.4.
KAPPA = 8.0

_U64 = 2.0 ** -53
#: The output-rounding term is a rigorous bound that identical rows nearly attain; a 1% margin
#: keeps float64 checksum noise from tipping it over.
_MARGIN = 1.01


def threshold_coefficients(k: int, length: int, dtype: np.dtype,
                           bias: bool = False) -> tuple[float, float, float, float]:
    """``(c_obs, c_pred, floor, c_mag)`` of one vector's checks, which the backends evaluate on
    the device: ``c_obs * sum |C| + c_pred * S + floor`` bounds the checksum differences
    (:func:`threshold`), ``c_mag * S + floor`` the observed ``sum |C|``
    (:func:`magnitude_coefficient`)."""
    u_out, u_acc = unit_roundoff(dtype), unit_roundoff(accumulation_dtype(dtype))
    checksum = _U64 * (length + k)
    c_pred = KAPPA * u_acc * math.sqrt(max(k, 1)) + checksum
    if bias:
        c_pred += u_out
    floor = smallest_normal(dtype) * (length + k)
    return (_MARGIN * u_out + checksum, c_pred, floor, magnitude_coefficient(k, length, dtype))


def magnitude_coefficient(k: int, length: int, dtype: np.dtype) -> float:
    """``c_mag`` with ``sum |C| <= c_mag * S + floor`` over any fault-free vector, in any summation
    order: ``|C_ij| <= (1 + u_acc)**(k + 1) P_ij``, times ``(1 + u_out)**2`` for the output rounding
    (twice with a bias) and ``(1 + u64)**(length + k)`` per float64 sum. It catches large errors
    whose signs cancel in both checksum differences (+-near-INF, symmetric about the middle)."""
    u_out, u_acc = unit_roundoff(dtype), unit_roundoff(accumulation_dtype(dtype))
    growth = math.exp((k + 1) * math.log1p(u_acc)) * (1 + u_out) ** 2
    return growth * math.exp(2 * (length + k) * math.log1p(_U64)) * _MARGIN


def threshold(pred_abs: Any, obs_abs: Any, k: int, length: int, dtype: np.dtype,
              bias: bool = False) -> Any:
    """Per-vector threshold (float64, ``pred_abs``'s shape) on the plain checksum difference of
    vectors of ``length`` elements, inner dimension ``k`` and output ``dtype``: ``pred_abs`` is
    ``S`` (plus ``|bias|`` terms), ``obs_abs`` the delivered ``sum |C|``. With ``bias``, a second
    output rounding of up to ``u_out * S`` (cuBLAS may round ``A @ B`` before adding a bias)."""
    c_obs, c_pred, floor, _ = threshold_coefficients(k, length, dtype, bias)
    return c_obs * obs_abs + c_pred * pred_abs + floor


def element_tolerance(pred_abs: Any, k: int, dtype: np.dtype) -> Any:
    """How far a delivered element may sit from the exact product (for tests and repairs): the
    GEMM's and the output's rounding, for ``pred_abs`` ``P_ij = sum_c |A_ic B_cj|`` (or a bound)."""
    u_out, u_acc = unit_roundoff(dtype), unit_roundoff(accumulation_dtype(dtype))
    return (KAPPA * u_acc * math.sqrt(max(k, 1)) + 2 * u_out) * pred_abs \
        + smallest_normal(dtype) * (k + 1)


def largest_finite(dtype: np.dtype) -> float:
    """Largest finite value of ``dtype`` (bfloat16 included)."""
    return float(finfo(np.dtype(dtype)).max)


def growth_margin(k: int, dtype: np.dtype) -> float:
    """``delta`` with ``|any partial sum| <= (1 + delta) * sum |terms|`` in the GEMM's accumulator,
    in any summation order: ``(1 + u_acc)**(k + 1) - 1 <= 1.01 (k + 1) u_acc`` while
    ``(k + 1) u_acc <= 0.01`` (Higham, Lemma 3.1)."""
    return 1.01 * (max(k, 1) + 1) * unit_roundoff(accumulation_dtype(dtype))


def safe_magnitude(k: int, dtype: np.dtype) -> float:
    """Bound on ``S = sum |A||B|`` (of a vector, or ``P_ij`` of one element) below which no element
    can overflow, every partial sum being at most ``(1 + delta) P_ij <= (1 + delta) S``
    (:func:`growth_margin`): a vector with finite inputs and ``S`` under it cannot hold INF/NaN.
    The output's limit is the lower: no supported dtype exceeds its accumulator's."""
    return largest_finite(dtype) / (1 + growth_margin(k, dtype))
