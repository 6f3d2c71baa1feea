"""Detect-mode findings reach the user as FaultDetectedWarning; clean calls never warn."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import abftgemm
from abftgemm.backend import get_backend
from abftgemm.faults import Fault
from conftest import BACKENDS
from fresh_python import run_python


def operands(xp, batch=(2,)):
    rng = np.random.default_rng(0)
    a = rng.integers(-3, 4, batch + (16, 8)).astype(np.float32)
    b = rng.integers(-3, 4, (8, 12)).astype(np.float32)
    return xp.asarray(a), xp.asarray(b)


def caught(fn):
    """The FaultDetectedWarnings ``fn()`` emits (every one, however often it repeats)."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        fn()
    return [r for r in records if issubclass(r.category, abftgemm.FaultDetectedWarning)]


def test_the_warning_is_a_user_warning_exported_at_top_level():
    assert issubclass(abftgemm.FaultDetectedWarning, UserWarning)
    assert "FaultDetectedWarning" in abftgemm.__all__


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("return_report", [False, True])
def test_detect_mode_warns_once_per_finding_at_the_callers_line(xp, return_report):
    a, b = operands(xp)
    fault = Fault("nan", "element", seed=4, batch=1, row=5, col=7)
    records = caught(lambda: abftgemm.matmul(a, b, check="detect", fault_hook=fault,
                                             name="proj", return_report=return_report))
    assert len(records) == 1
    message = str(records[0].message)
    assert "proj[1]" in message and "0D" in message and "rows [5] cols [7]" in message
    assert records[0].filename == __file__  # attributed to the caller, not to the library


@pytest.mark.parametrize("xp", BACKENDS)
def test_one_warning_per_faulty_batch_item(xp):
    a, b = operands(xp, batch=(3,))

    def hook(site, c):
        c[0, 2, 3] = 1e6
        c[2, 4, 1] = 1e6
    records = caught(lambda: abftgemm.matmul(a, b, check="detect", fault_hook=hook))
    assert sorted(str(r.message).split("matmul[")[1][0] for r in records) == ["0", "2"]


@pytest.mark.parametrize("xp", BACKENDS)
def test_the_warning_can_be_turned_into_an_error(xp):
    a, b = operands(xp)
    with warnings.catch_warnings():
        warnings.simplefilter("error", abftgemm.FaultDetectedWarning)
        with pytest.raises(abftgemm.FaultDetectedWarning, match="1R"):
            abftgemm.matmul(a, b, check="detect", fault_hook=Fault("inf", "row", seed=1))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("case", ["clean", "corrected", "nonfinite-input", "overflow", "off"])
def test_no_warning_without_a_fault_left_in_place(xp, case):
    a, b = operands(xp)
    check, hook = "detect", None
    if case == "corrected":
        check, hook = "correct", Fault("nan", "element", seed=2)
    elif case == "off":
        check, hook = "off", Fault("nan", "element", seed=2)
    elif case == "nonfinite-input":
        a = a.copy()
        a[1, 3, 2] = np.inf
    elif case == "overflow":
        a, b = xp.full((3, 9), 100, np.float16), xp.full((9, 2), 73, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", abftgemm.FaultDetectedWarning)
        abftgemm.matmul(a, b, check=check, fault_hook=hook)


@pytest.mark.parametrize("bias", [False, True])
def test_a_16_bit_overflow_raises_no_numpy_warning(bias):
    # the float32 accumulator rounded to float16 printed "overflow encountered in cast"
    a, b = np.full((3, 9), 100, np.float16), np.full((9, 2), 73, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c, report = abftgemm.matmul(a, b, bias=np.ones(2, np.float16) if bias else None,
                                    return_report=True)
    assert np.isinf(c).all() and {e.pattern for e in report.events} == {"overflow"}


@pytest.mark.parametrize("xp", BACKENDS)
def test_deferred_verification_warns_in_detect_mode(xp):
    a, b = operands(xp)
    plan = abftgemm.ProtectedMatmul(a, b, check="detect", directions="rows by consumer")
    c = plan.execute(a, b, fault_hook=Fault("near-inf", "element", seed=3))
    get_backend(xp).row_reduce(c, None, plan.observed)
    plan.judge()
    records = caught(plan.settle)
    assert len(records) == 1 and records[0].filename == __file__


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("site", ["q_proj", "scores", "softmax", "d_x", "softmax_backward"])
def test_attention_in_detect_mode_warns_at_the_users_call(xp, site):
    from attention import MultiHeadAttention

    mha = MultiHeadAttention(16, 4, check="detect", xp=xp)
    x = xp.asarray(np.random.default_rng(1).standard_normal((2, 6, 16)).astype(np.float32))
    fault = Fault("additive", "element", seed=5, magnitude=1e3, sites={site})
    cache = {}
    records = caught(lambda: cache.update(mha.forward(x, fault_hook=fault)[1]))
    records += caught(lambda: mha.backward(x, cache, fault_hook=fault))
    reported = sum(e.action == "reported" for e in mha.last_report.events)  # both passes
    assert len(records) == reported >= 1
    assert all(f"{site}[" in str(r.message) for r in records)
    assert all(r.filename == __file__ for r in records)


# ------------------------------------------------------------------ repairs raise no NumPy warnings

REPAIR_SITES = ["q_proj", "k_proj", "scores", "softmax", "context", "out_proj", "d_probs", "d_x"]


@pytest.mark.parametrize("site", REPAIR_SITES)
@pytest.mark.parametrize("kind", ["inf", "nan", "bitflip"])
def test_a_repaired_attention_pass_warns_nothing_even_with_warnings_as_errors(site, kind):
    # INF/NaN from a fault ran through later products and the float64 model of the rare path,
    # each printing a NumPy RuntimeWarning (and raising under -W error instead of repairing)
    from attention import MultiHeadAttention
    layer = MultiHeadAttention(32, 4, causal=True, dtype="float32", xp=np, seed=0)
    x = np.random.default_rng(1).standard_normal((2, 8, 32)).astype(np.float32)
    clean, cache = layer.forward(x)
    clean_dx, _ = layer.backward(np.ones_like(clean), cache)
    for pattern in ("element", "row", "column"):
        fault = Fault(kind, pattern, seed=3, **({"bit": 30} if kind == "bitflip" else {}))
        hook = lambda s, c: fault(s, c) if s == site else None  # noqa: E731
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y, cache = layer.forward(x, fault_hook=hook)
            dx, _ = layer.backward(np.ones_like(y), cache, fault_hook=hook)
        assert np.isfinite(y).all() and np.isfinite(dx).all()
        assert np.allclose(y, clean, atol=1e-4) and np.allclose(dx, clean_dx, atol=1e-4)


@pytest.mark.parametrize("kind", ["inf", "nan", "bitflip"])
def test_a_repaired_matmul_warns_nothing_with_warnings_as_errors(kind):
    a, b = operands(np)
    a, b = a * 1e30, b * 1e7  # near overflow: the rare path's float64 model sees huge values
    for pattern in ("element", "row", "column", "tile"):
        fault = Fault(kind, pattern, seed=1, **({"bit": 30} if kind == "bitflip" else {}))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c, report = abftgemm.matmul(a, b, fault_hook=fault, return_report=True)
        assert report.detected


def test_the_protected_torch_forward_runs_under_dash_w_error(tmp_path):
    pytest.importorskip("torch")
    code = ("import torch\n"
            "from attention.torch import MultiheadAttention\n"
            "from abftgemm.faults import Fault\n"
            "m = MultiheadAttention(32, 4, batch_first=True)\n"
            "x = torch.randn(2, 8, 32, requires_grad=True)\n"
            "for site in ('q_proj', 'context'):\n"
            "    f = Fault('inf', 'row', seed=2)\n"
            "    m.fault_hook = lambda s, c: f(s, c) if s == site else None\n"
            "    y, _ = m(x, x, x)\n"
            "    y.sum().backward()\n"
            "    assert m.last_report.corrected and torch.isfinite(y).all(), site\n")
    run_python("-W", "error", "-c", code, cwd=tmp_path)
