"""Hypothesis strategies and assertion helpers for property-testing code under injected faults.

Strategies build NumPy operands (move them with ``xp.asarray``); the helpers accept NumPy or CuPy.
Small-integer-valued operands make every product exact, so detection, location and correction can
be asserted with ``==``. Use ``@settings(deadline=None)``: the first examples wait for numba to
compile (or load) the kernels, far beyond Hypothesis's default 200 ms deadline.

>>> from hypothesis import given, settings
>>> @settings(deadline=None)
... @given(ab=operand_pairs(np.float32), fault=faults())
... def test_mine(ab, fault):
...     a, b = ab
...     c, report = abftgemm.matmul(a, b, fault_hook=fault, return_report=True)
...     assert_protected(c, a, b, report)
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from abftgemm.backend import to_host
from abftgemm.checksums import SUPPORTED_DTYPES
from abftgemm.faults import KINDS, PATTERNS, Fault, bit_layout
from abftgemm.gemm import matmul
from abftgemm.report import Report
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
    """Shapes ``(a_shape, b_shape)`` of a valid (batched, broadcasting) product.

    ``m`` and ``n`` lie in ``[min_side, max_side]``, the inner dimension ``k`` in
    ``[min_side, max_k]`` (``max_k=None``: ``max_side``; ``max_k=0`` with ``min_side=0``: always 0).
    """
    m, n = draw(st.integers(min_side, max_side)), draw(st.integers(min_side, max_side))
    k = draw(st.integers(min_side, max_k if max_k is not None else max_side))
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
    finite floats of mixed sign and scale, no subnormals (float16 operands are drawn among
    float16 values, so none rounds to a float16 subnormal).
    """
    name = np.dtype(dtype).name
    bound, max_k = _EXACT[name]
    a_shape, b_shape = draw(shapes if shapes is not None else matmul_shapes(max_k=min(12, max_k)))
    if integer_valued:
        elements = st.integers(-bound, bound).map(float)
    else:
        limit = 30.0 if name == "float16" else 100.0  # products of k <= 12 terms stay finite
        elements = st.floats(-limit, limit, allow_nan=False, allow_subnormal=False,
                             width=16 if name == "float16" else 32)
    return (draw(hnp.arrays(np.float64, a_shape, elements=elements)).astype(dtype),
            draw(hnp.arrays(np.float64, b_shape, elements=elements)).astype(dtype))


@st.composite
def faults(draw: Any, kinds: tuple[str, ...] = KINDS, patterns: tuple[str, ...] = PATTERNS,
           sites: Any = None) -> Fault:
    """A seeded :class:`~abftgemm.faults.Fault` of any kind and pattern."""
    kind = draw(st.sampled_from(kinds))
    magnitude = draw(st.sampled_from([1.0, -3.0, 1e3, 0.5])) if kind == "additive" else 1.0
    return Fault(kind, draw(st.sampled_from(patterns)), seed=draw(st.integers(0, 2**31 - 1)),
                 sites=sites, magnitude=magnitude)


def reference(a: Any, b: Any) -> np.ndarray:
    """``a @ b`` in float64 on the host."""
    return np.matmul(to_host(a).astype(np.float64), to_host(b).astype(np.float64))


def assert_matches_reference(c: Any, a: Any, b: Any) -> None:
    """Assert ``c`` is ``a @ b`` (its shape too) up to the rounding the threshold model allows.

    Where ``a @ b`` (computed in float64) is INF or NaN, ``c`` must hold the same (NaN for NaN,
    an infinity of the same sign). For fault-free products only; under an injected fault, where
    one too small to tell from rounding (a low-mantissa bit flip) may stay, use
    :func:`assert_protected`.
    """
    c_h = to_host(c)
    with np.errstate(invalid="ignore", over="ignore"):  # INF/NaN inputs give INF/NaN, quietly
        ref = reference(a, b)
    assert c_h.shape == ref.shape, f"c has shape {c_h.shape}, a @ b {ref.shape}"
    p, k = _abs_product(a, b)
    tol = element_tolerance(p, k, c_h.dtype).reshape(ref.shape)
    got = c_h.astype(np.float64)
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    np.testing.assert_array_equal(got[~finite], ref[~finite],  # NaN equals NaN here
                                  err_msg="INF/NaN of c differ from those of a @ b")
    err = np.abs(got[finite] - ref[finite])
    assert (err <= tol[finite]).all(), f"max error {err.max()} exceeds tolerance"


def _abs_product(a: Any, b: Any) -> tuple[np.ndarray, int]:
    """``|a| @ |b|`` in float64 on the host, 1-D operands as a row and a column, and ``k``."""
    a_h, b_h = np.abs(to_host(a).astype(np.float64)), np.abs(to_host(b).astype(np.float64))
    a2 = a_h[None, :] if a_h.ndim == 1 else a_h
    b2 = b_h[:, None] if b_h.ndim == 1 else b_h
    with np.errstate(invalid="ignore", over="ignore"):  # INF/NaN inputs give INF/NaN, quietly
        return np.matmul(a2, b2), a2.shape[-1]


def silent_error_bound(a: Any, b: Any, c_clean: Any) -> np.ndarray:
    """Per element of the product, the largest error a check may let pass as rounding noise.

    The larger of the thresholds of the element's row and column (the model
    :func:`abftgemm.matmul` uses, from the clean product): two errors of opposite sign in one
    column cancel in its checksum, so each need only stay under its row's threshold. The result
    has the shape of ``c_clean``.
    """
    p, k = _abs_product(a, b)
    clean = to_host(c_clean)
    c = np.abs(clean.astype(np.float64).reshape(p.shape))
    with np.errstate(invalid="ignore", over="ignore"):  # INF/NaN inputs give INF/NaN, quietly
        tau_col, tau_row = (threshold(p.sum(axis), c.sum(axis), k, p.shape[axis], clean.dtype)
                            for axis in (-2, -1))
    return np.maximum(tau_col[..., None, :], tau_row[..., :, None]).reshape(clean.shape)


def checksum_error_ratio(c: Any, c_clean: Any, a: Any, b: Any,
                         directions: str = "columns") -> np.ndarray:
    """Per batch item, how far the errors of ``c`` go beyond what the checks let pass unflagged.

    For every verified vector (the columns; the rows too with ``directions="both"``), the error
    ``c - c_clean`` is summed plainly and with the location weights ``(l+1)/L``, as the checksum
    differences see it, and compared with the vector's threshold ``tau``: sums beyond ``tau`` plus
    the vector's own rounding (below ``tau``) are flagged, so ratios above 2 must have been
    detected. Twice :func:`abftgemm.thresholds.element_tolerance` per element is allowed on top
    (a recomputed element carries its own rounding). A non-finite element where ``c_clean`` is
    finite gives ``inf``, as does one that differs from an INF/NaN of ``c_clean`` (NaN matches
    NaN; an infinity must keep its sign).

    Parameters
    ----------
    c : array
        The product to judge, ``a @ b`` with the errors under test (NumPy or CuPy).
    c_clean : array
        The same product without them, of ``c``'s shape and dtype.
    a, b : array
        The operands (their magnitudes set each vector's threshold).
    directions : {"columns", "both"}
        The verified vectors: the columns, or the columns and the rows.

    Returns
    -------
    numpy.ndarray (batch,)
        The largest ``(|sum| - slack) / tau`` over the vectors and both sums of each item.
    """
    p, k = _abs_product(a, b)  # 1-D operands as matrices: (m, n) per item
    clean = to_host(c_clean)
    clean64, got64 = (x.astype(np.float64).reshape(p.shape) for x in (clean, to_host(c)))
    compared = np.isfinite(clean64)
    changed = ~compared & (got64 != clean64) & ~(np.isnan(got64) & np.isnan(clean64))
    with np.errstate(invalid="ignore", over="ignore"):  # INF/NaN inputs give INF/NaN, quietly
        err = np.where(compared, got64 - clean64, 0.0)
    slack = 2 * element_tolerance(p, k, clean.dtype)
    batch = math.prod(p.shape[:-2])
    worst = np.zeros(batch)
    if p.size == 0:
        return worst
    for axis in (-2, -1) if directions == "both" else (-2,):
        length = p.shape[axis]
        w = (np.arange(1, length + 1) / length).reshape((-1, 1) if axis == -2 else (1, -1))
        tau = threshold(np.where(compared, p, 0).sum(axis),
                        np.abs(np.where(compared, clean64, 0)).sum(axis), k, length, clean.dtype)
        allowed = np.where(compared, slack, 0).sum(axis)
        with np.errstate(invalid="ignore", over="ignore"):
            for total in (err.sum(axis), (err * w).sum(axis)):
                ratio = np.where(np.isfinite(total), (np.abs(total) - allowed) / tau, np.inf)
                worst = np.maximum(worst, ratio.reshape(batch, -1).max(-1, initial=0.0))
    worst[changed.reshape(batch, -1).any(-1)] = np.inf
    return worst


def assert_protected(c: Any, a: Any, b: Any, report: Report, c_clean: Any | None = None,
                     directions: str = "columns") -> None:
    """Assert that ``c``, a protected ``a @ b`` under an injected fault, keeps the guarantee.

    The guarantee is what the checksums see: in every batch item the report does not mark as
    detected (an event with action ``"reported"``, i.e. ``check="detect"``), the
    :func:`checksum_error_ratio` of ``c`` against the fault-free product is at most 2. A single
    undetected error is thus under about two thresholds of its column; several errors in one
    column may each be larger when their sums cancel (the trade of the column fast path,
    docs/detection.md). With ``check="correct"`` nothing is left reported, so every larger error
    fails the assertion: it must have been repaired.

    Parameters
    ----------
    c : array or scalar
        What :func:`abftgemm.matmul` returned (NumPy or CuPy).
    a, b : array
        The operands it was given.
    report : Report
        The report of the same call (``return_report=True``).
    c_clean : array, optional
        The fault-free product; default ``abftgemm.matmul(a, b, check="off")``. Pass it for a
        product with ``bias``.
    directions : {"columns", "both"}
        What the call verified (the ``directions`` given to :func:`abftgemm.matmul`).
    """
    clean = matmul(a, b, check="off") if c_clean is None else c_clean
    got, want = np.shape(c), np.shape(clean)
    assert got == want, f"c has shape {got}, the product {want}"
    ratio = checksum_error_ratio(c, clean, a, b, directions)
    reported = {e.batch for e in report.events if e.action == "reported"}
    unexplained = [i for i in np.flatnonzero(ratio > 2).tolist() if i not in reported]
    if unexplained:
        raise AssertionError(
            f"c differs from the fault-free product by more than its checks let pass in batch "
            f"items {unexplained} that the report does not mark as detected (worst vector: "
            f"{ratio[unexplained[0]]:.3g} thresholds, at most 2 allowed)\n{report.summary()}")


def exponent_bits(dtype: Any) -> range:
    """Bit positions of the exponent field of ``dtype``."""
    mantissa, exponent = bit_layout(dtype)
    return range(mantissa, mantissa + exponent)


__all__ = ["dtypes", "matmul_shapes", "operand_pairs", "faults", "reference",
           "assert_matches_reference", "assert_protected", "checksum_error_ratio",
           "silent_error_bound", "exponent_bits"]
