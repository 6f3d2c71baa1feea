"""Properties of the protected attention layer, one body per property, on every backend present."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import abftgemm
from abftgemm.backend import to_host
from abftgemm.faults import Fault, Recorder, bit_layout
from attention import (INVARIANT_SITES, SITES, CheckingPlan, MultiHeadAttention,
                       adaptive_frequencies)
from attention import reference as ref
from conftest import BACKENDS

DTYPES = ["float64", "float32", "float16", "bfloat16"]
#: Agreement with the float64 reference, relative to the largest magnitude of the compared tensor.
REL_TOL = {"float64": 1e-10, "float32": 2e-4, "float16": 3e-2, "bfloat16": 2e-1}
FAULT_KINDS = ("inf", "-inf", "nan", "near-inf", "top-exponent", "bitflip", "additive")
PATTERNS = ("element", "row", "column", "tile", "warp")


def close(got, want, rel):
    got, want = to_host(got).astype(np.float64), to_host(want).astype(np.float64)
    scale = max(float(np.abs(want).max()), 1.0) if want.size else 1.0  # O(1) data; grad of bk is 0
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * scale)


def run(layer, x, mask, dy, hook=None):
    y, cache = layer.forward(x, mask, fault_hook=hook)
    forward_report = layer.last_report
    dx, grads = layer.backward(dy, cache, fault_hook=hook)
    report = abftgemm.Report()
    report.extend(forward_report)
    report.extend(layer.last_report)
    return y, dx, grads, report


def problem(xp, dtype, batch=2, seq=6, d_model=8, heads=2, causal=False, masked=False, seed=0):
    layer = MultiHeadAttention(d_model, heads, causal=causal, dtype=dtype, xp=xp, seed=seed)
    rng = np.random.default_rng(seed + 1)
    x = xp.asarray(rng.standard_normal((batch, seq, d_model)).astype(layer.dtype))
    dy = xp.asarray(rng.standard_normal((batch, seq, d_model)).astype(layer.dtype))
    mask = None
    if masked:
        m = rng.random((batch, seq)) < 0.7
        m[0, :] = False  # a fully masked batch row
        mask = xp.asarray(m)
    return layer, x, mask, dy


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(batch=st.integers(1, 2), seq=st.integers(1, 7), heads=st.integers(1, 3),
       head_dim=st.integers(1, 4), causal=st.booleans(), masked=st.booleans(),
       seed=st.integers(0, 1000))
@settings(max_examples=15)
def test_layer_matches_float64_reference(xp, dtype, batch, seq, heads, head_dim, causal, masked,
                                         seed):
    layer, x, mask, dy = problem(xp, dtype, batch, seq, heads * head_dim, heads, causal, masked, seed)
    y, dx, grads, report = run(layer, x, mask, dy)
    assert not report.detected, report.summary()
    params = {k: to_host(v) for k, v in layer.params.items()}
    m = None if mask is None else to_host(mask)
    y_ref, cache = ref.forward(to_host(x), params, heads, m, causal)
    dx_ref, grads_ref = ref.backward(to_host(dy), cache, params, heads)
    rel = REL_TOL[dtype]
    close(y, y_ref, rel)
    close(dx, dx_ref, rel)
    for key in grads_ref:
        close(grads[key], grads_ref[key], rel)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_fault_at_every_site_leaves_output_and_gradients_unchanged(xp, site, kind):
    layer, x, mask, dy = problem(xp, "float64", causal=True, masked=True)
    y0, dx0, g0, _ = run(layer, x, mask, dy)
    mantissa, exponent = bit_layout(np.float64)
    for i, pattern in enumerate(PATTERNS):
        extra = {"bit": mantissa + exponent - 1} if kind == "top-exponent" else {}
        fault = Fault("bitflip" if kind == "top-exponent" else kind, pattern, seed=i, sites=site,
                      **extra)
        y, dx, grads, report = run(layer, x, mask, dy, fault)
        assert fault.injected, "the fault never fired"
        changed = any(fault.injected[0].changed)
        close(y, y0, 1e-9)
        close(dx, dx0, 1e-9)
        for key in g0:
            close(grads[key], g0[key], 1e-9)
        if changed and kind != "bitflip":  # a random bit may flip a negligible mantissa bit
            assert site in report.sites, (pattern, report.summary())


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("site", SITES)
def test_extreme_faults_in_low_precision_are_caught(xp, dtype, site):
    layer, x, mask, dy = problem(xp, dtype, causal=True)
    y0, dx0, g0, _ = run(layer, x, mask, dy)
    for kind in ("inf", "nan", "near-inf"):
        fault = Fault(kind, "element", seed=3, sites=site)
        y, dx, grads, report = run(layer, x, mask, dy, fault)
        assert site in report.sites, report.summary()
        close(y, to_host(y0), REL_TOL[dtype])
        close(dx, to_host(dx0), REL_TOL[dtype])
        for key in g0:
            close(grads[key], to_host(g0[key]), REL_TOL[dtype])


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("site", list(INVARIANT_SITES))
def test_softmax_faults_are_caught_by_invariants(xp, site):
    layer, x, mask, dy = problem(xp, "float32", masked=True)
    y0, dx0, g0, _ = run(layer, x, mask, dy)
    for kind, pattern in (("nan", "element"), ("additive", "element"), ("scale", "row")):
        fault = Fault(kind, pattern, seed=5, sites=site, row=3, magnitude=0.25, factor=1.5)
        y, dx, grads, report = run(layer, x, mask, dy, fault)
        assert site in report.sites and report.recomputed >= 1, (kind, report.summary())
        close(y, to_host(y0), 1e-6)
        close(dx, to_host(dx0), 1e-6)


@pytest.mark.parametrize("xp", BACKENDS)
def test_2d_faults_are_recomputed(xp):
    layer, x, mask, dy = problem(xp, "float64", seq=12)
    y0, dx0, _, _ = run(layer, x, mask, dy)
    for site in ("scores", "context", "d_probs", "d_x"):
        fault = Fault("additive", "tile", seed=1, sites=site, magnitude=50.0, row=0, col=0)
        y, dx, _, report = run(layer, x, mask, dy, fault)
        assert any(e.action == "recomputed" and e.site == site for e in report.events), \
            report.summary()
        close(y, y0, 1e-9)
        close(dx, dx0, 1e-9)


@pytest.mark.parametrize("xp", BACKENDS)
def test_every_site_reaches_the_hook(xp):
    layer, x, mask, dy = problem(xp, "float32", causal=True, masked=True)
    recorder = Recorder()
    run(layer, x, mask, dy, recorder)
    assert recorder.sites == set(SITES) | set(INVARIANT_SITES)


def spread(y, y0):
    """Boolean (batch, seq) map of output rows that changed, and whether columns did."""
    diff = np.abs(to_host(y).astype(np.float64) - to_host(y0).astype(np.float64)) > 1e-9
    return diff.any(-1), diff


@pytest.mark.parametrize("xp", BACKENDS)
def test_unprotected_faults_spread_as_design_table_says(xp):
    """DESIGN §4: with check="off", Q[i,c] -> row i, K[j,c] -> all rows, V[j,c] -> 2D,
    AS[i,j] -> row i, CL[i,c] -> row i of the output."""
    layer, x, mask, dy = problem(xp, "float64", batch=1, seq=8, d_model=8, heads=1)
    layer.check = "off"
    y0, _ = layer.forward(x)
    for site, expect_rows in (("q_proj", 1), ("k_proj", 8), ("v_proj", 8), ("scores", 1),
                              ("context", 1)):
        fault = Fault("additive", "element", seed=0, sites=site, row=3, col=2, magnitude=1.0)
        y, _ = layer.forward(x, fault_hook=fault)
        rows, diff = spread(y, y0)
        assert rows.sum() == expect_rows, (site, rows)
        if expect_rows == 1:
            assert rows[0, 3]
        assert not layer.last_report.events
    fault = Fault("nan", "element", seed=0, sites="k_proj", row=3, col=2)
    y, _ = layer.forward(x, fault_hook=fault)
    assert np.isnan(to_host(y)).all()  # an INF/NaN key poisons every softmax row


@pytest.mark.parametrize("xp", BACKENDS)
def test_detect_mode_reports_without_repairing(xp):
    layer, x, mask, dy = problem(xp, "float32")
    layer.check = "detect"
    y, _ = layer.forward(x, fault_hook=Fault("inf", "element", seed=0, sites="out_proj"))
    assert np.isinf(to_host(y)).sum() == 1
    assert [e.action for e in layer.last_report.events] == ["reported"]


@pytest.mark.parametrize("xp", BACKENDS)
def test_bad_input_raises_clearly(xp):
    layer, x, mask, dy = problem(xp, "float32")
    with pytest.raises(ValueError, match="multiple of n_heads"):
        MultiHeadAttention(10, 3, xp=xp)
    with pytest.raises(ValueError, match="shape"):
        layer.forward(x[..., :4])
    with pytest.raises(ValueError, match="shape"):
        layer.forward(x[0])
    with pytest.raises(TypeError, match="dtype"):
        layer.forward(x.astype(np.float64))
    with pytest.raises(ValueError, match="mask must have shape"):
        layer.forward(x, xp.ones((2, 3), dtype=bool))
    with pytest.raises(TypeError, match="boolean"):
        layer.forward(x, xp.ones(x.shape[:2], dtype=np.int32))
    with pytest.raises(TypeError, match="supports"):
        MultiHeadAttention(8, 2, dtype="int32", xp=xp)


def test_plan_frequencies_and_adaptive_model():
    plan = CheckingPlan({"scores": CheckingPlan().sites["scores"].__class__(
        "S", "passed", every=3)})
    assert [plan.should_check("scores") for _ in range(6)] == [True, False, False] * 2
    freq = adaptive_frequencies(0.1, {"a": 0.6, "b": 0.3, "c": 0.1}, {"a": 1.0, "b": 3.0, "c": 1.0},
                                target=0.02)
    # risk a=.06 (per cost .06), c=.01 (.01), b=.03 (.01): check a fully, then b or c partially
    assert freq["a"] == 1.0
    remaining = sum(0.1 * v * (1 - freq[s]) for s, v in {"a": 0.6, "b": 0.3, "c": 0.1}.items())
    assert remaining == pytest.approx(0.02)
    assert "every call" in plan.with_frequencies({"q_proj": 1.0}).table()


@pytest.mark.parametrize("xp", BACKENDS)
def test_nonfinite_input_passes_through_like_plain_attention(xp):
    layer, x, mask, dy = problem(xp, "float32")
    x_bad = to_host(x).copy()
    x_bad[1, 2, 3] = np.nan
    y, _ = layer.forward(xp.asarray(x_bad))
    layer.check = "off"
    y_plain, _ = layer.forward(xp.asarray(x_bad))
    np.testing.assert_array_equal(to_host(y), to_host(y_plain))  # NaN where plain attention has NaN
    assert np.isnan(to_host(y)[1]).any() and np.isfinite(to_host(y)[0]).all()


def test_adaptive_frequencies_extremes():
    vulnerability, cost = {"a": 0.5, "b": 0.5}, {"a": 1.0, "b": 2.0}
    assert adaptive_frequencies(1e-3, vulnerability, cost, target=1e-2) == {"a": 0.0, "b": 0.0}
    assert adaptive_frequencies(1e-3, vulnerability, cost, target=0.0) == {"a": 1.0, "b": 1.0}
    with pytest.raises(ValueError):
        adaptive_frequencies(-1.0, vulnerability, cost, target=0.0)
