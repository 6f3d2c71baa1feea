"""Planned products: same results as the unprotected product, faults repaired, and the structure
of an execute (launches, allocations, host syncs) counted and bounded on every backend."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import abftgemm
from abftgemm import ProtectedMatmul
from abftgemm.checksums import SUPPORTED_DTYPES, unit_roundoff
from abftgemm.faults import KINDS, PATTERNS, Fault
from abftgemm.testing import assert_protected, matmul_shapes, operand_pairs
from tests.conftest import BACKENDS

DTYPES = [pytest.param(d, id=d.name) for d in SUPPORTED_DTYPES]
#: An execute launches the GEMM and two verification kernels; a bias adds one launch (the
#: broadcast before cuBLAS accumulates onto it, or the bias pass on the CPU).
LAUNCHES = 3


def _operands(xp, dtype, shape=(3, 32, 24, 20), bias=False, seed=0):
    batch, m, k, n = shape
    rng = np.random.default_rng(seed)
    # Small integers: every product is exact in every dtype, so results compare with ==.
    a = rng.integers(-2, 3, (batch, m, k)).astype(dtype)
    b = rng.integers(-2, 3, (k, n)).astype(dtype)
    c = rng.integers(-2, 3, n).astype(dtype) if bias else None
    return xp.asarray(a), xp.asarray(b), None if c is None else xp.asarray(c)


def _host(x):
    return abftgemm.backend.to_host(x).astype(np.float64)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("directions", ["columns", "both"])
def test_clean_execute_equals_the_unprotected_product(xp, dtype, bias, directions):
    a, b, c = _operands(xp, dtype, bias=bias)
    with ProtectedMatmul(a, b, bias=c, directions=directions) as plan:
        for _ in range(2):  # a second execute reuses the workspaces
            got = plan.execute(a, b, bias=c)
            report = plan.settle()
            want = abftgemm.matmul(a, b, bias=c, check="off")
            np.testing.assert_array_equal(_host(got), _host(want))
            assert not report.events and report.checked == {"matmul": 3}


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_counts_per_clean_execute(xp, dtype, bias):
    a, b, c = _operands(xp, dtype, bias=bias)
    plan = ProtectedMatmul(a, b, bias=c)
    planned = plan.counters.allocations
    out = xp.empty((3, 32, 20), dtype=a.dtype)
    for i in range(1, 4):
        before = plan.counters.launches
        plan.execute(a, b, bias=c, out=out)
        assert plan.counters.launches - before == LAUNCHES + (c is not None)
        assert plan.counters.syncs == i - 1  # execute never waits for the device
        plan.settle()
        assert plan.counters.syncs == i
        assert plan.counters.allocations == planned
        assert plan.counters.rare_paths == 0
    plan.execute(a, b, bias=c)  # without out=, the result is the one allocation
    plan.settle()
    assert plan.counters.allocations == planned + 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_array_is_allocated_after_planning_numpy(dtype):
    # Independent of the plan's own counter: NumPy reports its data allocations to tracemalloc.
    # Every operand and temporary of this shape is >= 30 KiB (and NumPy's ufunc buffers are
    # 8192 elements), while the Python objects of an execute (an Operands, views) take < 12 KiB.
    a, b, c = _operands(np, dtype, shape=(4, 128, 96, 256), bias=True)
    out = np.empty((4, 128, 256), dtype=a.dtype)
    plan = ProtectedMatmul(a, b, bias=c)
    plan.execute(a, b, bias=c, out=out)
    plan.settle()
    tracemalloc.start()
    try:
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in range(3):
            plan.execute(a, b, bias=c, out=out)
            plan.settle()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - current < 12 * 1024


@pytest.mark.parametrize("xp", BACKENDS)
@given(ab=operand_pairs(np.float32, shapes=matmul_shapes(max_side=10, min_side=2)),
       kind=st.sampled_from(KINDS), pattern=st.sampled_from(PATTERNS),
       seed=st.integers(0, 2**31 - 1), directions=st.sampled_from(["columns", "both"]))
def test_faults_are_repaired_on_the_planned_path(xp, ab, kind, pattern, seed, directions):
    a, b = (xp.asarray(x) for x in ab)
    clean = abftgemm.matmul(a, b, check="off")
    plan = ProtectedMatmul(a, b, directions=directions)
    extra = {"magnitude": 1e3} if kind == "additive" else {}
    got = plan.execute(a, b, fault_hook=Fault(kind, pattern, seed=seed, **extra))
    report = plan.settle()
    assert_protected(got, a, b, report, c_clean=clean, directions=directions)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("layout", ["a^T", "b^T", "both^T"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_column_major_operands_are_predicted_and_repaired(xp, layout, bias):
    """Operands that are transposes of C-contiguous arrays (PyTorch's ``x @ W.T``, attention's
    ``P^T``) take the kernels' row-wise reading: the same products, the same repairs."""
    a, b, c = _operands(xp, np.float32, bias=bias)
    if layout != "b^T":
        a = xp.ascontiguousarray(a.transpose(0, 2, 1)).transpose(0, 2, 1)
    if layout != "a^T":
        b = xp.ascontiguousarray(b.T).T
    clean = abftgemm.matmul(a, b, bias=c, check="off")
    plan = ProtectedMatmul(a, b, bias=c)
    assert (_host(plan.execute(a, b, bias=c)) == _host(clean)).all()
    assert not plan.settle().detected
    assert plan.counters.rare_paths == 0  # the prediction agreed: nothing flagged
    got = plan.execute(a, b, bias=c, fault_hook=Fault("additive", "element", seed=3,
                                                       magnitude=1e3))
    report = plan.settle()
    assert report.detected and (_host(got) == _host(clean)).all()
    assert plan.counters.rare_paths == 1


@pytest.mark.parametrize("xp", BACKENDS)
def test_an_abandoned_flagged_execute_leaves_no_verdict_behind(xp):
    """A flagged execute that is abandoned (its caller failed before the settle) must not make
    the next, clean settle flag: the CPU overwrites its verdict per execute, the GPU kept a
    cumulative count that the abandoned execute had raised (and ran the rare path for nothing)."""
    a, b, _ = _operands(xp, np.float32)
    plan = ProtectedMatmul(a, b)
    plan.execute(a, b, fault_hook=Fault("additive", "element", seed=3, magnitude=1e3))
    plan.abandon()
    clean = plan.execute(a, b)
    report = plan.settle()
    assert not report.detected and plan.counters.rare_paths == 0
    assert (_host(clean) == _host(abftgemm.matmul(a, b, check="off"))).all()
    plan.execute(a, b, fault_hook=Fault("additive", "element", seed=4, magnitude=1e3))
    assert plan.settle().detected and plan.counters.rare_paths == 1  # and flags still count


@pytest.mark.parametrize("xp", BACKENDS)
def test_consecutive_flagged_executes_are_each_flagged(xp):
    """The GPU's verdict is a cumulative count compared with its previous read: two flagged
    executes in a row, with the same number of flagged columns, must both be flagged."""
    a, b, _ = _operands(xp, np.float32)
    clean = _host(abftgemm.matmul(a, b, check="off"))
    plan = ProtectedMatmul(a, b)
    for seed in (3, 4, 5):
        got = plan.execute(a, b, fault_hook=Fault("additive", "element", seed=seed,
                                                    magnitude=1e3))
        assert plan.settle().detected and (_host(got) == clean).all()
    assert plan.counters.rare_paths == 3


@pytest.mark.parametrize("xp", BACKENDS)
def test_detect_mode_reports_and_leaves_the_product(xp):
    a, b, _ = _operands(xp, np.float32)
    plan = ProtectedMatmul(a, b, check="detect")
    got = plan.execute(a, b, fault_hook=Fault("inf", "element", seed=1))
    with pytest.warns(abftgemm.FaultDetectedWarning):
        report = plan.settle()
    assert report.detected and np.isinf(_host(got)).sum() == 1


@pytest.mark.parametrize("xp", BACKENDS)
def test_constant_operand_encoded_once(xp):
    a, b, _ = _operands(xp, np.float32)
    w = a[0]  # the weight: a (m, k) matrix applied to many batches b
    x = xp.asarray(np.random.default_rng(1).integers(-2, 3, (5, 24, 20)).astype(np.float32))
    plan = ProtectedMatmul(w, x, constant_a=True)
    launches = plan.counters.launches
    got = plan.execute(w, x)
    assert not plan.settle().events
    assert plan.counters.launches - launches == LAUNCHES
    np.testing.assert_array_equal(_host(got), _host(w)[None] @ _host(x))
    w[0, 0] += 1  # the weight changed: stale encoding -> flagged, settled by recomputation
    plan.execute(w, x)
    report = plan.settle()
    assert {e.action for e in report.events} <= {"checksum-recomputed"}
    plan.reset_constant(w, x)
    plan.execute(w, x)
    assert not plan.settle().events
    plan.release()
    with pytest.raises(RuntimeError, match="released"):
        plan.reset_constant(w, x)


@pytest.mark.parametrize("xp", BACKENDS)
def test_checksums_hand_on_to_the_next_product(xp):
    a, b, _ = _operands(xp, np.float32)
    first = ProtectedMatmul(a, b)
    h = first.execute(a, b)
    _, sums = first.settle(checksums=True)
    w = xp.asarray(np.random.default_rng(2).integers(-2, 3, (20, 8)).astype(np.float32))
    second = ProtectedMatmul(h, w)
    y = second.execute(h, w, a_checksums=sums, fault_hook=Fault("nan", "element", seed=3))
    report = second.settle()
    assert report.corrected == 1
    np.testing.assert_array_equal(_host(y), _host(h) @ _host(w))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("a_shape,b_shape", [((0, 3, 4), (4, 5)), ((3, 4), (4, 0)),
                                             ((3, 0), (0, 5)), ((2, 3, 0), (0, 5)),
                                             ((0, 4), (4, 5)), ((0, 3, 4), (1, 4, 5))])
@pytest.mark.parametrize("directions", ["columns", "both"])
def test_empty_dimensions_execute_and_settle(xp, a_shape, b_shape, directions):
    """With directions="both" and in abftgemm.verify (the two-direction prediction): an empty
    batch had been taken as max(a's, b's) = 1, not 0, judging uninitialized checksums of a batch
    item that does not exist (IndexError on NumPy, ValueError from the CUDA reductions); and a
    bias over m = 0 rows had added (m+1)/2 * bias to the weighted column checksums (the sum of
    zero location weights is 0), a false 'rounding' event on an empty product."""
    a, b = xp.ones(a_shape, dtype=np.float32), xp.ones(b_shape, dtype=np.float32)
    bias = xp.full(b_shape[-1], 2.0, dtype=np.float32)
    for with_bias in (None, bias):
        plan = ProtectedMatmul(a, b, bias=with_bias, directions=directions)
        c = plan.execute(a, b, bias=with_bias)
        assert not plan.settle(checksums=True)[0].events
        want = _host(a) @ _host(b) + (0 if with_bias is None else 2)
        assert c.shape == want.shape
        np.testing.assert_array_equal(_host(c), want)
        assert abftgemm.verify(c, a, b, bias=with_bias).clean
    if 0 not in c.shape:  # an empty inner dimension: the product is the bias, still verified
        plan.execute(a, b, bias=bias, fault_hook=Fault("nan", "element", seed=0))
        assert plan.settle().corrected == 1


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_handed_on_encoding_of_the_wrong_shape_or_dtype_is_refused(xp):
    a, b, _ = _operands(xp, np.float32)
    plan = ProtectedMatmul(a, b)
    good = abftgemm.checksums_of(a, rows=False).cols  # (3 fields, 3 items, 24) float64
    out = xp.full((3, 32, 20), 7.0, dtype=np.float32)
    for bad in (good[..., :5], good[:2], good[:, :2], good.transpose(2, 1, 0),
                good.astype(np.float32), _host(good) if xp is not np else [[0.0]]):
        with pytest.raises(ValueError, match=r"a_checksums.cols must be a float64"):
            plan.execute(a, b, out=out, a_checksums=abftgemm.Checksums(cols=bad))
        assert (_host(out) == 7).all()  # nothing written
    plan.execute(a, b, out=out, a_checksums=abftgemm.Checksums(cols=good))
    assert not plan.settle().events
    np.testing.assert_array_equal(_host(out), _host(a) @ _host(b))
    # One encoding for every batch item is a valid shape (a broadcast a); here it describes
    # item 0 only, so the other items are flagged and recomputed, never accepted wrong.
    plan.execute(a, b, out=out, a_checksums=abftgemm.Checksums(cols=good[:, :1]))
    assert plan.settle().events
    np.testing.assert_array_equal(_host(out), _host(a) @ _host(b))


@pytest.mark.parametrize("xp", BACKENDS)
def test_misuse_raises_clearly(xp):
    a, b, _ = _operands(xp, np.float32)
    plan = ProtectedMatmul(a, b)
    with pytest.raises(RuntimeError, match="without an execute"):
        plan.settle()
    with pytest.raises(ValueError, match="do not match the plan"):
        plan.execute(a[:, :5], b)
    odd = xp.empty((3, 20, 32), dtype=np.float32).transpose(0, 2, 1)  # any valid out
    allocations = plan.counters.allocations
    assert plan.execute(a, b, out=odd, fault_hook=Fault("near-inf", "element", seed=1)) is odd
    assert plan.settle().corrected and plan.counters.allocations == allocations + 1
    np.testing.assert_array_equal(_host(odd), _host(a) @ _host(b))  # delivered once repaired
    with pytest.raises(ValueError, match="needs out, a C-contiguous"):
        plan.execute(a, b, out=odd, gemm=lambda: None)
    plan.execute(a, b)
    with pytest.raises(RuntimeError, match="settle"):
        plan.execute(a, b)
    plan.settle()
    plan.release()
    with pytest.raises(RuntimeError, match="released"):
        plan.execute(a, b)
    with pytest.raises(ValueError, match="check"):
        ProtectedMatmul(a, b, check="off")
    with pytest.raises(ValueError, match="directions"):
        ProtectedMatmul(a, b, directions="rows")
    with pytest.raises(ValueError, match="a_triangle"):
        ProtectedMatmul(a, b, a_triangle="diagonal")


@pytest.mark.parametrize("xp", BACKENDS)
def test_operand_copies_per_execute_are_counted(xp):
    """What an execute copies of its operands is in ``counters.allocations``: a batch broadcast
    in part (each operand into the product's batch layout), on the GPU a negative-stride
    operand (for the GEMM and for the prediction); contiguous operands none."""
    rng = np.random.default_rng(3)

    def allocations(a, b, out):
        plan = ProtectedMatmul(a, b)
        before = plan.counters.allocations
        plan.execute(a, b, out=out)
        plan.settle()
        np.testing.assert_allclose(_host(out), _host(a) @ _host(b), rtol=1e-5, atol=1e-5)
        return plan.counters.allocations - before

    a, b = (xp.asarray(rng.standard_normal(s).astype(np.float32))
            for s in ((2, 1, 16, 8), (1, 3, 8, 12)))
    assert allocations(a, b, xp.empty((2, 3, 16, 12), np.float32)) == 2
    a, b = (xp.asarray(rng.standard_normal(s).astype(np.float32)) for s in ((4, 16, 8), (8, 12)))
    assert allocations(a, b, xp.empty((4, 16, 12), np.float32)) == 0
    assert allocations(a, b[::-1], xp.empty((4, 16, 12), np.float32)) == (0 if xp is np else 2)


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_consumer_rows_plan_settled_before_judge_raises(xp):
    """``directions="rows by consumer"``: a settle before the consumer's ``judge()`` raises (it
    reported the product checked and clean, from the verdict slot as last judged: a fault passed
    unflagged); after ``judge()`` it settles, and ``abandon()`` forgets the execute."""
    a, b, _ = _operands(xp, np.float32)
    plan = ProtectedMatmul(a, b, directions="rows by consumer")
    out = xp.empty((3, 32, 20), np.float32)
    for attempt in range(2):
        plan.execute(a, b, out=out, fault_hook=Fault("near-inf", "element", seed=0))
        with pytest.raises(RuntimeError, match="before judge"):
            plan.settle()
        if attempt == 0:
            plan.abandon()
    _observe_rows(xp, plan, out)
    assert plan.settle().corrected
    np.testing.assert_array_equal(_host(out), _host(a) @ _host(b))


@pytest.mark.parametrize("xp", BACKENDS)
def test_matmul_reuses_a_plan_without_revalidating_known_layouts(xp, monkeypatch):
    """Repeated calls with arrays of a layout seen before skip ``Operands.prepare``; anything
    else (another dtype, a bad ``out``, a broadcast) is validated as on the first call."""
    from abftgemm.operands import Operands

    abftgemm.clear_plan_cache()
    a, b, bias = _operands(xp, np.float32, bias=True)
    first = abftgemm.matmul(a, b, bias=bias)
    prepared = []
    real = Operands.prepare.__func__
    monkeypatch.setattr(Operands, "prepare",
                        classmethod(lambda cls, *args: prepared.append(1) or real(cls, *args)))
    out = xp.empty_like(first)
    again = abftgemm.matmul(a, b, bias=bias, out=out)
    assert again is out and prepared == []
    assert (_host(again) == _host(first)).all()
    with pytest.raises(ValueError, match="shape"):
        abftgemm.matmul(a, b, bias=bias, out=xp.empty((3, 32, 21), dtype=np.float32))
    assert prepared == [1]
    wider = abftgemm.matmul(a.astype(np.float64), b.astype(np.float64), bias=bias)
    assert wider.dtype == np.float64 and len(prepared) > 1  # validated (and planned: again)
    assert (_host(wider) == _host(first)).all()
    seen = len(prepared)
    abftgemm.clear_plan_cache()
    abftgemm.matmul(a, b, bias=bias)  # the layouts went with the plans
    assert len(prepared) > seen


@pytest.mark.parametrize("xp", BACKENDS)
def test_the_layout_key_is_array_type_device_dtypes_and_shapes(xp):
    """``plan.layout_key``, by which the plan cache and the attention workspace find a plan: the
    values and the memory layout of the arrays do not count; their type, dtypes and shapes do."""
    from abftgemm.backend import to_host
    from abftgemm.plan import layout_key

    a, b, bias = _operands(xp, np.float32, bias=True)
    key = layout_key(a, b, bias)
    strided = a.transpose(0, 2, 1).copy().transpose(0, 2, 1)
    assert key == layout_key(a * 2, b.copy(), bias) == layout_key(strided, b, bias)
    for other in ((a, b, None), (a.astype(np.float64), b, bias), (a[:, 1:], b, bias)):
        assert layout_key(*other) not in (None, key)
    assert layout_key(to_host(a).tolist(), b, bias) is None
    if xp is not np:
        assert layout_key(a, to_host(b), bias) is None


@pytest.mark.parametrize("xp", BACKENDS)
def test_the_column_fast_paths_trade_is_what_the_docs_say(xp):
    """docs/detection.md: errors +e, -2e, +e in consecutive rows of one column leave both the
    plain and the (linearly) weighted column sums unchanged, so ``directions="columns"`` cannot
    see them unless they break the column's magnitude bound; ``directions="both"`` sees each one
    alone in its row and repairs it. (Should the fast path ever catch this, update the docs.)"""
    rng = np.random.default_rng(5)
    a = xp.asarray(rng.integers(-3, 4, (32, 24)).astype(np.float32))
    b = xp.asarray(rng.integers(-3, 4, (24, 16)).astype(np.float32))
    clean = _host(abftgemm.matmul(a, b, check="off"))

    def second_difference(site, c):  # exact in float32: integers below 2**24
        c[3, 5] += 64
        c[4, 5] -= 128
        c[5, 5] += 64

    got, report = abftgemm.matmul(a, b, fault_hook=second_difference, return_report=True)
    assert not report.detected
    assert _host(got)[4, 5] - clean[4, 5] == -128  # the documented hole
    got, report = abftgemm.matmul(a, b, fault_hook=second_difference, return_report=True,
                                  directions="both")
    assert report.detected
    np.testing.assert_array_equal(_host(got), clean)


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_encoding_is_the_column_encoding_the_prediction_used(xp):
    """What a plan hands on of its ``a``: plain, location-weighted ((i+1)/m) and absolute column
    sums, as it made them (the CPU; a GPU plan keeps only partial sums of its own: None) or as
    they were handed to it; a plan given them predicts the same clean verdict."""
    from abftgemm.backend import to_host
    from abftgemm.checksums import Checksums

    rng = np.random.default_rng(0)
    a = xp.asarray(rng.standard_normal((3, 6, 5)))
    b = xp.asarray(rng.standard_normal((3, 5, 4)))
    a_host = to_host(a)
    weights = ((np.arange(6) + 1) / 6)[None, :, None]
    expected = np.stack([a_host.sum(1), (weights * a_host).sum(1), np.abs(a_host).sum(1)])
    plan = ProtectedMatmul(a, b)
    plan.execute(a, b)
    made = plan.a_encoding()
    if xp is np:
        np.testing.assert_allclose(made.cols, expected, rtol=1e-13)
    else:
        assert made is None
    assert not plan.settle().events
    given = ProtectedMatmul(a, b)
    given.execute(a, b, a_checksums=Checksums(cols=xp.asarray(expected)))
    np.testing.assert_allclose(to_host(given.a_encoding().cols), expected, rtol=1e-13)
    assert not given.settle().events
    with pytest.raises(RuntimeError, match="no executed"):
        given.a_encoding()


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("b_layout", ["rows", "transposed"])
def test_a_handed_on_encoding_is_used_whatever_its_memory_layout(xp, b_layout):
    """An encoding handed on as a view inside a larger array (its field vectors contiguous: read
    in place, no copy), as a view whose field vectors are strided (copied once, counted), or as
    what the plan says it read (``a_encoding``), predicts a clean verdict; the same view with
    one field changed is flagged (so it is what the prediction reads), for ``b`` read as given
    or as the transpose of a C-contiguous array."""
    a, b, _ = _operands(xp, np.float32)
    if b_layout == "transposed":
        b = xp.ascontiguousarray(b.T).T
    cols = abftgemm.checksums_of(a, rows=False).cols
    inside = xp.zeros((5, 3, 30))
    inside[1:4, :, 2:26] = cols
    strided = xp.zeros((3, 3, 24, 2))
    strided[..., 0] = cols
    plan = ProtectedMatmul(a, b)
    out = xp.empty((3, 32, 20), dtype=np.float32)
    for view, copies in ((inside[1:4, :, 2:26], 0), (strided[..., 0], 1)):
        before = plan.counters.copies
        plan.execute(a, b, out=out, a_checksums=abftgemm.Checksums(cols=view))
        assert plan.counters.copies - before == copies
        read = plan.a_encoding()
        assert not plan.settle().events
        plan.execute(a, b, out=out, a_checksums=read)
        assert not plan.settle().events
        view[0, 1, 7] += 8.0
        plan.execute(a, b, out=out, a_checksums=abftgemm.Checksums(cols=view))
        assert plan.settle().events
        np.testing.assert_array_equal(_host(out), _host(a) @ _host(b))


def _triangular(xp, triangle, shape, seed=0):
    """Small-integer operands (exact products) with ``a`` zero outside ``triangle``."""
    batch, m, k, n = shape
    rng = np.random.default_rng(seed)
    a = rng.integers(-2, 3, (batch, m, k)).astype(np.float32)
    a = np.tril(a) if triangle == "lower" else np.triu(a)
    b = rng.integers(-2, 3, (batch, k, n)).astype(np.float32)
    return xp.asarray(a), xp.asarray(b)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("triangle", ["lower", "upper"])
@pytest.mark.parametrize("shape", [(3, 300, 300, 16), (2, 150, 90, 4), (2, 90, 150, 4),
                                   (1, 1, 3, 2)], ids=["square", "tall", "wide", "one-row"])
def test_a_triangular_product_equals_the_full_one_and_is_repaired(xp, triangle, shape):
    """A plan told that ``a`` is zero outside a triangle (causal attention's P, dS and their
    transposes) gives the full product, checked and repaired as one."""
    a, b = _triangular(xp, triangle, shape)
    bias = xp.asarray(np.arange(shape[3], dtype=np.float32))
    want = _host(abftgemm.matmul(a, b, bias=bias, check="off"))
    plan = ProtectedMatmul(a, b, bias=bias, a_triangle=triangle)
    np.testing.assert_array_equal(_host(plan.execute(a, b, bias=bias)), want)
    assert not plan.settle().events
    got = plan.execute(a, b, bias=bias, fault_hook=Fault("additive", "element", seed=1,
                                                         magnitude=1e3))
    report = plan.settle()
    assert [e.action for e in report.events] == ["corrected"]
    np.testing.assert_array_equal(_host(got), want)


@pytest.mark.parametrize("triangle", ["lower", "upper"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_the_cpu_gemm_never_reads_outside_the_promised_triangle(triangle, dtype):
    """The CPU backend multiplies only the row blocks a triangle can hold: NaN written where
    the promise says zero, a block or more away from the diagonal, never reaches the product
    (the blocks it skips are the saving)."""
    from abftgemm._cpu import backend
    from abftgemm._cpu_triangles import triangle_blocks

    m, k = 300, 260
    a, b = _triangular(np, triangle, (2, m, k, 8))
    size = max(hi - lo for lo, hi in triangle_blocks(m))  # the backend's rows per block
    i, j = np.indices((m, k))
    skipped = (j - i >= size) if triangle == "lower" else (i - j >= size)
    assert skipped.sum() > 1000
    poisoned = np.where(skipped, np.float32(np.nan), a)
    got = np.empty((2, m, 8), dtype)
    backend().gemm(poisoned.astype(dtype), b.astype(dtype), got, None, triangle=triangle)
    np.testing.assert_array_equal(got.astype(np.float64), (a @ b).astype(np.float64))
    backend().gemm(poisoned.astype(dtype), b.astype(dtype), got, None)
    assert np.isnan(got).any()  # the full product reads them


def _observe_rows(xp, plan, c):
    """What a consumer of a deferred product does: the row checksums of each row up to its
    limit (whole rows without limits), as ``row_reduce`` with default weights gives them."""
    c = _host(c)
    n = c.shape[-1]
    limits = plan.row_limits if plan.row_limits is not None else np.full(c.shape[1], n)
    weights = np.arange(1, n + 1) / n
    obs = np.zeros(c.shape[:2] + (5,))
    obs[..., 4] = -1.0
    for i, limit in enumerate(limits):
        row = c[:, i, :limit]
        obs[:, i, 0], obs[:, i, 1] = row.sum(-1), (row * weights[:limit]).sum(-1)
        obs[:, i, 2] = np.abs(row).sum(-1)
    plan.observed[...] = xp.asarray(obs)
    plan.judge()


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("b_layout", ["C", "transposed"])
def test_a_lower_triangle_product_is_computed_and_verified_up_to_its_row_limits(xp, b_layout):
    """Only entries j <= i of a causal product are read: on the CPU its row blocks are computed
    and verified up to their last column (row_limits), on the GPU whole. The lower triangle is
    exact, a fault inside the rows' limits is repaired, one beyond them changes nothing read."""
    rng = np.random.default_rng(21)
    a = rng.integers(-3, 4, (2, 200, 16)).astype(np.float32)
    b = rng.integers(-3, 4, (2, 16, 200)).astype(np.float32)
    want = np.tril(a @ b)
    lower = np.tril(np.ones((200, 200), bool))
    a = xp.asarray(a)
    # "transposed": b is the transpose of a C-contiguous array, as the scores' K^T is
    b = xp.asarray(b) if b_layout == "C" else xp.asarray(b.transpose(0, 2, 1).copy()).transpose(
        0, 2, 1)
    out = xp.zeros((2, 200, 200), np.float32)
    plan = ProtectedMatmul(a, b, directions="rows by consumer", out_triangle="lower")
    limits = plan.row_limits
    if xp is np:  # the CPU skips blocks: at least j <= i, not every row whole
        assert (limits > np.arange(200)).all() and (limits < 200).any()
    else:
        assert limits is None
    faults = [(None, True), (Fault("additive", "element", seed=1, row=100, col=50,
                                   magnitude=1e3), True)]
    if limits is not None:  # memory the product never writes and no one reads
        faults.append((Fault("additive", "element", seed=1, row=3, col=150, magnitude=1e3),
                       False))
    for fault, read in faults:
        rare_paths = plan.counters.rare_paths
        plan.execute(a, b, out=out, fault_hook=fault)
        _observe_rows(xp, plan, out)
        report = plan.settle()
        # the prediction matches the prefixes: only a read fault reaches the rare path
        assert plan.counters.rare_paths - rare_paths == (fault is not None and read)
        found = [(e.pattern, e.rows, e.cols) for e in report.events]
        assert found == ([("0D", (100,), (50,))] if fault is not None and read else []), found
        np.testing.assert_array_equal(np.where(lower, _host(out), 0), want)
    for options in ({"out_triangle": "upper", "directions": "rows by consumer"},
                    {"out_triangle": "lower"}):
        with pytest.raises(ValueError, match="out_triangle"):
            ProtectedMatmul(a, b, **options)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_caller_gemm_is_verified_like_the_plans_own(xp, dtype):
    """``execute(gemm=...)``: the caller's GEMM writes the product (here with one element
    wrong, as a faulty framework GEMM would); the plan verifies and repairs it, and needs out.
    16-bit too (whose CPU plans predicted from float32 copies of the operands that only their
    own GEMM made: a caller's GEMM was judged against the planning's zeros or the previous
    product's operands)."""
    a, b, bias = _operands(xp, dtype, bias=True)
    out = xp.empty((3, 32, 20), dtype=dtype)

    def wrong_gemm():
        xp.matmul(a, b, out=out)
        xp.add(out, bias, out=out)
        out[1, 2, 3] += 100.0

    plan = ProtectedMatmul(a, b, bias=bias)
    launches = plan.counters.launches
    plan.execute(a, b, bias=bias, out=out, gemm=wrong_gemm)
    report = plan.settle()
    assert [(e.rows, e.cols, e.action) for e in report.events] == [((2,), (3,), "corrected")]
    np.testing.assert_array_equal(_host(out), _host(a) @ _host(b) + _host(bias))
    assert plan.counters.launches == launches + LAUNCHES + 1  # the caller's GEMM counts as one
    with pytest.raises(ValueError, match="needs out"):
        plan.execute(a, b, bias=bias, gemm=wrong_gemm)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_caller_gemm_is_judged_against_its_own_operands(xp, dtype):
    """16-bit CPU plans predicted from float32 copies of the operands that only their own GEMM
    made: a caller's GEMM was judged against the planning's zeros (a product lost to zeros
    passed clean) or the previous product's operands (every clean execute took the rare
    path). A lost product is found, and clean caller GEMMs take no rare path."""
    rng = np.random.default_rng(0)
    a, b = (xp.asarray(rng.standard_normal(s).astype(dtype)) for s in ((16, 32), (32, 24)))
    out = xp.empty((16, 24), dtype)
    plan = ProtectedMatmul(a, b)
    plan.execute(a, b, out=out, gemm=lambda: out.fill(0))
    assert plan.settle().detected
    a64, b64 = _host(a), _host(b)
    bound = 2 * 32 * unit_roundoff(dtype) * (np.abs(a64) @ np.abs(b64))
    assert np.all(np.abs(_host(out) - a64 @ b64) <= bound)
    rare = plan.counters.rare_paths
    for _ in range(3):
        plan.execute(a, b, out=out, gemm=lambda: xp.matmul(a, b, out=out))
        assert not plan.settle().events
    assert plan.counters.rare_paths == rare


@pytest.mark.parametrize("xp", BACKENDS)
def test_settle_all_settles_every_plan_and_waits_on_every_backend(xp, monkeypatch):
    """``settle_all``: a plan listed twice is refused before anything is settled; a plan whose
    repair raises does not leave the others pending (they settle, then its error is raised, its
    report holding the others' findings too: they were dropped); plans of NumPy and of ``xp``
    are each waited for on their own backend (it waited on the first plan's alone: a GPU
    verdict copy could be read before it arrived)."""
    from abftgemm import UncorrectableError, plan as plan_module
    from abftgemm.plan import settle_all

    a, b, _ = _operands(np, np.float32)
    plans = [ProtectedMatmul(a, b, name=name) for name in ("first", "second")]
    for p in plans:
        p.execute(a, b)
    with pytest.raises(ValueError, match="listed twice"):
        settle_all([plans[0], plans[0]])
    with pytest.raises(TypeError, match="takes ProtectedMatmul plans, got int"):
        settle_all([plans[0], 1])  # an AttributeError before, after settling had begun
    repair = plan_module.protect

    def failing(be, op, c, check, name, report, *rest):
        if name == "first":
            raise UncorrectableError("test: this one cannot be repaired", report)
        return repair(be, op, c, check, name, report, *rest)

    monkeypatch.setattr(plan_module, "protect", failing)
    outs = [np.empty((3, 32, 20), np.float32) for _ in plans]
    hook = Fault("near-inf", "element", seed=0, times=None)
    for p, out in zip(plans, outs):
        p.abandon()
        p.execute(a, b, out=out, fault_hook=hook)
    with pytest.raises(UncorrectableError, match="this one") as raised:
        settle_all(plans)
    np.testing.assert_array_equal(outs[1], a @ b)  # repaired, delivered
    assert [e.site for e in raised.value.report.events if e.action == "corrected"] == ["second"]
    for p in plans:
        p.execute(a, b)  # neither is pending
        p.settle()
    monkeypatch.setattr(plan_module, "protect", repair)
    if xp is np:
        return
    mixed = [ProtectedMatmul(a, b), ProtectedMatmul(*_operands(xp, np.float32)[:2])]
    waited = []
    for p in mixed:
        monkeypatch.setattr(p._be, "synchronize", lambda be=p._be: waited.append(be.xp))
        p.execute(*(_operands(p._be.xp, np.float32)[:2]))
    settle_all(mixed)
    assert sorted(m.__name__ for m in waited) == sorted(["numpy", xp.__name__])


@pytest.mark.parametrize("xp", BACKENDS)
def test_plans_sharing_a_verdict_ledger_are_read_in_one_host_read(xp):
    """Column plans and a consumer-rows plan that share a verdict ledger are settled with one
    device-to-host transfer on the GPU (none on the CPU, whose verdicts are host memory), and
    each still reads its own verdict from it: a fault in one product repairs that one only (its
    rare path reads the device more, and those reads are counted too). Each with a ledger of
    its own, the GPU reads once per plan."""
    from abftgemm.plan import CONSUMER_ROWS, Counters, settle_all
    from abftgemm.verdicts import Ledger

    a, b, _ = _operands(xp, np.float32)
    gpu = xp is not np
    for shared, reads in ((True, int(gpu)), (False, 3 * gpu)):
        counters = Counters()
        ledger = Ledger(xp, counters) if shared else None
        plans = [ProtectedMatmul(a, b, counters=counters, verdicts=ledger) for _ in range(2)]
        rows = ProtectedMatmul(a, b, directions=CONSUMER_ROWS, counters=counters, verdicts=ledger)
        out = [xp.empty((3, 32, 20), np.float32) for _ in range(3)]
        for faulty in (False, True):  # the second settle reads the cumulative counts
            plans[0].execute(a, b, out=out[0])
            plans[1].execute(a, b, out=out[1], fault_hook=lambda site, c: c.__setitem__(
                (1, 4, 7), c[1, 4, 7] + 64) if faulty else None)
            rows.execute(a, b, out=out[2])
            abftgemm.backend.get_backend(xp).row_reduce(out[2], None, rows.observed)
            rows.judge()
            before = counters.host_reads
            reports = settle_all(plans + [rows])
            repair_reads = counters.host_reads - before - reads
            assert repair_reads > 0 if faulty and gpu else repair_reads == 0
            assert [r.corrected for r in reports] == [0, int(faulty), 0]
            for o in out:
                np.testing.assert_array_equal(_host(o), _host(a) @ _host(b))
