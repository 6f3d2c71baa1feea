"""abftgemm.testing.assert_protected states the library's guarantee under injected faults."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given

import abftgemm
from abftgemm import testing as at
from abftgemm.backend import to_host
from abftgemm.faults import Fault
from conftest import BACKENDS


def exact_operands(xp, shape_a=(12, 12), shape_b=(12, 12)):
    rng = np.random.default_rng(0)  # integers up to 16, k = 12: every product exact in float32
    a = rng.integers(-16, 17, shape_a).astype(np.float32)
    b = rng.integers(-16, 17, shape_b).astype(np.float32)
    return xp.asarray(a), xp.asarray(b)


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_fault_below_the_rounding_noise_passes_assert_protected_only(xp):
    """The issue's case: a low-mantissa flip on an exact integer product, below its vector's
    threshold, stays in the output by design; assert_matches_reference rejects it."""
    a, b = exact_operands(xp)
    fault = Fault("bitflip", "element", seed=3, bit=7)  # 2**-16 relative to the element
    c, report = abftgemm.matmul(a, b, fault_hook=fault, return_report=True)
    assert not report.detected, report.summary()
    assert (to_host(c) != to_host(abftgemm.matmul(a, b, check="off"))).sum() == 1
    with pytest.raises(AssertionError):
        at.assert_matches_reference(c, a, b)
    at.assert_protected(c, a, b, report)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("check", ["correct", "detect"])
@given(ab=at.operand_pairs(np.float32), fault=at.faults())
def test_the_natural_property_test_passes(xp, check, ab, fault):
    a, b = (xp.asarray(x) for x in ab)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always", abftgemm.FaultDetectedWarning)
        c, report = abftgemm.matmul(a, b, check=check, fault_hook=fault, return_report=True)
    at.assert_protected(c, a, b, report)
    found = [r for r in records if issubclass(r.category, abftgemm.FaultDetectedWarning)]
    assert len(found) == sum(e.action == "reported" for e in report.events)


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_repair_that_leaves_a_large_error_fails(xp):
    a, b = exact_operands(xp, (2, 12, 12))
    c, report = abftgemm.matmul(a, b, fault_hook=Fault("inf", "element", seed=1),
                                return_report=True)
    at.assert_protected(c, a, b, report)  # the real repair keeps the promise
    bad = c.copy()
    bad[1, 4, 6] += 100  # a repair that missed by 100: far above any rounding
    with pytest.raises(AssertionError, match=r"batch items \[1\]"):
        at.assert_protected(bad, a, b, report)
    bad = c.copy()
    bad[0, 0, 0] = np.nan  # a non-finite element left behind
    with pytest.raises(AssertionError, match=r"batch items \[0\]"):
        at.assert_protected(bad, a, b, report)


@pytest.mark.parametrize("xp", BACKENDS)
def test_detect_mode_passes_only_when_the_finding_is_reported(xp):
    a, b = exact_operands(xp, (3, 12, 12))
    with pytest.warns(abftgemm.FaultDetectedWarning):
        c, report = abftgemm.matmul(a, b, check="detect", return_report=True,
                                    fault_hook=Fault("bitflip", "element", seed=2, batch=1, bit=29))
    at.assert_protected(c, a, b, report)
    with pytest.raises(AssertionError, match="does not mark as detected"):
        at.assert_protected(c, a, b, abftgemm.Report())
    elsewhere = abftgemm.Report([abftgemm.Event("matmul", 0, "0D", (0,), (0,), 1.0, 0.5,
                                                "reported", "nothing")])
    with pytest.raises(AssertionError):  # reported, but for another batch item
        at.assert_protected(c, a, b, elsewhere)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("shapes", [((12,), (12,)), ((12,), (2, 12, 5)),
                                    ((2, 1, 4, 12), (3, 12, 5)), ((0, 4, 12), (12, 3))])
def test_vectors_broadcasting_and_empty_batches(xp, shapes):
    a, b = exact_operands(xp, *shapes)
    c, report = abftgemm.matmul(a, b, fault_hook=Fault("nan", "element", seed=0),
                                return_report=True)
    at.assert_protected(c, a, b, report)
    if np.size(to_host(c)):
        wrong = xp.asarray(np.asarray(to_host(c)) + 64)
        with pytest.raises(AssertionError):
            at.assert_protected(wrong, a, b, report)


@pytest.mark.parametrize("xp", BACKENDS)
def test_c_clean_for_a_product_with_bias(xp):
    a, b = exact_operands(xp)
    bias = xp.asarray(np.arange(12, dtype=np.float32))
    c, report = abftgemm.matmul(a, b, bias=bias, fault_hook=Fault("inf", "row", seed=0),
                                return_report=True)
    at.assert_protected(c, a, b, report, c_clean=abftgemm.matmul(a, b, bias=bias, check="off"))
    with pytest.raises(AssertionError):  # without it, the bias reads as an error
        at.assert_protected(c, a, b, report)
