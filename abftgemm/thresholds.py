"""Rounding-error model -> per-vector detection thresholds.

For ``C = A @ B`` (inner dimension ``k``) the checksum of one column ``j`` (sum over ``len = m``
rows) is predicted from the inputs in float64 and recomputed from the delivered ``C``. Without a
fault the two differ only by rounding:

- accumulation inside the GEMM: each ``C_ij`` is a length-``k`` dot product accumulated in
  ``u_acc`` (float32 for 16- and 32-bit data, float64 for float64). Probabilistic error analysis
  (Higham & Mary) bounds it by ``lambda * sqrt(k) * u_acc * P_ij`` with ``P_ij = sum_c |A_ic B_cj|``.
  Summed over the vector WITHOUT assuming independence between rows (identical rows, such as
  padding tokens, round identically) this is ``KAPPA * sqrt(k) * u_acc * S_j``, ``S_j = sum_i P_ij``,
  which the prediction pass computes exactly as ``(1^T |A|) |B_:j|``;
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
                           bias: bool = False) -> tuple[float, float, float]:
    """``(c_obs, c_pred, floor)`` with ``threshold = c_obs * obs_abs + c_pred * pred_abs + floor``.

    The backends evaluate this linear form on the device (see :func:`threshold` for the terms).
    """
    u_out = unit_roundoff(dtype)
    u_acc = unit_roundoff(accumulation_dtype(dtype))
    checksum = _U64 * (length + k)
    c_pred = KAPPA * u_acc * math.sqrt(max(k, 1)) + checksum
    if bias:
        c_pred += u_out
    floor = smallest_normal(dtype) * (length + k)
    return _MARGIN * u_out + checksum, c_pred, floor


def threshold(pred_abs: Any, obs_abs: Any, k: int, length: int, dtype: np.dtype,
              bias: bool = False) -> Any:
    """Per-vector detection threshold for the plain checksum difference ``d1``.

    Parameters
    ----------
    pred_abs : array, float64
        ``S``: the predicted sum of ``|A_ic||B_cj|`` over the vector (plus ``|bias|`` terms).
    obs_abs : array, float64
        Sum of ``|C|`` over the vector as delivered.
    k : int
        Inner dimension of the product.
    length : int
        Number of elements in the vector.
    dtype : numpy dtype
        Output dtype.
    bias : bool
        The product had a bias added. cuBLAS may round ``A @ B`` to the output dtype before
        adding the bias (seen with bfloat16 on an H200: |d|/tau = 1.24 without this term), so a
        second output rounding of up to ``u_out * sum |A||B|`` is allowed for.

    Returns
    -------
    array, float64, same shape as ``pred_abs``.
    """
    c_obs, c_pred, floor = threshold_coefficients(k, length, dtype, bias)
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
