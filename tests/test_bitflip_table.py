"""Sanity of scripts/bitflip_table.py on a tiny problem (runs in a few seconds)."""
from __future__ import annotations

import importlib.util
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from abftgemm.checksums import SUPPORTED_DTYPES

_SPEC = importlib.util.spec_from_file_location(
    "bitflip_table", Path(__file__).resolve().parents[1] / "scripts" / "bitflip_table.py")
bt = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("bitflip_table", bt)  # dataclasses look their module up
_SPEC.loader.exec_module(bt)

SIZE = (24, 32, 16)
TRIALS = 3


@pytest.fixture(scope="module", params=[d.name for d in SUPPORTED_DTYPES])
def table(request):
    dtype = np.dtype(next(d for d in SUPPORTED_DTYPES if d.name == request.param))
    return dtype, bt.measure_dtype(np, dtype, SIZE, 1.0, TRIALS, seed=3)


def test_every_bit_measured(table):
    dtype, rows = table
    assert [r.bit for r in rows] == list(range(8 * dtype.itemsize - 1, -1, -1))
    assert rows[0].name == "sign"
    assert all(r.trials == TRIALS for r in rows)


def test_huge_exponent_flips_detected_and_corrected(table):
    """Every flip that gives INF/NaN or a change > 1000x the element is detected and repaired."""
    dtype, rows = table
    checked = 0
    for r in rows:
        if r.name.startswith("exponent"):
            for old, new, det, cor in zip(r.olds, r.news, r.ours_detect, r.ours_correct):
                if not math.isfinite(new) or abs(new - old) > 1000 * abs(old):
                    checked += 1
                    assert det and cor, (r.name, old, new)
    # the top exponent bit of an O(1) value always gives INF/NaN or a huge value
    assert checked >= TRIALS


#: Unit roundoff (output dtype, accumulation dtype) per format, written out independently.
ROUNDOFF = {"float16": (2.0 ** -11, 2.0 ** -24), "bfloat16": (2.0 ** -8, 2.0 ** -24),
            "float32": (2.0 ** -24, 2.0 ** -24), "float64": (2.0 ** -53, 2.0 ** -53)}


def worst_case_rounding(a64, b64, dtype):
    """Per element, the textbook worst-case error of a product accumulated in u_acc and rounded to
    u_out (constant 1): ``k u_acc sum_c |a_ic b_cj| + u_out |c_ij|``, plus the same again for a
    repair (an element rebuilt from a float64 checksum of ~m such elements rounds once more)."""
    u_out, u_acc = ROUNDOFF[np.dtype(dtype).name]
    k, m = a64.shape[1], a64.shape[0]
    p = np.abs(a64) @ np.abs(b64)
    return 2 * (k * u_acc * p + u_out * np.abs(a64 @ b64)) + m * 2.0 ** -53 * p.sum(0)


def test_sign_flip_of_large_value_always_detected():
    """A sign flip of an element set well above the threshold is caught in every dtype."""
    for dtype in SUPPORTED_DTYPES:
        prob = bt.make_problem(np, dtype, SIZE, 1.0, seed=5)
        prob.a[3, :] = prob.a[3, :] * 0 + np.asarray(0.5, dtype)  # row 3 of C becomes large
        prob.clean = bt.abftgemm.matmul(prob.a, prob.b, check="off")
        a64, b64 = prob.a.astype(np.float64), prob.b.astype(np.float64)
        prob.exact = a64 @ b64
        prob.tol = bt.element_tolerance(np.abs(a64) @ np.abs(b64), SIZE[1], dtype)
        bound = worst_case_rounding(a64, b64, dtype)
        j = int(np.argmax(np.abs(prob.exact[3])))
        assert abs(prob.exact[3, j]) > 20 * bound[3, j]
        stats = bt.BitStats(dtype.name, 8 * dtype.itemsize - 1, "sign")
        fault = bt.Fault("bitflip", "element", seed=0, row=3, col=j, bit=8 * dtype.itemsize - 1)
        _, report = bt.abftgemm.matmul(prob.a, prob.b, check="detect", fault_hook=fault,
                                       return_report=True)
        assert abs(fault.injected[0].old[0]) > 1.0
        assert report.detected, dtype
        # and through the table code: detected and repaired within rounding
        bt.flip_trial(prob, 8 * dtype.itemsize - 1, seed=0, stats=stats)  # random element
        with_fault = bt.Fault("bitflip", "element", seed=0, row=3, col=j, bit=stats.bit)
        fixed = bt.abftgemm.matmul(prob.a, prob.b, check="correct", fault_hook=with_fault)
        error = np.abs(fixed.astype(np.float64) - prob.exact)
        assert (error <= bound).all(), (dtype, error.max())


#: Mantissa bits per format (IEEE 754 binary16/32/64; bfloat16), written out independently.
MANTISSA = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}
SMALLEST_NORMAL = {"float16": 2.0 ** -14, "bfloat16": 2.0 ** -126, "float32": 2.0 ** -126,
                   "float64": 2.0 ** -1022}


def test_changes_and_attn_verdicts_follow_from_the_bit_positions(table):
    """Flipping mantissa bit b of a normal value 2^E * 1.f changes it by exactly 2^(E - mant + b);
    flipping the sign changes it by 2|old|. ATTNChecker's |d| > 1 must see exactly the changes
    above 1, and a flip of the top exponent bit of an O(1) value (huge, INF or NaN) always."""
    dtype, rows = table
    mant = MANTISSA[dtype.name]
    for r in rows:
        for old, change, attn, rel in zip(r.olds, r.changes, r.attn_detect, r.relevant):
            if r.bit < mant and abs(old) >= SMALLEST_NORMAL[dtype.name]:
                expected = 2.0 ** (np.frexp(old)[1] - 1 - mant + r.bit)
            elif r.bit == 8 * dtype.itemsize - 1:
                expected = 2 * abs(old)
            else:
                continue
            assert change == expected, (r.name, old, change, expected)
            assert attn == (expected > 1), (r.name, old, change)
    top = next(r for r in rows if r.bit == 8 * dtype.itemsize - 2)
    assert all(top.attn_detect) and all(top.relevant) and top.rate("attn_detect") == 100
    assert bt.attn_detects(0.5, 1.6) and not bt.attn_detects(0.5, 1.4)
    assert bt.attn_detects(0.5, math.inf) and bt.attn_detects(0.5, math.nan)


def test_markdown_output(tmp_path):
    out = tmp_path / "d.md"
    out.write_text("# Title\n\nintro\n\n" + bt.BEGIN + "\nold\n" + bt.END + "\n\nanalysis\n")
    args = bt.parse_args(["--trials", "1", "--size", "8", "8", "8", "--large-scale", "100",
                          "--large-trials", "1", "--clean-matrices", "1", "--out", str(out)])
    text = bt.build_report(args, log=lambda *a, **k: None)
    bt.write_out(out, text)
    written = out.read_text()
    assert written.startswith("# Title\n\nintro\n\n") and written.endswith("\n\nanalysis\n")
    assert "old\n" not in written
    assert "--trials 1" in written and "| bit | name |" in written
    for d in SUPPORTED_DTYPES:
        assert f"### {d.name}" in written
    assert "Large magnitude" in written


def test_measuring_emits_no_warning():
    # notebooks/04_thresholds calls measure_dtype directly: it printed 591 FaultDetectedWarnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = bt.measure_dtype(np, np.dtype(np.float32), SIZE, 1.0, 2, seed=5)
    assert sum(sum(r.ours_detect) for r in rows) > 0  # flagged trials were there to announce


def test_fused_core_flips():
    """--core fused: every bit of float32 at two sites (a tile and an accumulator), one flip
    each: the flips that make INF/NaN or change by more than 1000x are all flagged and repaired,
    and no flip is silent (not flagged, beyond the campaign's bound)."""
    rows = bt.measure_fused(np, np.dtype(np.float32), (1, 70, 8), 1, seed=2,
                            sites=("fused:S", "fused:dV_acc"))
    assert [r.bit for r in rows] == list(range(31, -1, -1))
    for r in rows:
        assert set(r.counts) == {"fused:S", "fused:dV_acc"}
        assert r.total("trials") == 2 and r.total("silent") == r.total("miscorrected") == 0
        assert r.total("detected") + r.total("harmless") == 2
        assert r.total("corrected") == r.total("detected")
    top = rows[1]  # exponent 7: INF, NaN or a huge value from any value below 2
    assert top.name == "exponent 7" and top.total("detected") == 2
    assert sum(r.total("detected") for r in rows) > sum(r.total("harmless") for r in rows[:9])
    table = bt.fused_bit_table(rows)
    assert table.count("\n") == 33 and "| 30 | exponent 7 |" in table
    assert "| `S` | `dV_acc` |" in bt.fused_site_table(rows)


def test_fused_block_sits_beside_the_gemm_block(tmp_path):
    out = tmp_path / "d.md"
    out.write_text("# Title\n\n" + bt.BEGIN + "\ngemm\n" + bt.END + "\n\nanalysis\n")
    bt.write_out(out, "fused one", bt.FUSED_BEGIN, bt.FUSED_END)
    bt.write_out(out, "fused two", bt.FUSED_BEGIN, bt.FUSED_END)
    text = out.read_text()
    assert "gemm" in text and "analysis" in text and "fused two" in text
    assert "fused one" not in text and text.count(bt.FUSED_BEGIN) == 1
