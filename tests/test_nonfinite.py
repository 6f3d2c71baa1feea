"""The user's own INF/NaN and genuine overflow flow through as plain math gives them; faults do not.

"Plain math" is the library's unprotected product (``check="off"``) and, for the attention
layer, the layer with ``check="off"`` on the same data. Wherever the data passes through, the
comparison is bit for bit (NaN where plain math has NaN).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import abftgemm
from abftgemm.backend import get_backend, to_host
from abftgemm.checksums import bfloat16
from abftgemm.faults import Fault, bit_layout
from abftgemm.thresholds import largest_finite, safe_magnitude
from attention import MultiHeadAttention
from conftest import BACKENDS

DTYPES = [np.dtype(t) for t in (np.float16, bfloat16, np.float32, np.float64)]
DTYPE_IDS = [t.name for t in DTYPES]
PASSED = {"input-nonfinite", "overflow"}
#: The tracker's example scales: products of two normal samples of this size overflow the dtype
#: for most elements at k = 64 (float16: 100**2 * sqrt(64) = 8e4 > 65504).
OVERFLOW_SCALE = {"float16": 100.0, "bfloat16": 1e19, "float32": 1e19, "float64": 1e154}


def same(got, want):
    """Bit-for-bit equal values, NaN where the other has NaN."""
    got, want = to_host(got), to_host(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


def only_passed_through(report):
    assert not report.detected, report.summary()
    assert {e.pattern for e in report.events} <= PASSED, report.summary()
    assert all(e.action == "passed-through" for e in report.events), report.summary()


def normal(shape, scale, dtype, seed):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def protected_like_plain(xp, a, b, mode, bias=None):
    """Run ``mode`` and ``check="off"`` on the same operands; return (c, report, c_plain)."""
    args = [xp.asarray(a), xp.asarray(b)]
    kw = {} if bias is None else {"bias": xp.asarray(bias)}
    with np.errstate(over="ignore", invalid="ignore"):
        c_plain = abftgemm.matmul(*args, check="off", **kw)
        c, report = abftgemm.matmul(*args, check=mode, return_report=True, **kw)
    return c, report, c_plain


# ------------------------------------------------------------------------------- the flag primitive
@pytest.mark.parametrize("xp", BACKENDS)
def test_flag_leaves_overflowing_vectors_to_the_element_settle(xp):
    """A vector whose bound S reaches ``safe`` and holds INF/NaN is unverifiable (not bad); the
    same with finite elements is judged by its checksums; below ``safe`` INF stays a fault."""
    safe = 100.0
    pred = np.zeros((1, 6, 5))
    obs = np.zeros((1, 6, 5))
    pred[0, :, 2] = [50, 50, 200, 200, 200, 1e300]
    obs[0, :, 2] = [50, np.inf, np.inf, 200, 200, np.nan]
    obs[0, :, 3] = [0, 1, 1, 0, 0, 2]
    obs[0, 4, 0] = 1.0  # finite but 1.0 off, far above the threshold 1e-6 below
    coefficients = (0.0, 0.0, 1e-6, np.inf)  # no magnitude bound: only finiteness is at stake
    counts = xp.zeros(2, dtype=np.int64)
    _, bad, verifiable = get_backend(xp).flag(xp.asarray(pred), xp.asarray(obs), coefficients,
                                              safe, counts)
    assert to_host(verifiable)[0].tolist() == [True, True, False, True, True, False]
    assert to_host(bad)[0].tolist() == [False, True, False, False, True, False]
    assert to_host(counts).tolist() == [2, 2]


# ------------------------------------------------------------------------------ the tracker's cases
@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("mode", ["correct", "detect", "off"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_genuine_overflow_is_delivered_as_plain_math(xp, dtype, mode):
    scale = OVERFLOW_SCALE[dtype.name]
    a, b = normal((16, 64), scale, dtype, 1), normal((64, 16), scale, dtype, 2)
    assert np.isfinite(a.astype(np.float64)).all() and np.isfinite(b.astype(np.float64)).all()
    c, report, c_plain = protected_like_plain(xp, a, b, mode)
    same(c, c_plain)
    assert (~np.isfinite(to_host(c_plain).astype(np.float64))).sum() > 64  # the case is real
    only_passed_through(report)
    if mode != "off":  # finite inputs: overflow, never "input-nonfinite"
        assert {e.pattern for e in report.events} == {"overflow"}


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("mode", ["correct", "detect"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_batched_overflow_with_bias_is_delivered_as_plain_math(xp, dtype, mode):
    """Overflow in one batch item and clean data in the other; a bias inside the protection."""
    scale = OVERFLOW_SCALE[dtype.name]
    a = normal((2, 12, 64), 1.0, dtype, 3)
    a[1] = normal((12, 64), scale, dtype, 4)
    b = normal((64, 10), scale, dtype, 5)
    bias = normal((10,), 1.0, dtype, 6)
    c, report, c_plain = protected_like_plain(xp, a, b, mode, bias)
    same(c, c_plain)
    only_passed_through(report)
    assert {e.batch for e in report.events} <= {1}


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("mode", ["correct", "detect"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nonfinite_inputs_are_delivered_as_plain_math(xp, dtype, mode, bad):
    a, b = normal((2, 9, 7), 1.0, dtype, 7), normal((7, 5), 1.0, dtype, 8)
    a[1, 3, 2] = bad
    b[4, 1] = bad
    c, report, c_plain = protected_like_plain(xp, a, b, mode)
    same(c, c_plain)
    only_passed_through(report)
    assert "input-nonfinite" in {e.pattern for e in report.events}


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bad,fault", [(np.inf, 1.0), (np.inf, "negated"), (-np.inf, 0.0),
                                       (np.nan, 1.5), (np.nan, np.inf)])
def test_a_fault_on_an_element_of_nonfinite_inputs_is_corrected(xp, dtype, bad, fault):
    """The user's INF or NaN in ``a`` and ``b`` makes whole rows and columns non-finite, which
    no checksum judges; a fault there that makes an element finite, flips its infinity's sign
    or turns a NaN into INF is still found (the element's non-finite terms allow none of it)
    and repaired to plain math's value. A zero beside the INF (``inf * 0``) is a term a BLAS
    may skip: NaN, or what the other terms give, and nothing else."""
    a, b = normal((9, 7), 1.0, dtype, 7), normal((7, 5), 1.0, dtype, 8)
    a[1, 2] = bad  # row 1 of the product non-finite (b's row 2 has no zero)
    b[4, 3] = bad  # and column 3
    b[2, 0] = 0    # element (1, 0): INF * 0 and finite terms
    b[2, 1] = 0    # element (1, 1) likewise
    skipped = np.delete(a[1].astype(np.float64), 2) @ np.delete(b[:, 1].astype(np.float64), 2)

    def hook(site, c):
        for i, j in ((1, 4), (6, 3)):
            c[..., i, j] = -c[..., i, j] if fault == "negated" else fault
        c[..., 1, 0] = skipped + 7.0  # neither NaN nor the other terms' sum
        c[..., 1, 1] = skipped  # the other terms' sum: the INF * 0 term skipped

    with np.errstate(invalid="ignore"):
        c_plain = abftgemm.matmul(xp.asarray(a), xp.asarray(b), check="off")
        c, report = abftgemm.matmul(xp.asarray(a), xp.asarray(b), fault_hook=hook,
                                    return_report=True)
    want = to_host(c_plain).astype(np.float64)
    want[1, 1] = np.float64(np.asarray(skipped, dtype))
    np.testing.assert_array_equal(to_host(c).astype(np.float64), want)
    found = [e for e in report.events if e.action == "recomputed"]
    assert {(r, j) for e in found for r in e.rows for j in e.cols} >= {(1, 4), (6, 3), (1, 0)}
    passed = [e for e in report.events if e.pattern == "input-nonfinite"]
    cells = {(r, j) for e in passed for r in e.rows for j in e.cols}
    assert (1, 1) in cells and not cells & {(1, 4), (6, 3)}


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_is_a_fault_where_no_term_can_make_it(xp, dtype):
    """An element of ``+INF`` terms and finite ones (no zero beside the INF) is ``+INF`` in any
    summation: a fault that makes it NaN is found and repaired; where the INF meets a zero
    (``inf * 0``, NaN or skipped) or the finite terms could overflow to ``-INF``, NaN is plain
    math's outcome and passes."""
    a, b = np.ones((4, 3), dtype), np.ones((3, 5), dtype)
    a[1, 0] = np.inf
    b[0, 4] = 0

    def hook(site, c):
        c[..., 1, 2] = np.nan

    with np.errstate(invalid="ignore"):
        c, report = abftgemm.matmul(xp.asarray(a), xp.asarray(b), fault_hook=hook,
                                    return_report=True)
        got = to_host(c).astype(np.float64)
        faulty = got.astype(dtype)
        faulty[1, 2] = np.nan
        verdict = abftgemm.verify(xp.asarray(faulty), xp.asarray(a), xp.asarray(b))
    assert np.all(got[1, :4] == np.inf) and np.isnan(got[1, 4])
    assert any((1, 2) == (r, j) for e in report.events if e.action == "recomputed"
               for r in e.rows for j in e.cols)
    assert not verdict.clean


# ---------------------------------------------------- faults next to overflow are still caught
def near_overflow_problem(dtype):
    """Exactly representable operands whose product has a genuinely overflowing column (3) and
    elsewhere elements with ``P_ij`` below the safe bound but column bounds S above it.

    With ``E = floor(log2(max finite))`` and entries ``{2, 3} * 2**e`` (``e_a + e_b = E - 8``,
    k = 8): ``P_ij`` lies in ``[32, 72] * 2**(E-8)``, below ``2**(E-1.8)``; 32 rows make every
    column bound at least ``2**(E+2)``; column 3 has ``b`` 64x larger, so its elements are at least
    ``2**(E+3)``: INF. Every partial sum is an integer times ``2**(E-8)`` below 2**8 times that,
    exact in every dtype, so any summation order gives the same result.
    """
    big = int(math.floor(math.log2(largest_finite(dtype))))
    ea, eb = (big - 8) // 2, big - 8 - (big - 8) // 2
    rng = np.random.default_rng(9)
    a = np.ldexp(rng.integers(2, 4, (32, 8)).astype(np.float64), ea)
    b = np.ldexp(rng.integers(2, 4, (8, 6)).astype(np.float64), eb)
    b[:, 3] *= 64
    return a.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["inf", "-inf", "nan", "near-inf", "bitflip", "additive"])
def test_fault_beside_a_genuine_overflow_is_corrected(xp, dtype, kind):
    a, b = near_overflow_problem(dtype)
    assert safe_magnitude(8, dtype) > 72 * 2.0 ** (int(math.log2(largest_finite(dtype))) - 8)
    plain = to_host(abftgemm.matmul(xp.asarray(a), xp.asarray(b), check="off"))
    assert np.isinf(plain[:, 3].astype(np.float64)).all()
    assert np.isfinite(np.delete(plain, 3, axis=1).astype(np.float64)).all()
    extra = {}
    if kind == "bitflip":  # the top exponent bit: a huge change either way
        extra["bit"] = sum(bit_layout(dtype)) - 1
    if kind == "additive":  # far above rounding: half the element's own size
        extra["magnitude"] = float(plain[5, 1]) / 2
    fault = Fault(kind, "element", seed=0, row=5, col=1, **extra)
    c, report = abftgemm.matmul(xp.asarray(a), xp.asarray(b), fault_hook=fault,
                                return_report=True)
    same(c, plain)
    assert report.detected, report.summary()
    faults = [e for e in report.events if e.pattern not in PASSED]
    assert all(e.action in ("corrected", "recomputed") for e in faults), report.summary()
    assert {e.pattern for e in report.events} - {e.pattern for e in faults} <= {"overflow"}

    fault = Fault(kind, "element", seed=0, row=5, col=1, **extra)
    c, report = abftgemm.matmul(xp.asarray(a), xp.asarray(b), fault_hook=fault,
                                return_report=True, check="detect")
    assert report.detected, report.summary()
    assert not np.array_equal(to_host(c).astype(np.float64), plain.astype(np.float64),
                              equal_nan=True)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("kind", ["inf", "nan", "additive"])
def test_fault_where_the_float64_prediction_overflows_is_corrected(xp, kind):
    """float64 data of scale 1e153: finite products whose checksum predictions overflow float64
    (16 * 64 terms of 1e306), so every element is settled against the scaled float64 model."""
    a, b = normal((16, 64), 1e153, np.float64, 10), normal((64, 16), 1e153, np.float64, 11)
    plain = a @ b
    assert np.isfinite(plain).all()
    fault = Fault(kind, "element", seed=0, row=3, col=4, magnitude=abs(plain[3, 4]))
    c, report = abftgemm.matmul(xp.asarray(a), xp.asarray(b), fault_hook=fault,
                                return_report=True)
    # Recomputing the faulty element's row may round differently from the full product:
    # element_tolerance for float64 at k = 64 is (8 * 8 + 2) * 2**-53 of sum |a||b|.
    bound = (8 * 8 + 2) * 2.0 ** -53 * (np.abs(a) @ np.abs(b))
    assert (np.abs(to_host(c) - plain) <= bound).all()
    assert report.detected and not {e.pattern for e in report.events} & {"input-nonfinite"}


# --------------------------------------------------------------------------------- properties
@st.composite
def overflowing_operands(draw, dtype):
    """Small-integer operands times a power of two placed so that some products overflow.

    Entries ``v * 2**e``, ``|v| <= 8``, k <= 12: an element is at most ``768 * 2**(2e)``
    (``2**9.6``), typically about ``sqrt(k) * 21 * 2**(2e)`` (``2**6``, 21 the mean of ``v**2``);
    ``2e`` is drawn from ``log2(max finite) - 12`` (every element finite) to ``- 2`` (typical
    elements 16 times too large), so the products range from finite to mostly INF.
    """
    m, k, n = (draw(st.integers(1, 12)) for _ in range(3))
    big = math.log2(largest_finite(dtype))
    twice_e = draw(st.integers(int(big) - 12, int(big) - 2))
    ints = st.integers(-8, 8)
    a = np.array(draw(st.lists(ints, min_size=m * k, max_size=m * k)), float).reshape(m, k)
    b = np.array(draw(st.lists(ints, min_size=k * n, max_size=k * n)), float).reshape(k, n)
    a, b = np.ldexp(a, twice_e // 2), np.ldexp(b, twice_e - twice_e // 2)
    return a.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@given(data=st.data(), mode=st.sampled_from(["correct", "detect"]))
def test_random_overflowing_products_match_plain_math(xp, dtype, data, mode):
    a, b = data.draw(overflowing_operands(dtype))
    c, report, c_plain = protected_like_plain(xp, a, b, mode)
    same(c, c_plain)
    only_passed_through(report)
    assert {e.pattern for e in report.events} <= {"overflow"}


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@given(kind=st.sampled_from(["inf", "-inf", "nan", "near-inf", "bitflip"]),
       seed=st.integers(0, 10**6), rows=st.integers(2, 20), cols=st.integers(2, 20))
def test_fault_in_a_finite_product_is_still_caught(xp, dtype, kind, seed, rows, cols):
    """Small integers: the product is exact and far from overflow, and so must come back."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-4, 5, (rows, 16)).astype(dtype)
    b = rng.integers(-4, 5, (16, cols)).astype(dtype)
    plain = to_host(abftgemm.matmul(xp.asarray(a), xp.asarray(b), check="off"))
    # a top exponent bit flip of a non-zero element, or any flip of an exact zero, changes it
    extra = {"bit": sum(bit_layout(dtype)) - 1} if kind == "bitflip" else {}
    fault = Fault(kind, "element", seed=seed, **extra)
    c, report = abftgemm.matmul(xp.asarray(a), xp.asarray(b), fault_hook=fault,
                                return_report=True)
    same(c, plain)
    changed = fault.injected[0].changed[0]
    assert report.detected == changed, report.summary()
    assert {e.pattern for e in report.events} & PASSED == set()


# --------------------------------------------------------------------------------- attention
def attention_case(xp, dtype, what, check, causal):
    layer = MultiHeadAttention(8, 2, causal=causal, dtype=dtype, xp=xp, seed=0, check=check)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 6, 8))
    dy = rng.standard_normal((2, 6, 8))
    if what == "nan-x":
        x[1, 2, 3] = np.nan
    elif what == "nan-dy":
        dy[1, 2, 3] = np.nan
    elif what == "inf-dy":
        dy[0, 4, 1] = np.inf
    elif what == "x*1e19":
        x = x * 1e19
    x, dy = xp.asarray(x.astype(layer.dtype)), xp.asarray(dy.astype(layer.dtype))
    with np.errstate(over="ignore", invalid="ignore"):
        y, cache = layer.forward(x)
        dx, grads = layer.backward(dy, cache)
    return y, dx, grads, layer.last_report  # the forward's findings and the backward's


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("what", ["nan-x", "nan-dy", "inf-dy", "x*1e19"])
@pytest.mark.parametrize("mode", ["correct", "detect"])
def test_attention_passes_the_users_nonfinite_data_through(xp, dtype, what, mode):
    met = 0
    for causal in (False, True):
        y, dx, grads, report = attention_case(xp, dtype, what, mode, causal)
        y0, dx0, grads0, _ = attention_case(xp, dtype, what, "off", causal)
        same(y, y0)
        same(dx, dx0)
        for key in grads0:
            same(grads[key], grads0[key])
        only_passed_through(report)
        met += len(report.events)
    # the case is real: some product met INF/NaN (x*1e19: the scores ~1e38 overflow below
    # float64; on the CPU's fused core bfloat16 tiles run in float32, where only the non-causal
    # layer's weight gradients overflow)
    if not (what == "x*1e19" and dtype == "float64"):
        assert met


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("site", ["scores", "softmax", "softmax_backward"])
@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_attention_fault_beside_the_users_nan_is_caught(xp, site, kind):
    """A NaN in dy makes some rows of dP and dS non-finite; a fault in batch 0 (finite there)
    must still be caught and leave the outputs and gradients of plain math."""
    def run(hook, check):
        layer = MultiHeadAttention(8, 2, dtype="float64", xp=xp, seed=0, check=check)
        rng = np.random.default_rng(13)
        x, dy = rng.standard_normal((2, 6, 8)), rng.standard_normal((2, 6, 8))
        dy[1, 2, 3] = np.nan
        y, cache = layer.forward(xp.asarray(x), fault_hook=hook)
        dx, grads = layer.backward(xp.asarray(dy), cache, fault_hook=hook)
        return y, dx, grads, layer.last_report

    y0, dx0, grads0, _ = run(None, "off")
    y, dx, grads, report = run(Fault(kind, "element", seed=1, sites=site, batch=0), "correct")
    assert report.detected and site in report.sites, report.summary()
    # A rebuilt element carries its checksum's rounding, which spreads downstream: the float64
    # tolerance of tests/test_attention.py (1e-10 of the largest magnitude, O(1) data here).
    for got, want in [(y, y0), (dx, dx0)] + [(grads[k], grads0[k]) for k in grads0]:
        got, want = to_host(got), to_host(want)
        assert (np.isnan(got) == np.isnan(want)).all()
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=0,
                                   atol=1e-10 * max(np.abs(want[finite]).max(initial=0), 1))
