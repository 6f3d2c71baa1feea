"""Properties of the protected attention layer, one body per property, on every backend present."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from abftgemm.backend import to_host
from abftgemm.faults import Fault, Recorder, bit_layout
from attention import (FORWARD_SITES, INVARIANT_SITES, SITES, CheckingPlan, MultiHeadAttention,
                       SitePlan, adaptive_frequencies)
from attention import reference as ref
from conftest import BACKENDS

DTYPES = ["float64", "float32", "float16", "bfloat16"]
FAULT_KINDS = ("inf", "-inf", "nan", "near-inf", "top-exponent", "bitflip", "additive")
PATTERNS = ("element", "row", "column", "tile", "warp")
#: Unit roundoff of each layer dtype, written out from the formats (not read from the library).
U = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
#: flash-attention's test rule: the protected layer may be at most this many times less accurate
#: (against the float64 reference) than a plain low-precision computation of the same tensor.
LOWP_FACTOR = 2
#: Longest chain of dependent rounded steps from an input to an output (backward dX: projection,
#: scores, softmax, context, out_proj, dContext, dP, softmax backward, dQ, dX).
CHAIN = 10


def lowp_reference(x, params, dy, heads, mask, causal, dtype):
    """Unprotected low-precision attention, forward and backward, written from the steps of
    ``attention.reference``: each step computed with NumPy in the accumulation precision (float32
    for 16- and 32-bit dtypes, float64 for float64) from the stored tensors of the step before,
    and its result stored (rounded) in ``dtype``, as a plain layer does. Returns
    ``{name: array}`` for ``y``, ``dx`` and every parameter gradient."""
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32

    def rnd(t):
        return np.asarray(t).astype(dtype).astype(acc)

    x, dy = rnd(x), rnd(dy)
    w = {key: rnd(value) for key, value in params.items()}
    batch, seq, d_model = x.shape
    scale = acc(1 / np.sqrt(d_model // heads))
    q, k, v = (rnd(ref.project(x, w["w" + n], w["b" + n])) for n in "qkv")
    vis = ref.visible(mask, causal, batch, seq)
    scores = np.where(vis, rnd(ref.attention_scores(q, k, heads)), -np.inf)
    top = scores.max(-1, keepdims=True)
    e = np.exp(scores - np.where(np.isfinite(top), top, 0))  # softmax in acc, 0 where hidden
    p = rnd(e / np.maximum(e.sum(-1, keepdims=True), np.finfo(acc).tiny))
    vh = ref.split_heads(v, heads)
    context = rnd(ref.merge_heads(p @ vh))
    out = {"y": rnd(ref.project(context, w["wo"], w["bo"]))}
    out["wo"], out["bo"] = rnd(np.einsum("bsi,bso->io", context, dy)), rnd(dy.sum((0, 1)))
    d_ctx = ref.split_heads(rnd(dy @ w["wo"].T), heads)
    d_p = rnd(d_ctx @ vh.transpose(0, 1, 3, 2))
    d_v = ref.merge_heads(rnd(p.transpose(0, 1, 3, 2) @ d_ctx))
    d_s = rnd(ref.softmax_backward(d_p, p, vis) * scale)
    d_q = ref.merge_heads(rnd(d_s @ ref.split_heads(k, heads)))
    d_k = ref.merge_heads(rnd(d_s.transpose(0, 1, 3, 2) @ ref.split_heads(q, heads)))
    for n, d in (("q", d_q), ("k", d_k), ("v", d_v)):
        out["w" + n], out["b" + n] = rnd(np.einsum("bsi,bso->io", x, d)), rnd(d.sum((0, 1)))
    out["dx"] = rnd(d_q @ w["wq"].T + d_k @ w["wk"].T + d_v @ w["wv"].T)
    return out


class Oracle:
    """The float64 reference and the low-precision error budget of every output tensor."""

    def __init__(self, layer, x, mask, dy):
        params = {key: to_host(value) for key, value in layer.params.items()}
        heads, m = layer.n_heads, None if mask is None else to_host(mask)
        x, dy = to_host(x), to_host(dy)
        y, cache = ref.forward(x, params, heads, m, layer.causal)
        dx, grads = ref.backward(dy, cache, params, heads)
        self.exact = {"y": y, "dx": dx, **grads}
        lowp = lowp_reference(x, params, dy, heads, m, layer.causal, layer.dtype)
        name = np.dtype(layer.dtype).name
        # A rebuilt element is a float64 checksum minus a float64 sum of the other elements of its
        # vector; with at most n terms per sum (n: the largest product dimension), each of
        # magnitude up to n x the O(1) scale, the worst-case rounding (constant 1) is 2 n^2 u64.
        n = max(x.shape[0] * x.shape[1], x.shape[2])
        self.checksum_rounding = 2 * n * n * U["float64"]
        self.budget = {}
        for key, want in self.exact.items():
            plain = float(np.abs(lowp[key] - want).max(initial=0))
            # Floor: the layer and the plain computation sum in different orders, so even two
            # correct results differ: by up to K u_acc of the tensor's magnitude for sums of K
            # terms (worst case, constant 1; K = 3 d_model for dx, batch*seq for weight
            # gradients), twice for the two computations, plus a few roundings to the dtype
            # (measured up to 2 u, bfloat16; 4 u allowed). float64's plain error is 0 by
            # construction, so there the floor is all, and it must also cover the different
            # rounding of every earlier step of the chain (CHAIN), which LOWP_FACTOR x plain
            # covers in the 16-bit dtypes (a weight gradient 1.07x over the one-step floor was
            # found: x^T dQ, with dQ's own rounding). float32 stores in its accumulation type,
            # so its plain error can be one rounding by luck while the layer's other order
            # (cuBLAS, the GPU kernels' fused multiply-adds) rounds each step differently: an
            # H200 run found dW_k 1.22x over the one-step floor (seq 4, head_dim 1); float32
            # gets the chain's floor too. The magnitude is at least 1: the data are
            # O(1) (x, dy standard normal) and the bias gradients of K are exactly 0 in exact
            # arithmetic (softmax ignores a per-row shift), yet carry the rounding of O(1) terms.
            terms = max(3 * x.shape[2], x.shape[0] * x.shape[1])
            u_acc = U["float64"] if name == "float64" else U["float32"]
            steps = CHAIN if name in ("float64", "float32") else 1
            floor = (4 * U[name] + 2 * steps * terms * u_acc) * \
                max(float(np.abs(want).max(initial=0)), 1.0)
            self.budget[key] = (plain, floor)

    def assert_accurate(self, outputs):
        """Each tensor's error against float64 is within LOWP_FACTOR x the plain one + floor."""
        for key, got in outputs.items():
            plain, floor = self.budget[key]
            err = np.abs(to_host(got).astype(np.float64) - self.exact[key]).max(initial=0)
            assert err <= LOWP_FACTOR * plain + floor, (key, err, plain, floor)

    def assert_same(self, outputs, fault_free):
        """A repaired run differs from the fault-free one by at most one plain low-precision
        computation's error (+ floor) plus the float64 checksum rounding of the rebuilt elements:
        a repair may round differently, but no worse."""
        for key, got in outputs.items():
            plain, floor = self.budget[key]
            scale = max(float(np.abs(self.exact[key]).max(initial=0)), 1.0)
            allowed = plain + floor + self.checksum_rounding * scale
            diff = to_host(got).astype(np.float64) - to_host(fault_free[key]).astype(np.float64)
            assert np.isfinite(diff).all(), key
            assert np.abs(diff).max(initial=0) <= allowed, (key, np.abs(diff).max(), allowed)


def outputs(y, dx, grads):
    return {"y": y, "dx": dx, **grads}


def run(layer, x, mask, dy, hook=None):
    y, cache = layer.forward(x, mask, fault_hook=hook)
    dx, grads = layer.backward(dy, cache, fault_hook=hook)
    return y, dx, grads, layer.last_report  # the forward's findings and the backward's


def problem(xp, dtype, batch=2, seq=6, d_model=8, heads=2, causal=False, masked=False, seed=0,
            core="auto"):
    layer = MultiHeadAttention(d_model, heads, causal=causal, dtype=dtype, xp=xp, seed=seed,
                               core=core)
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
def test_layer_matches_float64_reference(xp, dtype, batch, seq, heads, head_dim, causal, masked,
                                         seed):
    """The unfused layer: the oracle's plain low-precision computation is its algorithm. The
    fused core rounds in another order (P from the log-sum-exp, online rescaling); it is held to
    float64 by its own derived tolerance in tests/test_fused.py and to this layer in
    tests/test_layer_core.py."""
    layer, x, mask, dy = problem(xp, dtype, batch, seq, heads * head_dim, heads, causal, masked, seed,
                                 core="unfused")
    y, dx, grads, report = run(layer, x, mask, dy)
    assert not report.detected, report.summary()
    Oracle(layer, x, mask, dy).assert_accurate(outputs(y, dx, grads))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_fault_at_every_site_leaves_output_and_gradients_unchanged(xp, site, kind):
    layer, x, mask, dy = problem(xp, "float64", causal=True, masked=True)
    y0, dx0, g0, _ = run(layer, x, mask, dy)
    oracle, fault_free = Oracle(layer, x, mask, dy), outputs(y0, dx0, g0)
    mantissa, exponent = bit_layout(np.float64)
    for i, pattern in enumerate(PATTERNS):
        extra = {"bit": mantissa + exponent - 1} if kind == "top-exponent" else {}
        fault = Fault("bitflip" if kind == "top-exponent" else kind, pattern, seed=i, sites=site,
                      **extra)
        y, dx, grads, report = run(layer, x, mask, dy, fault)
        assert fault.injected, "the fault never fired"
        changed = any(fault.injected[0].changed)
        oracle.assert_same(outputs(y, dx, grads), fault_free)
        if changed and kind != "bitflip":  # a random bit may flip a negligible mantissa bit
            assert site in report.sites, (pattern, report.summary())


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("site", SITES)
def test_extreme_faults_in_low_precision_are_caught(xp, dtype, site):
    layer, x, mask, dy = problem(xp, dtype, causal=True)
    y0, dx0, g0, _ = run(layer, x, mask, dy)
    oracle, fault_free = Oracle(layer, x, mask, dy), outputs(y0, dx0, g0)
    for kind in ("inf", "nan", "near-inf"):
        fault = Fault(kind, "element", seed=3, sites=site)
        y, dx, grads, report = run(layer, x, mask, dy, fault)
        assert site in report.sites, report.summary()
        oracle.assert_same(outputs(y, dx, grads), fault_free)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("site", list(INVARIANT_SITES))
def test_softmax_faults_are_caught_by_invariants(xp, site):
    layer, x, mask, dy = problem(xp, "float32", masked=True)
    y0, dx0, g0, _ = run(layer, x, mask, dy)
    oracle, fault_free = Oracle(layer, x, mask, dy), outputs(y0, dx0, g0)
    for kind, pattern in (("nan", "element"), ("additive", "element"), ("scale", "row")):
        fault = Fault(kind, pattern, seed=5, sites=site, row=3, magnitude=0.25, factor=1.5)
        y, dx, grads, report = run(layer, x, mask, dy, fault)
        assert site in report.sites and report.recomputed >= 1, (kind, report.summary())
        oracle.assert_same(outputs(y, dx, grads), fault_free)


@pytest.mark.parametrize("xp", BACKENDS)
def test_2d_faults_are_recomputed(xp):
    layer, x, mask, dy = problem(xp, "float64", seq=12)
    y0, dx0, g0, _ = run(layer, x, mask, dy)
    oracle, fault_free = Oracle(layer, x, mask, dy), outputs(y0, dx0, g0)
    for site in ("scores", "context", "d_probs", "d_x"):
        fault = Fault("additive", "tile", seed=1, sites=site, magnitude=50.0, row=0, col=0)
        y, dx, grads, report = run(layer, x, mask, dy, fault)
        assert any(e.action == "recomputed" and e.site == site for e in report.events), \
            report.summary()
        oracle.assert_same(outputs(y, dx, grads), fault_free)


@pytest.mark.parametrize("xp", BACKENDS)
def test_every_site_reaches_the_hook(xp):
    layer, x, mask, dy = problem(xp, "float32", causal=True, masked=True)
    recorder = Recorder()
    run(layer, x, mask, dy, recorder)
    assert recorder.sites == set(SITES) | set(INVARIANT_SITES)


def spread(y, y0):
    """Boolean (batch, seq) map of output rows that changed, and whether columns did."""
    # float64, O(1) data: rounding differences are ~1e-16, the additive 1.0 fault moves the rows
    # it reaches by ~0.1-1; 1e-9 lies far from both.
    diff = np.abs(to_host(y).astype(np.float64) - to_host(y0).astype(np.float64)) > 1e-9
    return diff.any(-1), diff


@pytest.mark.parametrize("xp", BACKENDS)
def test_unprotected_faults_spread_as_design_table_says(xp):
    """The spread table of README's attention design: with check="off", Q[i,c] -> row i, K[j,c] -> all rows, V[j,c] -> 2D,
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
    # these failed deep in the pass: "'int' object is not callable", KeyError: 'inputs'
    with pytest.raises(TypeError, match="fault_hook must be callable"):
        layer.forward(x, fault_hook=3)
    with pytest.raises(TypeError, match="saved must be the dict attention_forward returned"):
        layer.backward(dy, {})
    _, cache = layer.forward(x)
    layer.backward(dy, cache)  # the layer goes on


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("name", ["wk", "bq"])
def test_a_parameter_of_another_dtype_or_shape_raises(xp, name):
    """A float64 parameter in a float32 layer (a bias reset with ``np.zeros(d)``) made a
    promoted product that the pass's float32 buffers took only at the settle: the next step
    read stale or uninitialized memory, and the output was wrong with a clean report."""
    layer, x, _, _ = problem(xp, "float32")
    kept = layer.params[name]
    layer.params[name] = kept.astype(np.float64)
    with pytest.raises(TypeError, match=f"parameter {name} has dtype float64"):
        layer.forward(x)
    layer.params[name] = kept[..., :-1]
    with pytest.raises(ValueError, match=f"parameter {name} must have shape"):
        layer.forward(x)


def test_plan_frequencies_and_adaptive_model():
    plan = CheckingPlan({"scores": SitePlan(every=3)})
    assert [plan.should_check("scores") for _ in range(6)] == [True, False, False] * 2
    freq = adaptive_frequencies(0.1, {"a": 0.6, "b": 0.3, "c": 0.1}, {"a": 1.0, "b": 3.0, "c": 1.0},
                                target=0.02)
    # risk a=.06 (per cost .06), c=.01 (.01), b=.03 (.01): check a fully, then b or c partially
    assert freq["a"] == 1.0
    remaining = sum(0.1 * v * (1 - freq[s]) for s, v in {"a": 0.6, "b": 0.3, "c": 0.1}.items())
    assert remaining == pytest.approx(0.02)
    assert "every call" in plan.with_frequencies({"q_proj": 1.0}).table()


@pytest.mark.parametrize("make, match", [
    (lambda: SitePlan(every=0), "every must be an integer of at least 1"),
    (lambda: SitePlan(every=1.5), "every must be an integer"),
    (lambda: SitePlan(probability=float("nan")), r"probability must be in \[0, 1\]"),
    (lambda: SitePlan(probability=-1), r"probability must be in \[0, 1\]"),
    (lambda: CheckingPlan().with_frequencies({"q-proj": 0.0}), "unknown sites"),
    (lambda: CheckingPlan().with_frequencies({"q_proj": 2.0}), r"probability must be in"),
])
def test_bad_site_plans_are_refused_when_made(make, match):
    """``every=0`` failed at the first forward (a modulo by zero); a NaN or negative
    probability turned checking off without a word; a misspelt site was dropped."""
    with pytest.raises(ValueError, match=match):
        make()


class RecordingPlan(CheckingPlan):
    """A checking plan that records every decision it draws, ``(site, checked)`` in call order."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.drawn: list[tuple[str, bool]] = []

    def should_check(self, site: str) -> bool:
        checked = super().should_check(site)
        self.drawn.append((site, checked))
        return checked


def _repaired_step(xp, plan):
    """One forward of a small layer under ``plan`` with a near-INF fault at q_proj, which the
    settle repairs, so the pass is replayed site by site."""
    layer, x, _, _ = problem(xp, "float32")
    layer.plan = plan
    layer.forward(x, fault_hook=Fault("near-inf", "element", seed=1, sites="q_proj"))
    assert "q_proj" in layer.last_report.sites, layer.last_report.summary()


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_replayed_step_advances_an_every_n_schedule_once(xp):
    plan = RecordingPlan({"q_proj": SitePlan(every=2)})
    _repaired_step(xp, plan)
    assert [d for d in plan.drawn if d[0] == "q_proj"] == [("q_proj", True)]
    assert [plan.should_check("q_proj") for _ in range(2)] == [False, True]  # calls 2 and 3


@pytest.mark.parametrize("xp", BACKENDS)
def test_a_replay_reuses_the_first_pass_probabilistic_draws(xp):
    """Every site but q_proj (always checked, where the fault is) is checked with probability
    1/2: the replayed step draws each site once, the same draws as a clean step of a plan with
    the same seed."""
    sites = CheckingPlan().with_frequencies({s: 0.5 for s in FORWARD_SITES
                                             if s != "q_proj"}).sites
    plan = RecordingPlan(sites, seed=4)
    _repaired_step(xp, plan)
    layer, x, _, _ = problem(xp, "float32")
    layer.plan = clean = RecordingPlan(sites, seed=4)
    layer.forward(x)
    assert not layer.last_report.detected
    assert plan.drawn == clean.drawn and len(plan.drawn) == len(FORWARD_SITES)
    assert {checked for site, checked in plan.drawn if site != "q_proj"} == {True, False}


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


@pytest.mark.parametrize("core", ["unfused", "fused"])
@pytest.mark.parametrize("site", ["q_proj", "scores", "d_x"])
def test_a_repaired_pass_counts_each_check_once(site, core):
    """A pass whose settle repaired a product is replayed, every site checked again; the report
    counted the repaired site's checks twice (the first run's and the replay's: ``q_proj`` 4 in
    a batch of 2, ``scores`` 16 for 8 heads' products) and every other site's once. ``checked``
    says how many products the delivered pass verified, as a clean call's."""
    if core == "fused" and site == "scores":
        pytest.skip("the fused core has no scores site")
    layer = MultiHeadAttention(16, 4, core=core)
    x = np.random.default_rng(0).standard_normal((2, 6, 16)).astype(np.float32)
    y, cache = layer.forward(x)
    layer.backward(np.ones_like(y), cache)
    clean = dict(layer.last_report.checked)
    fault = Fault("bitflip", "element", seed=1, bit=30, sites={site})
    y, cache = layer.forward(x, fault_hook=fault)
    layer.backward(np.ones_like(y), cache, fault_hook=fault)
    assert layer.last_report.sites == {site} and fault.injected
    assert layer.last_report.checked == clean


@pytest.mark.parametrize("xp", BACKENDS)
def test_last_report_is_the_last_pass_forward_and_backward(xp):
    """``last_report`` holds the last forward's findings, extended by its backward; the backward of
    an earlier forward's cache extends that forward's report, which becomes the last one again.
    The meaning :class:`attention.torch.MultiheadAttention` shares
    (tests/test_torch_attention.py)."""
    layer = MultiHeadAttention(8, 2, dtype="float64", xp=xp)
    rng = np.random.default_rng(3)
    x, dy = (xp.asarray(rng.standard_normal((2, 5, 8))) for _ in range(2))
    fault = Fault("additive", "element", seed=2, magnitude=1e3, sites={"q_proj"})
    _, first = layer.forward(x, fault_hook=fault)
    faulty = layer.last_report
    assert faulty.sites == {"q_proj"} and "d_x" not in faulty.checked
    forward_checks = dict(faulty.checked)
    _, second = layer.forward(x)
    assert layer.last_report is not faulty and not layer.last_report.events
    layer.backward(dy, first)
    assert layer.last_report is faulty and faulty.sites == {"q_proj"}
    assert faulty.checked["d_x"] == 1  # extended by the backward's checks ...
    assert all(faulty.checked[s] == n for s, n in forward_checks.items())  # ... the forward's once
