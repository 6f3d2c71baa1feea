"""Rounding-error model -> per-vector detection thresholds.

For ``C = A @ B`` (inner dimension ``k``) the checksum of one column ``j`` (sum over ``len = m``
rows) is predicted from the inputs in float64 and recomputed from the delivered ``C``. Without a
fault the two differ only by rounding:

- accumulation inside the GEMM: each ``C_ij`` is a length-``k`` dot product accumulated in
  ``u_acc`` (float32 for 16- and 32-bit data, float64 for float64). Probabilistic error analysis
  (Higham & Mary) bounds it by ``lambda * sqrt(k) * u_acc * P_ij`` with
  ``P_ij = sum_c |A_ic B_cj|``. Summed over the vector WITHOUT assuming independence between rows
  (identical rows, such as padding tokens, round identically) this is
  ``KAPPA * sqrt(k) * u_acc * S_j``, ``S_j = sum_i P_ij``, which the prediction pass computes
  exactly as ``(1^T |A|) |B_:j|``;
- rounding of each output element to the output dtype: at most ``u_out * |C_ij|``, so
  ``u_out * sum_i |C_ij|`` in total, a rigorous bound taken from the delivered data (a fault of size
  ``delta`` raises it by only ``u_out * delta``; a non-finite fault is flagged separately);
- float64 checksum arithmetic: the deterministic bound ``u64 * (len + k)`` relative to the same
  sums (summing identical values, e.g. identical rows, makes these rounding errors systematic, so
  no square-root law applies; the term matters only for float64 data).

``KAPPA`` was calibrated on adversarial clean data (all-positive, identical rows, badly scaled rows
and columns, k up to 8192) on both backends; see docs/thresholds.md for the measurement. The same
function gives the tolerances the tests compare against.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from ml_dtypes import finfo

from abftgemm.checksums import accumulation_dtype, smallest_normal, unit_roundoff

#: Safety factor on the accumulation term (calibrated; see module docstring). Constant operands
#: (every product term identical, e.g. uniform attention probabilities) make the GEMM's rounding
#: errors systematic within each accumulation block: with 4, float32 products of constant
#: operands reached |d|/tau = 0.78 at k = 256 (OpenBLAS); 8 keeps the worst case near 0.4.
KAPPA = 8.0

_U64 = 2.0 ** -53
#: The output-rounding term is a rigorous bound that identical rows nearly attain (measured ratio
#: 0.94 in float16); a 1% margin keeps float64 checksum noise from tipping it over.
_MARGIN = 1.01


def threshold_coefficients(k: int, length: int, dtype: np.dtype,
                           bias: bool = False) -> tuple[float, float, float, float]:
    """``(c_obs, c_pred, floor, c_mag)`` of the checks of one vector.

    ``threshold = c_obs * obs_abs + c_pred * pred_abs + floor`` bounds the checksum differences
    (see :func:`threshold` for the terms); ``c_mag * pred_abs + floor`` bounds the observed
    ``sum |C|`` (see :func:`magnitude_coefficient`). The backends evaluate both on the device.
    """
    u_out = unit_roundoff(dtype)
    u_acc = unit_roundoff(accumulation_dtype(dtype))
    checksum = _U64 * (length + k)
    c_pred = KAPPA * u_acc * math.sqrt(max(k, 1)) + checksum
    if bias:
        c_pred += u_out
    floor = smallest_normal(dtype) * (length + k)
    return (_MARGIN * u_out + checksum, c_pred, floor,
            magnitude_coefficient(k, length, dtype))


def magnitude_coefficient(k: int, length: int, dtype: np.dtype) -> float:
    """``c_mag`` with ``sum |C| <= c_mag * S + floor`` over any fault-free vector of the product.

    Every element is a length-``k`` dot product (plus a bias) whose every rounding, in any
    summation order, grows it by at most ``(1 + u_acc)``: ``|C_ij| <= (1 + u_acc)**(k + 1) P_ij``;
    rounding to the output dtype, and once more where a bias is added after the product was
    rounded, adds ``(1 + u_out)**2``; the float64 sums of ``|C|`` and of ``S`` add at most
    ``(1 + u64)**(length + k)`` each. A rigorous bound, so it never flags clean data; it catches
    what the checksum differences can miss: large errors whose signs cancel in both the plain and
    the weighted sum of a vector (a +-near-INF pattern symmetric about the vector's middle).
    """
    u_out = unit_roundoff(dtype)
    u_acc = unit_roundoff(accumulation_dtype(dtype))
    growth = math.exp((k + 1) * math.log1p(u_acc)) * (1 + u_out) ** 2
    return growth * math.exp(2 * (length + k) * math.log1p(_U64)) * _MARGIN


def threshold(pred_abs: Any, obs_abs: Any, k: int, length: int, dtype: np.dtype,
              bias: bool = False) -> Any:
    """Per-vector detection threshold (float64, ``pred_abs``'s shape) for the plain checksum
    difference ``d1`` of vectors of ``length`` elements of a product of inner dimension ``k`` and
    output ``dtype``: ``pred_abs`` is ``S``, the predicted sum of ``|A_ic||B_cj|`` over the
    vector (plus ``|bias|`` terms), ``obs_abs`` the sum of ``|C|`` over it as delivered.

    ``bias``: the product had a bias added. cuBLAS may round ``A @ B`` to the output dtype before
    adding the bias (seen with bfloat16 on an H200: |d|/tau = 1.24 without this term), so a
    second output rounding of up to ``u_out * sum |A||B|`` is allowed for.
    """
    c_obs, c_pred, floor, _ = threshold_coefficients(k, length, dtype, bias)
    return c_obs * obs_abs + c_pred * pred_abs + floor


def element_tolerance(pred_abs: Any, k: int, dtype: np.dtype) -> Any:
    """How far a delivered element may sit from the exact product (for tests and repairs).

    ``pred_abs`` is ``P_ij = sum_c |A_ic B_cj|`` (or a bound on it); the result bounds rounding
    in the GEMM plus rounding to ``dtype``.
    """
    u_out = unit_roundoff(dtype)
    u_acc = unit_roundoff(accumulation_dtype(dtype))
    return (KAPPA * u_acc * math.sqrt(max(k, 1)) + 2 * u_out) * pred_abs \
        + smallest_normal(dtype) * (k + 1)


def largest_finite(dtype: np.dtype) -> float:
    """Largest finite value of ``dtype`` (bfloat16 included)."""
    return float(finfo(np.dtype(dtype)).max)


def growth_margin(k: int, dtype: np.dtype) -> float:
    """``delta`` with ``|any partial sum| <= (1 + delta) * sum |terms|`` in the GEMM's accumulator.

    A length-``k`` dot product (plus a bias term) rounds each product and each addition once:
    ``(1 + u_acc)**(k + 1) - 1 <= 1.01 (k + 1) u_acc`` while ``(k + 1) u_acc <= 0.01``
    (Higham, Lemma 3.1), a rigorous bound whatever the summation order.
    """
    return 1.01 * (max(k, 1) + 1) * unit_roundoff(accumulation_dtype(dtype))


def overflow_limits(dtype: np.dtype) -> tuple[float, float]:
    """``(output limit, accumulator limit)``: the largest finite values of ``dtype`` and of the
    precision the GEMM accumulates in (float32 for 16-bit data)."""
    return largest_finite(dtype), largest_finite(accumulation_dtype(dtype))


def safe_magnitude(k: int, dtype: np.dtype) -> float:
    """Bound on ``S = sum |A||B|`` (of a vector, or ``P_ij`` of one element) below which no
    element can overflow.

    Every partial sum of an element, and the element itself, is at most ``(1 + delta) P_ij`` in
    magnitude (:func:`growth_margin`), and ``P_ij <= S`` for every element of the vector; below
    this bound neither the accumulator nor the rounding to ``dtype`` can reach INF, so a vector
    with finite inputs and ``S`` under it cannot legitimately hold INF or NaN.
    """
    return min(overflow_limits(dtype)) / (1 + growth_margin(k, dtype))
