"""Hypothesis strategies and assertion helpers for property-testing code under injected faults.

Strategies build NumPy operands (move them with ``xp.asarray``); the helpers accept NumPy or CuPy.
Small-integer-valued operands make every product exact in every supported dtype, so detection,
location and correction can be asserted with ``==``.

>>> from hypothesis import given
>>> @given(ab=operand_pairs(np.float32), fault=faults())
... def test_mine(ab, fault): ...
"""
from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from abftgemm.backend import to_host
from abftgemm.checksums import SUPPORTED_DTYPES
from abftgemm.faults import KINDS, PATTERNS, Fault, bit_layout
from abftgemm.thresholds import element_tolerance, threshold

#: Largest |value| of integer-valued operands per dtype, and the largest k that keeps every partial
#: sum an exactly representable integer (2**(mantissa+1) / max**2).
_EXACT = {"float16": (4, 64), "bfloat16": (2, 32), "float32": (16, 4096), "float64": (16, 4096)}


def dtypes() -> st.SearchStrategy[np.dtype]:
    """Every supported dtype."""
    return st.sampled_from(SUPPORTED_DTYPES)


@st.composite
def matmul_shapes(draw: Any, max_side: int = 12, max_batch_dims: int = 2, min_side: int = 1,
                  max_k: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes ``(a_shape, b_shape)`` of a valid (batched, broadcasting) product."""
    m, n = draw(st.integers(min_side, max_side)), draw(st.integers(min_side, max_side))
    k = draw(st.integers(min_side, max_k or max_side))
    batch = draw(hnp.array_shapes(min_dims=0, max_dims=max_batch_dims, min_side=1, max_side=3))
    a_batch = tuple(d if draw(st.booleans()) else 1 for d in batch)
    b_batch = tuple(d if draw(st.booleans()) else 1 for d in batch)
    a_batch = a_batch[draw(st.integers(0, len(a_batch))):]  # drop some leading dims: broadcast
    return a_batch + (m, k), b_batch + (k, n)


@st.composite
def operand_pairs(draw: Any, dtype: Any, shapes: st.SearchStrategy | None = None,
                  integer_valued: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """NumPy operands ``(a, b)`` of ``dtype``.

    ``integer_valued=True``: small integers (products exact in ``dtype``); otherwise bounded
    finite floats of mixed sign and scale, no subnormals.
    """
    name = np.dtype(dtype).name
    bound, max_k = _EXACT[name]
    a_shape, b_shape = draw(shapes if shapes is not None else matmul_shapes(max_k=min(12, max_k)))
    if integer_valued:
        elements = st.integers(-bound, bound).map(float)
    else:
        limit = 30.0 if name == "float16" else 100.0  # products of k <= 12 terms stay finite
        elements = st.floats(-limit, limit, allow_nan=False, allow_subnormal=False, width=32)
    a = draw(hnp.arrays(np.float64, a_shape, elements=elements)).astype(dtype)
    b = draw(hnp.arrays(np.float64, b_shape, elements=elements)).astype(dtype)
    return a, b


@st.composite
def faults(draw: Any, kinds: tuple[str, ...] = KINDS, patterns: tuple[str, ...] = PATTERNS,
           sites: Any = None) -> Fault:
    """A seeded :class:`~abftgemm.faults.Fault` of any kind and pattern."""
    kind = draw(st.sampled_from(kinds))
    extra: dict[str, Any] = {}
    if kind == "additive":
        extra["magnitude"] = draw(st.sampled_from([1.0, -3.0, 1e3, 0.5]))
    return Fault(kind, draw(st.sampled_from(patterns)), seed=draw(st.integers(0, 2**31 - 1)),
                 sites=sites, **extra)


def reference(a: Any, b: Any) -> np.ndarray:
    """``a @ b`` in float64 on the host."""
    return np.matmul(to_host(a).astype(np.float64), to_host(b).astype(np.float64))


def assert_matches_reference(c: Any, a: Any, b: Any) -> None:
    """Assert ``c`` is ``a @ b`` up to the rounding the threshold model allows (NaN where INF/NaN)."""
    a64, b64 = to_host(a).astype(np.float64), to_host(b).astype(np.float64)
    ref = np.matmul(a64, b64)
    tol = element_tolerance(np.matmul(np.abs(a64), np.abs(b64)), a64.shape[-1], to_host(c).dtype)
    got = to_host(c).astype(np.float64)
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    err = np.abs(got - ref)[finite]
    assert (err <= tol[finite]).all(), f"max error {err.max()} exceeds tolerance"


def silent_error_bound(a: Any, b: Any, c_clean: Any) -> np.ndarray:
    """Per element of the product, the largest error a check may let pass as rounding noise.

    It is the larger of the thresholds of the element's row and column, computed from the clean
    product with the same model :func:`abftgemm.matmul` uses: a single error must clear both, but
    two errors of opposite sign in one column cancel in its checksum, so each need only stay under
    its row's threshold (and vice versa).
    """
    a64, b64 = to_host(a).astype(np.float64), to_host(b).astype(np.float64)
    c = to_host(c_clean).astype(np.float64)
    p = np.matmul(np.abs(a64), np.abs(b64))
    k, (m, n) = a64.shape[-1], c.shape[-2:]
    dtype = to_host(c_clean).dtype
    tau_col = threshold(p.sum(-2), np.abs(c).sum(-2), k, m, dtype)[..., None, :]
    tau_row = threshold(p.sum(-1), np.abs(c).sum(-1), k, n, dtype)[..., :, None]
    return np.maximum(tau_col, tau_row)


def exponent_bits(dtype: Any) -> range:
    """Bit positions of the exponent field of ``dtype``."""
    mantissa, exponent = bit_layout(dtype)
    return range(mantissa, mantissa + exponent)


__all__ = ["dtypes", "matmul_shapes", "operand_pairs", "faults", "reference",
           "assert_matches_reference", "silent_error_bound", "exponent_bits"]
