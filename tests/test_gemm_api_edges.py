"""The public GEMM API at its edges (abftgemm.matmul, ProtectedMatmul, verify, abftgemm.testing):
plans shared by threads, odd layouts and options, refused calls, the testing helpers.

Tests marked xfail(strict=True) are known bugs, each named in its reason.
"""
from __future__ import annotations

import importlib
import shutil
import threading
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import abftgemm
from abftgemm import ProtectedMatmul
from abftgemm import testing as at
from abftgemm.backend import to_host
from abftgemm.faults import Fault
from conftest import BACKENDS


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------- concurrency


def test_a_second_execute_of_a_shared_plan_while_one_is_in_flight_is_refused():
    rng = np.random.default_rng(0)
    a1, b1, a2, b2 = _f32(rng, 32, 16), _f32(rng, 16, 24), _f32(rng, 32, 16), _f32(rng, 16, 24)
    plan = ProtectedMatmul(a1, b1)
    in_flight, go_on = threading.Event(), threading.Event()

    def slow_gemm_hook(site, c):  # stands for a GEMM that takes a while in the first thread
        in_flight.set()
        go_on.wait(10)

    first = threading.Thread(target=lambda: plan.execute(a1, b1, fault_hook=slow_gemm_hook))
    first.start()
    try:
        assert in_flight.wait(10)
        with pytest.raises(RuntimeError):
            plan.execute(a2, b2, out=np.empty((32, 24), np.float32))
    finally:
        go_on.set()
        first.join()
        plan.abandon()


def test_two_threads_sharing_a_plan_never_get_wrong_data_silently():
    rng = np.random.default_rng(1)
    a1, b1, a2, b2 = _f32(rng, 32, 16), _f32(rng, 16, 24), _f32(rng, 16 * 2, 16), _f32(rng, 16, 24)
    plan = ProtectedMatmul(a1, b1)
    in_flight, go_on = threading.Event(), threading.Event()
    out1 = np.asfortranarray(np.full((32, 24), np.nan, np.float32))
    out2 = np.asfortranarray(np.full((32, 24), np.nan, np.float32))
    outcome = {}

    def hook(site, c):
        in_flight.set()
        go_on.wait(10)

    def first_thread():
        plan.execute(a1, b1, out=out1, fault_hook=hook, name="first")

    first = threading.Thread(target=first_thread)
    first.start()
    assert in_flight.wait(10)
    try:
        plan.execute(a2, b2, out=out2, name="second")  # should have been refused
    except RuntimeError:
        outcome["refused"] = True
    go_on.set()
    first.join()
    if outcome.get("refused"):
        report = plan.settle()
        np.testing.assert_allclose(out1, a1 @ b1, rtol=1e-5, atol=1e-5)
        return
    report = plan.settle()  # the second call's settle, from its own thread
    # whatever the library does, the call that settled must have its own result and report
    assert list(report.checked) == ["second"], report.checked
    np.testing.assert_allclose(out2, a2 @ b2, rtol=1e-5, atol=1e-5)


def test_matmul_from_several_threads_right_results_and_own_reports():
    errors = []

    def worker(t):
        rng = np.random.default_rng(t)
        for i in range(12):
            a, b = _f32(rng, 48, 40), _f32(rng, 40, 32)
            out = np.asfortranarray(np.empty((48, 32), np.float32)) if i % 2 else None
            fault = Fault("bitflip", "element", seed=7 * t + i, bit=30) if i % 3 == 0 else None
            name = f"t{t}i{i}"
            if t == 0 and i % 4 == 0:
                abftgemm.set_threads(1 if i % 8 else None)
            c, rep = abftgemm.matmul(a, b, out=out, return_report=True, fault_hook=fault,
                                     name=name)
            if out is not None and c is not out:
                errors.append((name, "not out"))
            if not np.allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4):
                errors.append((name, "wrong values"))
            if set(rep.checked) != {name} or any(e.site != name for e in rep.events):
                errors.append((name, "report of another call", rep.summary()))
            if rep.detected != (fault is not None):
                errors.append((name, "detected", rep.detected))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    try:
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        abftgemm.set_threads(None)
    assert not errors, errors[:3]


# --------------------------------------------------------------------------- abftgemm.testing


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(ab=at.operand_pairs(np.float16, integer_valued=False))
def test_operand_pairs_float16_has_no_subnormals(ab):
    tiny = np.finfo(np.float16).tiny
    for x in ab:
        x32 = x.astype(np.float32)
        assert not ((x32 != 0) & (np.abs(x32) < tiny)).any(), x


@pytest.mark.parametrize("shapes", [((3, 4), (4,)), ((4,), (4, 3)), ((4,), (4,))],
                         ids=["2d@1d", "1d@2d", "1d@1d"])
def test_silent_error_bound_takes_1d_operands(shapes):
    a, b = np.ones(shapes[0], np.float32), np.ones(shapes[1], np.float32)
    c = abftgemm.matmul(a, b)
    bound = at.silent_error_bound(a, b, c)
    assert np.shape(bound) == np.shape(c)
    assert (np.asarray(bound) > 0).all()


@settings(max_examples=50, deadline=None, database=None)
@given(shapes=at.matmul_shapes(min_side=0, max_k=0))
def test_matmul_shapes_honours_max_k_zero(shapes):
    a_shape, b_shape = shapes
    assert a_shape[-1] == 0 and b_shape[-2] == 0


@pytest.mark.parametrize("case", ["scalar for (3, 5)", "(1, 1) for vector @ vector"])
def test_assert_matches_reference_fails_on_a_wrong_shape(case):
    if case == "scalar for (3, 5)":
        a, b, wrong = np.ones((3, 4), np.float32), np.ones((4, 5), np.float32), np.float32(4)
    else:
        a = b = np.ones(4, np.float32)
        wrong = np.full((1, 1), 4, np.float32)
    at.assert_matches_reference(abftgemm.matmul(a, b), a, b)
    with pytest.raises(AssertionError):
        at.assert_matches_reference(wrong, a, b)


@pytest.mark.parametrize("helper", ["assert_matches_reference", "assert_protected",
                                    "checksum_error_ratio", "silent_error_bound"])
def test_testing_helpers_accept_inf_inputs_with_warnings_as_errors(helper):
    a = np.array([[np.inf, 1.0], [1.0, 2.0]], np.float32)
    b = np.ones((2, 2), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c, report = abftgemm.matmul(a, b, return_report=True)
        if helper == "assert_matches_reference":
            at.assert_matches_reference(c, a, b)
        elif helper == "assert_protected":
            at.assert_protected(c, a, b, report)
        elif helper == "checksum_error_ratio":
            assert (at.checksum_error_ratio(c, c, a, b) == 0).all()
        else:
            at.silent_error_bound(a, b, c)


# --------------------------------------------------------------------------- verify


def _sequential_float32_product(a, b):
    """a @ b as a naive GEMM computes it: each dot product summed term by term in float32."""
    terms = a.astype(np.float32)[:, :, None] * b.astype(np.float32)[None, :, :]
    return np.cumsum(terms, axis=1, dtype=np.float32)[:, -1, :]


def test_verify_accepts_a_clean_product_summed_in_another_order():
    # np.einsum("ik,kj->ij", a, b) gave the same c on the 2-core AMD EPYC of this hunt; the
    # explicit term-by-term sum keeps the case independent of einsum's SIMD order
    k = 4096
    a, b = np.full((8, k), 0.1, np.float32), np.ones((k, 8), np.float32)
    c = _sequential_float32_product(a, b)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    u = 2.0 ** -24
    gamma = (k + 1) * u / (1 - (k + 1) * u)
    rigorous = gamma * (np.abs(a).astype(np.float64) @ np.abs(b)) + u * np.abs(c)
    assert (np.abs(c - exact) <= rigorous).all()  # a clean product: within Higham's bound
    result = abftgemm.verify(c, a, b)
    assert result.clean, result.report.summary()
    # one-sided rounding beyond the threshold's statistical term: named, not a fault
    assert result.worst_ratio < 1 or {e.pattern for e in result.report.events} == {"rounding"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_data_fault_seen_by_its_row_only_is_not_called_a_checksum_fault(dtype):
    rng = np.random.default_rng(0)
    big = 1e300 if dtype == np.float64 else 1e37
    a, b = rng.random((8, 6)).astype(dtype), rng.random((6, 5)).astype(dtype)
    a[2, :] = big  # column sums dominated by row 2: column thresholds far above O(1) errors
    c = a @ b
    c[5, 1] = c[5, 1] * 3 + 1  # a data fault of about 23, far above row 5's threshold
    _assert_data_fault_located(abftgemm.verify(c, a, b).report, "rows", 5)


@pytest.mark.parametrize("xp", BACKENDS)
def test_verify_never_writes_to_c_not_even_when_c_is_a_view_of_a_larger_array(xp, monkeypatch):
    rng = np.random.default_rng(0)
    a, b = xp.asarray(_f32(rng, 8, 6)), xp.asarray(_f32(rng, 6, 5))
    whole = xp.zeros((3, 8, 5), np.float32)
    c = whole[1]  # C-contiguous, and a view of whole
    c[...] = abftgemm.matmul(a, b, check="off")
    before = to_host(whole).copy()
    module = importlib.import_module("abftgemm.verify")  # abftgemm.verify is the function
    settle = module.settle

    def settle_that_writes(be, op, out, *args, **kwargs):
        out[...] = -1  # whatever verify's checks did to their array must not reach c
        return settle(be, op, out, *args, **kwargs)

    monkeypatch.setattr(module, "settle", settle_that_writes)
    abftgemm.verify(c, a, b)
    np.testing.assert_array_equal(to_host(whole), before)


def _assert_data_fault_located(report, axis: str, index: int) -> None:
    """The report flags a data fault, calls none of its findings a checksum fault, and names
    ``index`` among the ``axis`` ("rows" or "cols") of one."""
    assert report.detected
    assert "checksum" not in [e.pattern for e in report.events], report.summary()
    assert any(index in getattr(e, axis) for e in report.events), report.summary()


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("directions", ["columns", "both"])
def test_a_data_fault_seen_by_its_column_only_is_located_not_called_a_checksum(xp, directions):
    rng = np.random.default_rng(0)
    a, b = rng.random((8, 6)), rng.random((6, 5))
    b[:, 2] = 1e300  # every row sum dominated by column 2
    a, b = xp.asarray(a), xp.asarray(b)

    def fault(site, c):
        c[5, 1] = c[5, 1] * 3 + 1

    with pytest.warns(abftgemm.FaultDetectedWarning):
        c, report = abftgemm.matmul(a, b, check="detect", directions=directions,
                                    fault_hook=fault, return_report=True)
    _assert_data_fault_located(report, "cols", 1)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("how", ["matmul detect", "verify"])
def test_an_outlier_column_makes_a_located_fault_a_checksum_finding(xp, how):
    rng = np.random.default_rng(0)
    a, b = _f32(rng, 64, 256), _f32(rng, 256, 64)
    b[:, 0] *= 1e4
    a, b = xp.asarray(a), xp.asarray(b)

    def fault(site, c):
        c[10, 5] += 1.0

    if how == "verify":
        c = abftgemm.matmul(a, b, check="off")
        fault("verify", c)
        report = abftgemm.verify(c, a, b).report
    else:
        with pytest.warns(abftgemm.FaultDetectedWarning):
            _, report = abftgemm.matmul(a, b, check="detect", fault_hook=fault,
                                        return_report=True)
    assert report.detected
    assert [(e.pattern, e.rows, e.cols) for e in report.events] == [("0D", (10,), (5,))], \
        report.summary()


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("directions", ["columns", "both"])
def test_a_data_fault_seen_by_its_column_only_is_corrected_in_place(xp, directions):
    rng = np.random.default_rng(0)
    a, b = rng.random((8, 6)), rng.random((6, 5))
    b[:, 2] = 1e300  # every row threshold far above the fault
    a, b = xp.asarray(a), xp.asarray(b)

    def fault(site, c):
        c[5, 1] = c[5, 1] * 3 + 1

    c, report = abftgemm.matmul(a, b, directions=directions, fault_hook=fault,
                                return_report=True)
    assert [(e.pattern, e.rows, e.cols, e.action) for e in report.events] == [
        ("0D", (5,), (1,), "corrected")], report.summary()
    np.testing.assert_allclose(to_host(c), to_host(a) @ to_host(b), rtol=1e-12)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("check", ["detect", "correct"])
@pytest.mark.parametrize("outlier_in", ["b's columns", "a's rows"])
@settings(deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_single_data_fault_beside_an_outlier_is_located_and_repaired(
        xp, check, outlier_in, data):
    """One element off by at least 1 (far beyond its column's and row's rounding) while an
    outlier row of ``a`` or column of ``b`` (scaled by 1e4) raises the thresholds of the other
    direction above it: one 0D finding at that element, never a checksum one, corrected in
    place with check="correct". An outlier row of ``a`` hides the fault from the columns, so
    only the rows (directions="both") see it."""
    m, k, n = 32, 64, 24
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    a, b = _f32(rng, m, k), _f32(rng, k, n)
    by_cols = outlier_in == "b's columns"
    outlier = data.draw(st.integers(0, (n if by_cols else m) - 1), label="outlier")
    if by_cols:
        b[:, outlier] *= 1e4
    else:
        a[outlier, :] *= 1e4
    i = data.draw(st.sampled_from([r for r in range(m) if by_cols or r != outlier]), label="i")
    j = data.draw(st.sampled_from([c for c in range(n) if c != outlier or not by_cols]),
                  label="j")
    # 1 to 1e3 against the other direction's thresholds of 1 to 2: some errors only one
    # direction can see, others both
    error = data.draw(st.sampled_from([1.0, -1.0]), label="sign") * 10.0 ** data.draw(
        st.floats(0, 3), label="log10 |error|")

    def fault(site, c):
        c[i, j] += np.float32(error)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", abftgemm.FaultDetectedWarning)
        c, report = abftgemm.matmul(xp.asarray(a), xp.asarray(b), check=check, fault_hook=fault,
                                    directions="columns" if by_cols else "both",
                                    return_report=True)
    action = "corrected" if check == "correct" else "reported"
    assert [(e.pattern, e.rows, e.cols, e.action) for e in report.events] == [
        ("0D", (i,), (j,), action)], report.summary()
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    wrong = np.abs(to_host(c) - a64 @ b64) > 1e-5 * (np.abs(a64) @ np.abs(b64))
    assert [tuple(map(int, ij)) for ij in zip(*wrong.nonzero())] == (
        [] if check == "correct" else [(i, j)])


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("check", ["detect", "correct"])
def test_a_wrong_passed_checksum_that_locates_a_row_is_still_a_checksum_finding(xp, check):
    """A passed column encoding of ``a`` wrong at one column of ``a`` as an error in row 7 of
    ``a @ b`` would be: every flagged column of the product locates row 7, whose row threshold
    (an outlier column of ``b``) is too high to see it; the data verifies against checksums
    derived afresh from the inputs, so the finding is the checksum's, and the data is left as
    computed."""
    rng = np.random.default_rng(3)
    m, k, n = 16, 32, 12
    a, b = _f32(rng, m, k), _f32(rng, k, n)
    b[:, 0] *= 1e4
    b[4, 0] = 0  # the outlier column does not see the wrong encoding of a's column 4
    a, b = xp.asarray(a), xp.asarray(b)
    sums = abftgemm.checksums_of(a, rows=False)
    cols = sums.cols.copy()
    cols[0, 0, 4] += 0.1  # predicted errors up to 0.33: columns' thresholds 1e-3, rows' 0.5
    cols[1, 0, 4] += 0.1 * 8 / m  # the weighted sum's change of an error in row 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", abftgemm.FaultDetectedWarning)
        c, report = abftgemm.matmul(a, b, check=check, return_report=True,
                                    a_checksums=abftgemm.Checksums(cols=cols))
    action = "checksum-recomputed" if check == "correct" else "reported"
    assert [(e.pattern, e.action) for e in report.events] == [("checksum", action)], \
        report.summary()
    np.testing.assert_array_equal(to_host(c), to_host(abftgemm.matmul(a, b, check="off")))


# --------------------------------------------------------------------------- plan state


def test_an_abandoned_16bit_execute_leaves_no_stale_operand_copies():
    rng = np.random.default_rng(0)
    a1, b1, a2, b2 = (rng.standard_normal(s).astype(np.float16)
                      for s in ((16, 8), (8, 12), (16, 8), (8, 12)))
    plan = ProtectedMatmul(a1, b1)

    def failing_hook(site, c):
        raise KeyError("the caller's hook failed")

    with pytest.raises(KeyError):
        plan.execute(a1, b1, fault_hook=failing_hook)
    plan.abandon()
    out = np.empty((16, 12), np.float16)

    def callers_gemm():
        out[...] = np.matmul(a2, b2)

    before = plan.counters.rare_paths
    plan.execute(a2, b2, out=out, gemm=callers_gemm)
    report = plan.settle()
    assert not report.detected
    assert plan.counters.rare_paths == before, "a clean product ran the rare path"


@pytest.mark.parametrize("wrong", [-np.inf, np.nan], ids=["-inf", "nan"])
def test_assert_matches_reference_fails_on_a_wrong_infinity(wrong):
    a = np.array([[np.inf, 1.0]], np.float32)
    b = np.ones((2, 1), np.float32)
    at.assert_matches_reference(abftgemm.matmul(a, b), a, b)  # +inf: right
    with pytest.raises(AssertionError):
        at.assert_matches_reference(np.array([[wrong]], np.float32), a, b)


@pytest.mark.parametrize("wrong", [-np.inf, np.nan], ids=["-inf", "nan"])
def test_assert_protected_fails_on_a_wrong_infinity(wrong):
    a = np.array([[np.inf, 1.0], [1.0, 2.0]], np.float32)
    b = np.ones((2, 2), np.float32)
    c, report = abftgemm.matmul(a, b, return_report=True)
    at.assert_protected(c, a, b, report)
    bad = c.copy()
    bad[0, 0] = wrong
    with pytest.raises(AssertionError):
        at.assert_protected(bad, a, b, abftgemm.Report())


_CONCURRENT_CUDA_ON_CPU = """
import sys, threading
sys.path.insert(0, {tests!r})
import numpy as np
from cuda_on_cpu import standin
with standin.installed() as cp:
    import abftgemm
    errors = []
    def worker(t):
        rng = np.random.default_rng(t)
        for i in range(40):
            a = rng.standard_normal((24, 16)).astype(np.float32)
            b = rng.standard_normal((16, 20)).astype(np.float32)
            c = abftgemm.matmul(cp.asarray(a), cp.asarray(b))
            if not np.allclose(cp.asnumpy(c), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4):
                errors.append((t, i))
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="cupy-on-cpu needs g++")
def test_matmul_from_several_threads_on_cupy_on_cpu():
    import subprocess
    import sys
    from pathlib import Path

    from fresh_python import env_with_checkout

    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run([sys.executable, "-c", _CONCURRENT_CUDA_ON_CPU.format(tests=tests)],
                          env=env_with_checkout(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_a_fault_hook_that_runs_other_products_does_not_break_the_running_call():
    rng = np.random.default_rng(0)
    a, b = _f32(rng, 16, 8), _f32(rng, 8, 12)
    abftgemm.clear_plan_cache()

    def hook_running_other_products(site, c):  # e.g. a recorder computing references
        for i in range(10):
            abftgemm.matmul(np.ones((i + 1, 3), np.float32), np.ones((3, 2), np.float32))

    try:
        c = abftgemm.matmul(a, b, fault_hook=hook_running_other_products)
    finally:
        abftgemm.clear_plan_cache()
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("directions", ["columns", "both"])
@pytest.mark.parametrize("shapes", [((0, 3), (3, 4)), ((2, 0, 3), (3, 4)), ((3, 4), (4, 0)),
                                    ((0, 3, 4), (4, 5))],
                         ids=["m=0", "m=0 batched", "n=0", "batch=0"])
def test_return_checksums_of_an_empty_product_are_checksums(xp, directions, shapes):
    a, b = xp.ones(shapes[0], np.float32), xp.ones(shapes[1], np.float32)
    plan = ProtectedMatmul(a, b, directions=directions)
    plan.execute(a, b)
    plan_report, plan_sums = plan.settle(checksums=True)
    c, report, sums = abftgemm.matmul(a, b, directions=directions, return_report=True,
                                      return_checksums=True)
    assert isinstance(sums, abftgemm.Checksums), sums
    assert c.shape == np.matmul(np.ones(shapes[0]), np.ones(shapes[1])).shape
    for got, want in ((sums.cols, plan_sums.cols), (sums.rows, plan_sums.rows)):
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(to_host(got), to_host(want))
    assert report.checked == plan_report.checked


@pytest.mark.parametrize("xp", BACKENDS)
def test_execute_refuses_a_non_callable_fault_hook_before_writing_out(xp):
    rng = np.random.default_rng(0)
    a, b = xp.asarray(_f32(rng, 6, 5)), xp.asarray(_f32(rng, 5, 4))
    plan = ProtectedMatmul(a, b)
    out = xp.full((6, 4), 7.0, np.float32)
    with pytest.raises(TypeError, match="fault_hook"):
        plan.execute(a, b, out=out, fault_hook=3)
    assert (to_host(out) == 7).all(), "a refused execute wrote out"


@pytest.mark.parametrize("argument", ["counters", "verdicts"])
def test_plan_refuses_wrong_counters_or_verdicts_clearly(argument):
    a, b = np.ones((3, 4), np.float32), np.ones((4, 5), np.float32)
    with pytest.raises(TypeError, match=argument):
        plan = ProtectedMatmul(a, b, **{argument: 5})
        plan.execute(a, b)
        plan.settle()


# --------------------------------------------------------------------------- held: regressions


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("pattern", [None, "element", "column"])
def test_a_reused_plan_delivers_into_an_out_that_overlaps_its_operands(xp, pattern):
    """out = a, out = a's transpose, out overlapping a in part, bias a row of out: each execute
    of one plan computes from the operands as they were, repairs, then delivers."""
    rng = np.random.default_rng(5)
    a0, b0 = _f32(rng, 8, 8), _f32(rng, 8, 8)
    plan = ProtectedMatmul(xp.asarray(a0), xp.asarray(b0), bias=xp.asarray(_f32(rng, 8)))
    for case in ("out=a", "out=b", "out=a.T", "overlap", "bias=out[3]"):
        buf = xp.asarray(np.concatenate([a0, _f32(rng, 4, 8)]))
        a, b, out = buf[:8], xp.asarray(b0.copy()), None
        bias = xp.asarray(_f32(rng, 8))
        if case == "out=a":
            out = a
        elif case == "out=b":
            out = b
        elif case == "out=a.T":
            out = a.T
        elif case == "overlap":
            out = buf[4:12]
        else:
            out = xp.asarray(_f32(rng, 8, 8))
            bias = out[3]
        want = a0.astype(np.float64) @ b0 + to_host(bias).astype(np.float64)
        fault = None if pattern is None else Fault("bitflip", pattern, seed=1, bit=30)
        got = plan.execute(a, b, bias=bias, out=out, fault_hook=fault)
        report = plan.settle()
        assert got is out, case
        np.testing.assert_allclose(to_host(out), want, rtol=1e-5, atol=1e-5, err_msg=case)
        assert report.detected == (fault is not None), (case, report.summary())


@pytest.mark.parametrize("xp", BACKENDS)
def test_refused_calls_on_a_cached_layout_modify_nothing(xp):
    """Once matmul has a plan for the layout (the path that skips validation), a refused call
    raises before writing out, and leaves the operands and the plan as they were."""
    rng = np.random.default_rng(6)
    a, b = xp.asarray(_f32(rng, 3, 6, 5)), xp.asarray(_f32(rng, 5, 4))
    a0, b0 = to_host(a).copy(), to_host(b).copy()
    abftgemm.matmul(a, b, out=xp.empty((3, 6, 4), np.float32))  # caches the plan
    out = xp.full((3, 6, 4), 7.0, np.float32)
    bad = [dict(bias=xp.ones(5, np.float32)), dict(bias=xp.ones((1, 4), np.float32)),
           dict(a_checksums=abftgemm.Checksums(cols=xp.ones((3, 2, 5)))),
           dict(a_checksums=abftgemm.Checksums(cols=xp.ones((3, 3, 5), np.float32))),
           dict(check="fix"), dict(directions="rows"), dict(fault_hook=3), dict(plans={})]
    for kwargs in bad:
        with pytest.raises((TypeError, ValueError)):
            abftgemm.matmul(a, b, out=out, **kwargs)
        assert (to_host(out) == 7).all(), kwargs
    for wrong_out in (xp.zeros((3, 6, 5), np.float32), xp.zeros((3, 6, 4), np.int32)):
        with pytest.raises((TypeError, ValueError)):
            abftgemm.matmul(a, b, out=wrong_out)
        assert not to_host(wrong_out).any()
    np.testing.assert_array_equal(to_host(a), a0)
    np.testing.assert_array_equal(to_host(b), b0)
    c, report = abftgemm.matmul(a, b, out=out, return_report=True,
                                fault_hook=Fault("nan", "element", seed=3))
    assert c is out and report.corrected == 1
    np.testing.assert_allclose(to_host(out), a0.astype(np.float64) @ b0, rtol=1e-5, atol=1e-5)
