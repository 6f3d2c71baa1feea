"""Properties of abftgemm.matmul, one body per property, run on every backend present."""
from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16
from hypothesis import given
from hypothesis import strategies as st

import abftgemm
from abftgemm.backend import to_host
from abftgemm import testing as at
from abftgemm.faults import Fault
from conftest import BACKENDS

DTYPES = [pytest.param(d, id=np.dtype(d).name) for d in abftgemm.SUPPORTED_DTYPES]
EXTREME = ("inf", "-inf", "nan", "near-inf")


def to(xp, *arrays):
    return tuple(xp.asarray(x) for x in arrays)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
def test_clean_products_match_reference_and_are_never_flagged(xp, dtype, data):
    integer = data.draw(st.booleans(), label="integer_valued")
    a, b = data.draw(at.operand_pairs(dtype, integer_valued=integer))
    a, b = to(xp, a, b)
    c, report = abftgemm.matmul(a, b, return_report=True)
    assert not report.detected, report.summary()
    assert c.shape == np.matmul(to_host(a), to_host(b)).shape
    at.assert_matches_reference(c, a, b)
    if integer:
        np.testing.assert_array_equal(to_host(c).astype(np.float64), at.reference(a, b))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_subnormal_operands_count_in_the_checksums(xp, dtype):
    """A mostly subnormal a (underflowed gradients) times a b of magnitude >= 1 gives a normal
    product, which the checksums must predict with a's subnormals: on the GPU, -ftz=true had made
    every float -> double widening flush them to 0, a false flag that repair could not clear (a
    spurious UncorrectableError)."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    a = rng.integers(-2**20, 2**20, (2, 48, 40)) * tiny  # subnormal in float32 and bfloat16
    b = rng.uniform(1e20, 1e21, (40, 24))  # the product is of order 1e-18: normal
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    a, b = a.astype(dt), b.astype(dt)
    assert (np.abs(a.astype(np.float64)) < np.finfo(np.float32).tiny).all()
    c, report = abftgemm.matmul(*to(xp, a, b), return_report=True)
    assert not report.detected, report.summary()
    at.assert_matches_reference(c, *to(xp, a, b))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("shapes", [((1, 1), (1, 1)), ((3, 1), (1, 4)), ((1, 5), (5, 1)),
                                    ((5,), (5,)), ((5,), (5, 3)), ((2, 5), (5,)),
                                    ((0, 4), (4, 3)), ((2, 0), (0, 3)), ((2, 4), (4, 0)),
                                    ((0, 2, 3), (3, 4)), ((2, 1, 3, 4), (1, 3, 4, 2))])
def test_edge_shapes_match_numpy(xp, shapes):
    rng = np.random.default_rng(0)
    a, b = (rng.integers(-3, 4, size=s).astype(np.float32) for s in shapes)
    c = abftgemm.matmul(*to(xp, a, b))
    np.testing.assert_array_equal(to_host(c), np.matmul(a, b))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("directions", ["columns", "both"])
@given(data=st.data())
def test_single_fault_is_corrected_or_within_rounding_noise(xp, dtype, directions, data):
    """Every kind and pattern: the output equals the fault-free one, or the fault was too small
    for the checks of ``directions`` to tell from rounding: every checked vector's error sums
    stay within twice its threshold (abftgemm.testing.checksum_error_ratio); and a fault whose
    sums stand out beyond that is detected."""
    a, b = data.draw(at.operand_pairs(dtype, at.matmul_shapes(min_side=2, max_k=8)))
    fault = data.draw(at.faults())
    a, b = to(xp, a, b)
    clean = abftgemm.matmul(a, b, check="off")
    c, report = abftgemm.matmul(a, b, fault_hook=fault, return_report=True,
                                directions=directions)
    assert np.isfinite(to_host(c)).all()
    at.assert_protected(c, a, b, report, directions=directions)
    # The injected change alone, as verification saw it: beyond 2 thresholds it must be flagged
    # (the vector's rounding is below one threshold, so its checksum difference exceeds one).
    injected = at.checksum_error_ratio(c_faulty_copy(fault, clean), clean, a, b, directions)
    if (injected > 2).any():
        assert report.detected and report.sites == {"matmul"}, (fault.injected, report.summary())


def c_faulty_copy(fault, clean):
    """The fault-free product with the recorded injection applied (what verification saw)."""
    faulty = to_host(clean).astype(np.float64).copy()
    for inj in fault.injected:
        faulty[inj.batch + (np.array(inj.rows), np.array(inj.cols))] = inj.new
    return faulty


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EXTREME + ("exponent-bitflip",))
@pytest.mark.parametrize("pattern", ["element", "row", "column", "tile", "warp"])
def test_extreme_faults_are_always_detected_and_corrected(xp, dtype, kind, pattern):
    """INF, NaN, near-INF, and flips of the top exponent bit of values below 2 (which make them
    huge: above 2 the same flip makes them tiny, a small error covered by the test above)."""
    rng = np.random.default_rng(7)
    a = rng.choice([-1.0, -0.5, 0.5, 1.0], size=(2, 40, 1)).astype(dtype)
    b = rng.choice([-1.5, -1.0, -0.5, 0.5, 1.0, 1.5], size=(1, 36)).astype(dtype)
    a, b = to(xp, a, b)  # every product element is in [0.25, 1.5]
    fault = (Fault("bitflip", pattern, seed=3, bit=at.exponent_bits(dtype)[-1])
             if kind == "exponent-bitflip" else Fault(kind, pattern, seed=3))
    c, report = abftgemm.matmul(a, b, fault_hook=fault, return_report=True)
    assert report.detected, report.summary()
    np.testing.assert_array_equal(to_host(c), to_host(abftgemm.matmul(a, b, check="off")))
    expected = {"element": "0D", "row": "1R", "column": "1C"}.get(pattern)
    if expected:
        assert {e.pattern for e in report.events} == {expected}, report.summary()
        assert report.corrected == len(fault.injected[0].rows) and report.recomputed == 0


@pytest.mark.parametrize("xp", BACKENDS)
def test_2d_faults_are_recomputed(xp):
    rng = np.random.default_rng(1)  # integer-valued: a recomputed row is bitwise the original
    a, b = to(xp, rng.integers(-5, 6, (64, 32)).astype(np.float32),
              rng.integers(-5, 6, (32, 48)).astype(np.float32))

    def hook(site, c):
        c[3:6, 10:12] = 1e6  # two errors in each of several rows and columns
    c, report = abftgemm.matmul(a, b, fault_hook=hook, return_report=True)
    assert report.recomputed >= 1 and {e.pattern for e in report.events} == {"2D"}
    np.testing.assert_array_equal(to_host(c), to_host(abftgemm.matmul(a, b, check="off")))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_errors_that_locate_like_single_ones_are_never_rebuilt_into_invisible_ones(xp, dtype):
    """Found by the deep hypothesis profile: a 4x4 tile of equal-magnitude errors whose signs make
    every row's weighted checksum point at one column. Rebuilding those "single" errors left a
    +-v pattern whose row, column and weighted sums all cancel: verified clean, returned wrong.
    Repairs now recompute the located elements' vectors and re-verify, and that sees the errors
    left."""
    a = np.zeros((12, 7), dtype)
    a[0:4, 0] = 1
    b = np.ones((7, 8), dtype)
    a, b = to(xp, a, b)  # the product is 1 in rows 0-3, 0 in the rows of the tile
    signs = np.array([[1, 1, 1, -1], [1, 1, -1, 1], [1, 1, -1, 1], [1, 1, 1, -1]])

    def hook(site, c):
        # Each row's errors (cols 3-6, weights 4/8..7/8) sum to 2 v with weighted sum 8/8 v or
        # 10/8 v: "a single error" at col 3 or 4. Columns 5 and 6 cancel in every checksum.
        c[7:11, 3:7] = xp.asarray((signs * 16).astype(c.dtype))

    c, report = abftgemm.matmul(a, b, fault_hook=hook, return_report=True)
    assert report.detected and report.recomputed >= 1, report.summary()
    np.testing.assert_array_equal(to_host(c), to_host(abftgemm.matmul(a, b, check="off")))


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_corrected_column_holds_what_a_clean_product_holds(xp):
    """A bfloat16 multi-bit fault (bits 7 and 12) on a whole column changes all 128 rows of it.
    111 rows flag and locate their element; the other 17 stay under their rows' thresholds. The
    repair used to rebuild the 111 from their row checksums and report "corrected": the 17 stayed
    wrong by up to 1.98 and the rebuilt ones by up to 0.67 (each carried its row's rounding),
    while the clean product errs by at most 0.124 anywhere, and the column still verified. Now the
    column is recomputed, and since that changed more than the located elements, the flagged rows
    and columns are recomputed and the report says so: every element is within the clean
    product's own worst error, and nothing is called "corrected"."""
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((128, 128)).astype(bfloat16) for _ in range(2))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    a, b = to(xp, a, b)
    fault = Fault("multibit", "column", seed=5)
    c, report = abftgemm.matmul(a, b, fault_hook=fault, return_report=True)
    assert fault.injected[0].bits == (7, 12) and all(fault.injected[0].changed)
    [event] = report.events
    assert (event.pattern, event.action) == ("1C", "recomputed"), report.summary()
    assert len(event.rows) < 128 and "flagged rows and columns" in event.verified, report.summary()
    at.assert_matches_reference(c, a, b)
    clean_error = np.abs(to_host(abftgemm.matmul(a, b, check="off")).astype(np.float64) - ref)
    error = np.abs(to_host(c).astype(np.float64) - ref)
    assert error.max() <= clean_error.max(), (error.max(), clean_error.max())


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_detect_reports_and_never_modifies(xp, dtype):
    rng = np.random.default_rng(2)
    a, b = to(xp, rng.integers(-3, 4, (20, 8)).astype(dtype), rng.integers(-3, 4, (8, 24)).astype(dtype))
    fault = Fault("nan", "row", seed=0)
    c, report = abftgemm.matmul(a, b, check="detect", fault_hook=fault, return_report=True)
    assert report.detected and [e.action for e in report.events] == ["reported"]
    row = fault.injected[0].rows[0]
    assert np.isnan(to_host(c)[row]).all() and np.isfinite(np.delete(to_host(c), row, axis=0)).all()


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_off_is_the_plain_product(xp, dtype):
    rng = np.random.default_rng(3)
    a, b = to(xp, rng.standard_normal((3, 17, 9)).astype(dtype), rng.standard_normal((9, 5)).astype(dtype))
    fault = Fault("inf", "element", seed=0)
    c, report = abftgemm.matmul(a, b, check="off", fault_hook=fault, return_report=True)
    assert report.events == [] and report.checked == {}
    assert np.isinf(to_host(c)).sum() == 1
    c_plain = abftgemm.matmul(a, b, check="off")
    at.assert_matches_reference(c_plain, a, b)
    if np.dtype(dtype) in (np.float32, np.float64) and xp is np:
        # a batch sharing one b is computed as one 2-D product (abftgemm._cpu_triangles)
        np.testing.assert_array_equal(c_plain, np.matmul(a.reshape(-1, 9), b).reshape(3, 17, 5))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nonfinite_inputs_pass_through_and_are_reported(xp, bad):
    rng = np.random.default_rng(4)
    a = rng.integers(-3, 4, (2, 10, 6)).astype(np.float32)
    b = rng.integers(1, 4, (6, 7)).astype(np.float32)
    a[1, 4, 2] = bad
    expected = np.matmul(a, b)
    fault = Fault("additive", "element", seed=0, batch=1, row=7, col=3, magnitude=100.0)
    c, report = abftgemm.matmul(*to(xp, a, b), fault_hook=fault, return_report=True)
    np.testing.assert_array_equal(to_host(c), expected)  # NaN positions compare equal too
    kinds = {e.pattern for e in report.events}
    assert "input-nonfinite" in kinds and report.detected  # the fault in a clean row is still fixed
    nonfinite = [e for e in report.events if e.pattern == "input-nonfinite"]
    assert nonfinite[0].batch == 1 and nonfinite[0].rows == (4,)


@pytest.mark.parametrize("xp", BACKENDS)
def test_bias_is_inside_the_protection(xp):
    rng = np.random.default_rng(5)
    a, b, bias = (rng.integers(-3, 4, s).astype(np.float32) for s in ((4, 12, 8), (8, 6), (6,)))
    fault = Fault("near-inf", "column", seed=0)
    c, report = abftgemm.matmul(*to(xp, a, b), bias=xp.asarray(bias), fault_hook=fault,
                                return_report=True)
    np.testing.assert_array_equal(to_host(c), a @ b + bias)
    assert report.corrected == 12


@pytest.mark.parametrize("xp", BACKENDS)
def test_checksum_passing_chains_products_without_encoding(xp):
    rng = np.random.default_rng(6)
    x, w1, w2 = (rng.integers(-2, 3, s).astype(np.float64) for s in ((3, 16, 8), (8, 8), (8, 5)))
    x, w1, w2 = to(xp, x, w1, w2)
    h, sums = abftgemm.matmul(x, w1, return_checksums=True)
    ref_cols = np.stack([to_host(h).sum(1), (np.arange(1, 17)[:, None] / 16 * to_host(h)).sum(1),
                         np.abs(to_host(h)).sum(1)])
    np.testing.assert_array_equal(to_host(sums.cols), ref_cols)
    encoded = abftgemm.checksums_of(h, rows=False)
    np.testing.assert_allclose(to_host(encoded.cols), ref_cols, rtol=1e-12)
    assert encoded.rows is None and abftgemm.checksums_of(h).rows.shape == (3, 3, 16)
    fault = Fault("bitflip", "element", seed=1, bit=62)
    y, report = abftgemm.matmul(h, w2, a_checksums=sums, fault_hook=fault, return_report=True)
    np.testing.assert_array_equal(to_host(y), to_host(h) @ to_host(w2))
    assert report.corrected == 1


@pytest.mark.parametrize("xp", BACKENDS)
def test_corrupted_passed_checksum_is_recomputed_not_corrected_into_data(xp):
    rng = np.random.default_rng(8)
    a, b = to(xp, rng.integers(-2, 3, (12, 8)).astype(np.float32), rng.integers(-2, 3, (8, 10)).astype(np.float32))
    _, sums = abftgemm.matmul(a, xp.eye(8, dtype=np.float32), return_checksums=True)
    bad_cols = sums.cols.copy()
    bad_cols[0, 0, 3] += 50.0  # column 3 of a: its checksum no longer matches the data
    c, report = abftgemm.matmul(a, b, a_checksums=abftgemm.Checksums(cols=bad_cols),
                                return_report=True)
    np.testing.assert_array_equal(to_host(c), to_host(a) @ to_host(b))
    assert [e.pattern for e in report.events] == ["checksum"]
    assert report.events[0].action == "checksum-recomputed"


@pytest.mark.parametrize("xp", BACKENDS)
def test_uncorrectable_raises_with_report(xp):
    rng = np.random.default_rng(9)
    a, b = to(xp, rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32))
    from abftgemm import backend as backend_module

    be = backend_module.get_backend(xp)
    real_gemm = be.gemm

    def break_(out):  # two errors per vector: checksums cannot rebuild them
        out[..., :2, :2] += 1000

    def broken_gemm(x, y, out, bias, *args, **kwargs):  # a permanently faulty unit: every
        real_gemm(x, y, out, bias, *args, **kwargs)       # recomputation is wrong
        break_(out)
    be.gemm = broken_gemm
    try:  # and the product itself (the GPU plan calls cuBLAS on its own handle)
        with pytest.raises(abftgemm.UncorrectableError) as info:
            abftgemm.matmul(a, b, fault_hook=lambda site, c: break_(c))
    finally:
        del be.gemm
    assert info.value.report.detected


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("a_shape,b_shape,error,match", [
    ((3, 4), (5, 6), ValueError, "inner dimensions"),
    ((2, 3, 4), (3, 4, 5), ValueError, "broadcast"),
    ((), (3, 3), ValueError, "0-d"),
])
def test_bad_shapes_raise_clearly(xp, a_shape, b_shape, error, match):
    a, b = xp.ones(a_shape, dtype=np.float32), xp.ones(b_shape, dtype=np.float32)
    with pytest.raises(error, match=match):
        abftgemm.matmul(a, b)
    assert (to_host(a) == 1).all() and (to_host(b) == 1).all()


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.complex64, np.bool_])
def test_unsupported_dtypes_raise_clearly(xp, dtype):
    a = xp.ones((3, 3), dtype=dtype)
    with pytest.raises(TypeError, match="supports"):
        abftgemm.matmul(a, a)


@pytest.mark.parametrize("xp", BACKENDS)
def test_bad_options_raise_before_anything_is_written(xp):
    a, b = xp.ones((4, 6), dtype=np.float32), xp.ones((6, 5), dtype=np.float32)
    out = xp.full((4, 5), 7.0, dtype=np.float32)
    for options, match in [({"fault_hook": 5}, "fault_hook must be callable"),
                           ({"a_checksums": (1, 2)}, "a_checksums must be the Checksums"),
                           ({"a_checksums": xp.zeros((3, 1, 6))}, "a_checksums must be")]:
        with pytest.raises(TypeError, match=match):
            abftgemm.matmul(a, b, out=out, **options)
        assert (to_host(out) == 7).all()
    for c in (to_host(out).tolist(), None):
        with pytest.raises(TypeError, match="c must be a"):
            abftgemm.verify(c, a, b)
    plan = abftgemm.ProtectedMatmul(a, b)
    for options, match in [({"a_checksums": xp.zeros((3, 1, 6))}, "a_checksums must be"),
                           ({"b_rows": 3}, "b_rows must be")]:
        with pytest.raises(TypeError, match=match):
            plan.execute(a, b, out=out, **options)
        assert (to_host(out) == 7).all()
    with pytest.raises(ValueError, match="capacity"):
        abftgemm.PlanCache(capacity=True)


def test_verify_takes_what_matmul_returns_for_two_vectors():
    """``matmul(v, v)`` is a NumPy scalar, as ``numpy.matmul`` gives it; ``verify`` takes it."""
    v = np.arange(1.0, 6.0)
    c = abftgemm.matmul(v, v)
    assert isinstance(c, np.float64) and c == 55.0
    assert abftgemm.verify(c, v, v).clean
    assert not abftgemm.verify(np.float64(56.0), v, v).clean


@pytest.mark.parametrize("xp", BACKENDS)
def test_mixed_inputs_raise_clearly(xp):
    # Mixed float dtypes and array-likes: tests/test_numpy_semantics.py.
    a = xp.ones((3, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="check must be"):
        abftgemm.matmul(a, a, check="fix")


@pytest.mark.parametrize("xp", BACKENDS[1:])  # the CuPy backends
def test_mixed_numpy_and_cupy_raise_clearly(xp):
    with pytest.raises(TypeError, match="mix NumPy and CuPy"):
        abftgemm.matmul(np.ones((2, 2), np.float32), xp.ones((2, 2), np.float32))


@pytest.mark.parametrize("xp", BACKENDS)
def test_transposed_and_strided_operands(xp):
    rng = np.random.default_rng(10)
    a = rng.integers(-3, 4, (2, 9, 7)).astype(np.float32)
    b = rng.integers(-3, 4, (2, 5, 9)).astype(np.float32)
    c = abftgemm.matmul(xp.asarray(a).transpose(0, 2, 1), xp.asarray(b).transpose(0, 2, 1))
    np.testing.assert_array_equal(to_host(c), a.transpose(0, 2, 1) @ b.transpose(0, 2, 1))
    c = abftgemm.matmul(xp.asarray(a)[:, ::2, :], xp.asarray(b)[0, :, 1:8].T)
    np.testing.assert_array_equal(to_host(c), a[:, ::2, :] @ b[0, :, 1:8].T)


@pytest.mark.parametrize("xp", BACKENDS)
def test_overflow_is_passed_through_as_inf_like_plain_matmul(xp):
    a = np.full((3, 9), 100, dtype=np.float16)
    b = np.full((9, 2), 73, dtype=np.float16)
    b[:, 1] = 1
    c, report = abftgemm.matmul(*to(xp, a, b), return_report=True)
    assert np.isinf(to_host(c)[:, 0]).all() and (to_host(c)[:, 1] == 900).all()
    assert not report.detected and {e.pattern for e in report.events} == {"overflow"}


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("pattern,expected", [("element", "0D"), ("column", "1C"),
                                              ("row", None), ("tile", None)])
def test_row_verification_by_the_consumer_repairs_the_product(xp, pattern, expected):
    """A plan whose consumer observes the row checksums: the rare path repairs what they flag."""
    from abftgemm.backend import get_backend

    rng = np.random.default_rng(11)
    a, b = to(xp, rng.integers(-3, 4, (2, 24, 8)).astype(np.float32),
              rng.integers(-3, 4, (2, 8, 20)).astype(np.float32))
    fault = Fault("near-inf", pattern, seed=2)
    plan = abftgemm.ProtectedMatmul(a, b, directions="rows by consumer")
    c = plan.execute(a, b, fault_hook=fault)
    get_backend(xp).row_reduce(c, None, plan.observed)
    plan.judge()
    report = plan.settle()
    assert report.detected and report.checked == {"matmul": 2}
    assert plan.counters.rare_paths == 1
    np.testing.assert_array_equal(to_host(c), to_host(a) @ to_host(b))
    if expected:
        assert [e.pattern for e in report.events] == [expected]
    with pytest.raises(ValueError, match="no bias"):
        abftgemm.ProtectedMatmul(a, b, bias=b[0, 0], directions="rows by consumer")


def _one_sided_rounding(kind: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Clean operands whose accumulation rounds every addend away in one direction: rows of
    ``[1, u, ..., u]`` against ones (each ``u``, half an ulp of the partial sum 1, lost to ties
    to even), or ``[1, u, ..., u, -1]``, whose float32 sum is 0 where the exact one is ``(k -
    2) u``. The checksum threshold's accumulation term is statistical (``sqrt(k)``); these
    reach about ``k / (16 sqrt(k))`` of it."""
    dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}[kind]
    a = np.full((4, k), 2.0 ** -12)
    b = np.full((k, 4), 2.0 ** -12)
    a[:, 0], b[0] = 1.0, 1.0
    if kind != "float32":  # 16-bit data, float32 accumulation: the cancelling form
        a[:, -1], b[-1] = -1.0, 1.0
    if kind == "float16":  # above float16's underflow floor in the threshold: products 2**15
        a, b = a * 2.0 ** 7, b * 2.0 ** 8
    return a.astype(dtype), b.astype(dtype)


def _sequential(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` (host arrays, ``(..., m, k)`` by ``(..., k, n)``) summed in float32 addend
    after addend, in order (16-bit data rounded once at the end, as the backends' float32
    accumulation does): a BLAS that rounds the rows of :func:`_one_sided_rounding` one-sided.
    OpenBLAS's kernels with several partial sums (its AVX-512 ones) keep the small addends."""
    acc = np.zeros(np.broadcast_shapes(a.shape[:-1] + (1,), b.shape[:-2] + (1, b.shape[-1])),
                   np.float32)
    for i in range(a.shape[-1]):
        acc += a[..., :, i:i + 1].astype(np.float32) * b[..., i:i + 1, :].astype(np.float32)
    return acc.astype(a.dtype)


def _rounding_one_sided(xp, monkeypatch) -> None:
    """The backend's GEMM made :func:`_sequential`, whatever BLAS the machine has."""
    be = abftgemm.backend.get_backend(xp)
    gemm = be.gemm

    def sequential(x, y, out, *args, **kwargs):
        gemm(x, y, out, *args, **kwargs)
        out[...] = xp.asarray(_sequential(to_host(x), to_host(y)))

    monkeypatch.setattr(be, "gemm", sequential)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("kind,k", [("float32", 256), ("float16", 320), ("bfloat16", 320)])
def test_clean_product_with_one_sided_rounding_is_not_a_fault(xp, kind, k, monkeypatch):
    """Clean data that the checksums flag (rounding one-sided beyond their statistical term):
    ``check="correct"`` raised ``UncorrectableError`` (the recomputation repeats the rounding),
    ``"detect"`` warned. Every element lies within its rigorous rounding bound of the exact
    product, and the product is the same computed again: delivered as the GEMM computes it,
    with a ``"rounding"`` finding that is not a fault (no warning, ``detected`` False). The
    GEMM is :func:`_sequential`: BLAS kernels that keep several partial sums do not round
    these rows one-sided."""
    import warnings

    a, b = _one_sided_rounding(kind, k)
    ga, gb = xp.asarray(a), xp.asarray(b)
    _rounding_one_sided(xp, monkeypatch)
    flagged = False
    for check in ("correct", "detect"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c, report = abftgemm.matmul(ga, gb, check=check, return_report=True)
        assert not report.detected, report.summary()
        assert all(e.pattern == "rounding" and e.action == "passed-through"
                   for e in report.events), report.summary()
        flagged |= bool(report.events)
        np.testing.assert_array_equal(to_host(c), _sequential(a, b))
    assert flagged  # the data does reach past the statistical term


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_fault_repeated_by_every_recomputation_still_raises_on_such_data(xp, monkeypatch):
    """The rounding test does not pass a product that a fault keeps wrong: a GEMM that adds 1e-3
    to one element on every call (about 30 column thresholds, far beyond that element's
    rounding bound), nor label a wrong handed-on checksum (detect mode) or a repaired transient
    fault (correct mode) rounding."""
    a, b = _one_sided_rounding("float32", 256)
    ga, gb = xp.asarray(a), xp.asarray(b)
    _rounding_one_sided(xp, monkeypatch)
    be = abftgemm.backend.get_backend(xp)
    gemm = be.gemm

    def faulty(x, y, out, *args, **kwargs):
        gemm(x, y, out, *args, **kwargs)
        out[..., 1, 2] += 1e-3

    monkeypatch.setattr(be, "gemm", faulty)
    with pytest.raises(abftgemm.UncorrectableError):
        abftgemm.matmul(ga, gb, check="correct")
    monkeypatch.setattr(be, "gemm", gemm)
    # a wrong handed-on encoding: the data verifies against fresh ones (it was "rounding")
    sums = abftgemm.checksums_of(ga)
    sums.cols[0, 0, 0] += 1.0
    with pytest.warns(abftgemm.FaultDetectedWarning):
        _, report = abftgemm.matmul(ga, gb, check="detect", a_checksums=sums,
                                    return_report=True)
    assert report.detected and {e.action for e in report.events} == {"reported"}
    # a transient fault beside the rounding, repaired: reported as such, not as rounding
    rng = np.random.default_rng(3)
    rows = np.concatenate([a, rng.standard_normal((4, a.shape[1])).astype(a.dtype)])
    hook = Fault("additive", "element", seed=1, magnitude=4e-5, times=1, row=6, col=1)
    c, report = abftgemm.matmul(xp.asarray(rows), gb, check="correct", fault_hook=hook,
                                return_report=True)
    assert hook.injected and report.detected, report.summary()
    assert not any(e.pattern == "rounding" for e in report.events), report.summary()
    np.testing.assert_array_equal(to_host(c), _sequential(rows, b))
