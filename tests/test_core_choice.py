"""attention.core's choice between the fused and the unfused attention product: which runs where,
equal results within the derived tolerance, faults corrected on both paths, the PyTorch module
saying which ran."""
from __future__ import annotations

import numpy as np
import pytest

from abftgemm.backend import to_host
from abftgemm.faults import Fault
from attention.context import Context
from attention.core import core_backward, core_forward
from attention.plan import CheckingPlan
from conftest import BACKENDS
from test_fused import _data, _reference


def _run(q, k, v, do, ctx, **kw):
    out, saved = core_forward(q, k, v, ctx, **kw)
    return saved["core"], (out,) + core_backward(saved, do, ctx)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("core", ["fused", "unfused"])
def test_both_cores_match_the_reference(core, causal):
    q, k, v, do = _data(np.random.default_rng(0), 2, 100, 100, 32)
    ctx = Context()
    ran, got = _run(q, k, v, do, ctx, causal=causal, core=core)
    assert ran == core and not ctx.report.events
    want, tol = _reference(q, k, v, do, 32 ** -0.5, causal)
    for g, w, t in zip(got, want, tol):
        assert np.all(np.abs(g - w) <= t), np.max(np.abs(g - w) / t)


def test_auto_runs_the_fused_core_where_it_applies():
    q, k, v, do = _data(np.random.default_rng(1), 1, 40, 40, 16)
    assert _run(q, k, v, do, Context(), causal=True)[0] == "fused"
    assert _run(q, k, v, do, Context(check="off"))[0] == "fused"
    assert _run(*(x.astype(np.float64) for x in (q, k, v, do)), Context())[0] == "fused"


def test_masks_run_on_the_fused_core():
    """Boolean and additive attn_masks (-inf allowed) run fused, equal to the unfused core
    within rounding, forward and backward."""
    rng = np.random.default_rng(7)
    q, k, v, do = _data(rng, 2, 60, 50, 16)
    add = rng.standard_normal((2, 60, 50))
    add[rng.random(add.shape) < 0.3] = -np.inf
    for mask in (add, add[0], rng.random((60, 50)) < 0.3):
        ran, got = _run(q, k, v, do, Context(), attn_mask=mask)
        assert ran == "fused"
        _, want = _run(q, k, v, do, Context(), attn_mask=mask, core="unfused")
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_key_visibility_equals_its_full_mask_on_both_cores(causal):
    """``key_visible`` (n, S) gives what the equal boolean attn_mask (n, L, S) gives, fused and
    unfused, with a head that sees no key (output and gradients 0); a non-finite gradient
    (the unfused core's forward again) keeps it."""
    rng = np.random.default_rng(8)
    q, k, v, do = _data(rng, 3, 70, 70, 16)
    visible = rng.random((3, 70)) < 0.6
    visible[1] = False
    full = np.broadcast_to(~visible[:, None, :], (3, 70, 70)).copy()
    want = _run(q, k, v, do, Context(), attn_mask=full, causal=causal, core="unfused")[1]
    for core in ("fused", "unfused"):
        ctx = Context()
        ran, got = _run(q, k, v, do, ctx, key_visible=visible, causal=causal, core=core)
        assert ran == core and not ctx.report.events
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
        assert not np.any(got[0][1]) and not np.any(got[1][1])
    bad = do.copy()
    bad[0, 3, 1] = np.inf
    out, saved = core_forward(q, k, v, Context(), key_visible=visible, causal=causal)
    assert saved["core"] == "fused"
    got = core_backward(saved, bad, Context())
    want = _run(q, k, v, bad, Context(), attn_mask=full, causal=causal, core="unfused")[1]
    for g, w in zip(got, want[1:]):
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("core", ["fused", "unfused"])
def test_key_visibility_on_every_backend(xp, core):
    """The same on CuPy's kernels (the unfused core's softmax steps, the fused CUDA kernels)."""
    rng = np.random.default_rng(10)
    q, k, v, do = _data(rng, 2, 20, 20, 8)
    visible = rng.random((2, 20)) < 0.6
    visible[:, 0] = True
    full = np.broadcast_to(~visible[:, None, :], (2, 20, 20)).copy()
    want = _run(q, k, v, do, Context(), attn_mask=full, causal=True, core="unfused")[1]
    ctx = Context()
    ran, got = _run(*(xp.asarray(t) for t in (q, k, v, do)), ctx,
                    key_visible=xp.asarray(visible), causal=True, core=core)
    assert ran == core and not ctx.report.events
    for g, w in zip(got, want):
        np.testing.assert_allclose(to_host(g), w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("core", ["fused", "unfused"])
@pytest.mark.parametrize("causal", [False, True])
def test_key_add_equals_its_folded_mask_on_every_backend(xp, core, causal):
    """``key_add`` (m, S), m dividing n, with ``attn_mask`` or without, gives what their sum as
    one ``(n, L, S)`` attn_mask gives, on both cores and every backend."""
    rng = np.random.default_rng(11)
    q, k, v, do = _data(rng, 4, 30, 30, 8)
    keys = rng.standard_normal((2, 30))
    keys[rng.random(keys.shape) < 0.3] = -np.inf
    keys[:, 0] = 0.0
    for add in (None, rng.standard_normal((30, 30))):
        full = np.repeat(keys, 2, axis=0)[:, None, :] + (np.zeros((30, 30)) if add is None
                                                          else add)
        want = _run(q, k, v, do, Context(), attn_mask=full, causal=causal, core="unfused")[1]
        ctx = Context()
        ran, got = _run(*(xp.asarray(t) for t in (q, k, v, do)), ctx,
                        attn_mask=None if add is None else xp.asarray(add),
                        key_add=xp.asarray(keys), causal=causal, core=core)
        assert ran == core and not ctx.report.events
        for g, w in zip(got, want):
            np.testing.assert_allclose(to_host(g), w, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="key_add must have shape"):
        core_forward(q, k, v, Context(), key_add=np.zeros((3, 30)))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("core", ["fused", "unfused"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_mask_per_group_of_heads_equals_it_repeated_per_head(xp, core, causal):
    """``attn_mask`` ``(m, L, S)``, m dividing n (one per batch item, shared by its heads:
    sliding windows of two widths here), boolean or float, alone or with ``key_add``, gives bit
    for bit what the same masks repeated to ``(n, L, S)`` give, on both cores and every
    backend; the fused core keeps the m masks, none per head."""
    rng = np.random.default_rng(12)
    n, m, length = 6, 2, 30
    q, k, v, do = _data(rng, n, length, length, 8)
    distance = np.abs(np.arange(length)[:, None] - np.arange(length)[None, :])
    window = distance[None] > np.array([4, 9])[:, None, None]  # True = not allowed
    floats = np.where(window, -np.inf, rng.standard_normal((m, length, length)))
    keys = rng.standard_normal((m, length))
    for mask, key_add in ((window, None), (floats, None), (floats, keys)):
        kw = {"causal": causal, "core": core,
              "key_add": None if key_add is None else xp.asarray(key_add)}
        data = [xp.asarray(t) for t in (q, k, v, do)]
        _, want = _run(*data, Context(), attn_mask=xp.asarray(np.repeat(mask, n // m, 0)), **kw)
        ctx = Context()
        out, saved = core_forward(*data[:3], ctx, attn_mask=xp.asarray(mask), **kw)
        got = (out,) + core_backward(saved, data[3], ctx)
        assert saved["core"] == core and not ctx.report.events
        if core == "fused":
            assert saved["fused"]["add"].shape == (m, length, length)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(to_host(g), to_host(w))
    with pytest.raises(ValueError, match=r"attn_mask must have shape .* with m dividing 6"):
        core_forward(q, k, v, Context(), attn_mask=np.zeros((4, length, length)))


@pytest.mark.parametrize("causal", [False, True])
def test_the_fused_core_skips_the_tiles_a_mask_hides(causal):
    """Tiles that an additive mask holds at ``-inf`` throughout (sliding windows of 100 and 200
    keys over 300: 128 x 128 tiles) are not computed, forward or backward (the fault hook sees
    the scores of the others alone), and the results equal the unfused core's."""
    rng = np.random.default_rng(14)
    n, length, tile = 4, 300, 128
    q, k, v, do = _data(rng, n, length, length, 16)
    distance = np.abs(np.arange(length)[:, None] - np.arange(length)[None, :])
    mask = np.where(distance[None] >= np.array([100, 200])[:, None, None], -np.inf,
                    rng.standard_normal((2, length, length)))
    blocks = range(0, length, tile)
    computed = [(b, i, j) for b in range(n) for i in blocks for j in blocks
                if not (causal and j > i)]  # the tiles the causal rule alone leaves
    live = sum(bool(np.isfinite(mask[b // 2, i:i + tile, j:j + tile]).any())
               for b, i, j in computed)
    assert 0 < live < len(computed)
    seen = []
    ctx = Context(fault_hook=lambda site, t: seen.append(site))
    out, saved = core_forward(q, k, v, ctx, attn_mask=mask, causal=causal, core="fused")
    forward_tiles = seen.count("fused:S")
    got = (out,) + core_backward(saved, do, ctx)
    assert forward_tiles == live and seen.count("fused:S") == 2 * live
    _, want = _run(q, k, v, do, Context(), attn_mask=mask, causal=causal, core="unfused")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["key_visible", "key_add"])
def test_the_fused_core_skips_the_key_blocks_padding_hides(kind):
    """Key blocks that key padding hides from a head throughout (items of 300, 250, 120 and no
    tokens: 128 keys a block) are not computed for that head, forward or backward, and the
    results equal the unfused core's (a head that sees no key: output and gradients 0)."""
    rng = np.random.default_rng(15)
    n, length, tile = 4, 300, 128
    q, k, v, do = _data(rng, n, length, length, 16)
    visible = np.arange(length)[None, :] < np.array([300, 250, 120, 0])[:, None]
    mask = {"key_visible": visible} if kind == "key_visible" else {
        "key_add": np.where(visible, rng.standard_normal(visible.shape), -np.inf)}
    blocks = range(0, length, tile)
    live = sum(bool(visible[b, j:j + tile].any()) for b in range(n) for _ in blocks
               for j in blocks)
    assert live == 3 * (3 + 2 + 1 + 0)
    seen = []
    ctx = Context(fault_hook=lambda site, t: seen.append(site))
    out, saved = core_forward(q, k, v, ctx, core="fused", **mask)
    forward_tiles = seen.count("fused:S")
    got = (out,) + core_backward(saved, do, ctx)
    assert forward_tiles == live and seen.count("fused:S") == 2 * live
    _, want = _run(q, k, v, do, Context(), core="unfused", **mask)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert not np.any(got[0][3]) and not any(np.any(g[3]) for g in got[1:])


def test_the_gradient_of_a_mask_per_group_of_heads_sums_its_heads():
    """``mask_grad`` with an ``(m, L, S)`` mask: the gradient of each mask is the sum of its
    heads' gradients, those of the mask repeated per head."""
    rng = np.random.default_rng(13)
    q, k, v, do = _data(rng, 6, 20, 20, 8)
    mask = rng.standard_normal((3, 20, 20))
    grads = []
    for given in (mask, np.repeat(mask, 2, 0)):
        ctx = Context()
        _, saved = core_forward(q, k, v, ctx, attn_mask=given, mask_grad=True)
        grads.append(core_backward(saved, do, ctx)[3])
    assert grads[0].shape == mask.shape
    np.testing.assert_allclose(grads[0], grads[1].reshape(3, 2, 20, 20).sum(1), rtol=1e-12,
                               atol=1e-12)


def test_key_visibility_refuses_bad_masks():
    q, k, v, _ = _data(np.random.default_rng(9), 2, 10, 12, 8)
    with pytest.raises(ValueError, match="key_visible must be a bool array of shape"):
        core_forward(q, k, v, Context(), key_visible=np.ones((2, 10), bool))
    with pytest.raises(ValueError, match="key_visible must be a bool array"):
        core_forward(q, k, v, Context(), key_visible=np.ones((2, 12)))
    with pytest.raises(TypeError, match="key_visible must be a numpy array"):
        core_forward(q, k, v, Context(), key_visible=[[True] * 12] * 2)


def test_auto_falls_back_to_the_unfused_core():
    q, k, v, do = _data(np.random.default_rng(2), 1, 24, 24, 8)
    mask = np.zeros((24, 24))
    mask[3, 4] = np.nan
    every_other = CheckingPlan().with_frequencies({"scores": 0.5})
    bad = q.copy()
    bad[0, 3, 1] = np.inf
    keep = np.random.default_rng(4).random((1, 24, 24)) >= 0.1
    cases = [((q, k, v), {"attn_mask": mask}),
             ((q, k, v), {"dropout": 0.1, "dropout_keep": keep}),  # a given mask: unfused
             ((q, k, v), {"ctx": Context(fault_hook=lambda site, c: None)}),
             ((q, k, v), {"ctx": Context(plan=every_other)}),
             ((bad, k, v), {})]
    for args, kw in cases:
        ctx = kw.pop("ctx", Context())
        _, saved = core_forward(*args, ctx, **kw)
        assert saved["core"] == "unfused", kw
    # 16-bit data run the fused core (tiles in float32)
    _, saved = core_forward(*(x.astype(np.float16) for x in (q, k, v)), Context())
    assert saved["core"] == "fused"


def test_forcing_the_fused_core_where_it_does_not_apply_raises():
    q, k, v, _ = _data(np.random.default_rng(3), 1, 16, 16, 8)
    with pytest.raises(ValueError, match="attn_mask"):
        core_forward(q, k, v, Context(), attn_mask=np.full((16, 16), np.inf), core="fused")
    keep = np.ones((1, 16, 16), bool)
    with pytest.raises(ValueError, match="dropout_keep"):
        core_forward(q, k, v, Context(), dropout=0.5, dropout_keep=keep, core="fused")
    _, saved = core_forward(q, k, v, Context(), dropout=0.5, core="fused")  # seeded: fused
    assert saved["core"] == "fused"
    with pytest.raises(ValueError, match="core must be one of"):
        core_forward(q, k, v, Context(), core="flash")


@pytest.mark.parametrize("core,site", [("fused", "fused:P"), ("fused", "fused:dK_acc"),
                                       ("unfused", "scores"), ("unfused", "d_k")])
def test_fault_corrected_on_either_core(core, site):
    q, k, v, do = _data(np.random.default_rng(4), 2, 70, 70, 16)
    clean = _run(q, k, v, do, Context(), causal=True, core=core)[1]
    fault = Fault("near-inf", "element", seed=5, sites=site)
    ctx = Context(fault_hook=fault)
    ran, got = _run(q, k, v, do, ctx, causal=True, core=core)
    assert ran == core and fault.injected
    assert site in ctx.report.sites and ctx.report.detected, ctx.report.summary()
    for g, c in zip(got, clean):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-6)


def test_non_finite_gradient_passes_through_as_on_the_unfused_core():
    q, k, v, do = _data(np.random.default_rng(6), 1, 20, 20, 8)
    do[0, 4, 2] = np.nan
    want = _run(q, k, v, do, Context(), core="unfused")[1]
    out, saved = core_forward(q, k, v, Context())
    assert saved["core"] == "fused"
    got = core_backward(saved, do, Context())
    for g, w in zip(got, want[1:]):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_check_off_leaves_a_fault_in_the_fused_backward_in_place():
    """``check="off"`` runs the fused core's tiles unchecked and leaves a fault where it lands,
    in its backward as in its forward (which never falls back to the unfused core in that mode):
    an INF put into a ``dS`` tile reaches the gradients. The backward took any non-finite
    gradient for an overflow and ran again on the unfused core, which hid the fault."""
    from attention import MultiHeadAttention

    q, k, v, do = _data(np.random.default_rng(8), 1, 20, 20, 8)
    ctx = Context("off", fault_hook=Fault("inf", "element", seed=1, sites="fused:dS"))
    out, saved = core_forward(q, k, v, ctx, core="fused")
    grads = core_backward(saved, do, ctx)
    assert saved["core"] == "fused" and ctx.fault_hook.injected
    assert not np.isfinite(grads[0]).all() and "fused:dS" not in ctx.report.checked
    layer = MultiHeadAttention(16, 2, core="fused", check="off")
    x = np.random.default_rng(9).standard_normal((1, 12, 16)).astype(np.float32)
    y, cache = layer.forward(x)
    fault = Fault("inf", "element", seed=1, sites="fused:dS")
    dx, _ = layer.backward(np.ones_like(y), cache, fault_hook=fault)
    assert fault.injected and not np.isfinite(dx).all()


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("low", [-1e4, -1e9, float(np.finfo(np.float32).min)])
def test_a_row_lowered_at_every_key_gets_the_unfused_cores_gradient(xp, low):
    """An additive mask that lowers every key of a query row by 1e4 or more (a whole row padded
    with a large finite value): ``lse = m + log l`` rounds at the scale of ``m`` and loses
    ``log l``, so probabilities recomputed from it alone would be wrong (at -1e9, ``exp(0) = 1``
    at every key instead of ``1 / L``: dQ off by 11 where it is O(1)). The forward keeps the
    rest in ``lse_lo``; the fused backward runs and equals the unfused core's."""
    data = _data(np.random.default_rng(7), 2, 24, 24, 8)
    add = np.zeros((24, 24), np.float32)
    add[5] = low
    q, k, v, do, add = (xp.asarray(t) for t in (*data, add))
    runs = {}
    for core in ("fused", "unfused"):
        ctx = Context()
        runs[core] = _run(q, k, v, do, ctx, attn_mask=add, core=core)
        assert runs[core][0] == core and not ctx.report.detected
        assert ("fused:dS" in ctx.report.checked) == (core == "fused")  # its backward ran
    for g, w in zip(runs["fused"][1], runs["unfused"][1]):
        np.testing.assert_allclose(to_host(g), to_host(w), rtol=0, atol=1e-5)


def test_the_layers_fused_backward_equals_the_unfused_one_for_such_a_row():
    from attention import MultiHeadAttention, attention_backward, attention_forward

    layer = MultiHeadAttention(16, 2, dtype="float64", seed=3)
    rng = np.random.default_rng(8)
    x, dy = rng.standard_normal((2, 6, 16)), rng.standard_normal((2, 6, 16))
    add = np.zeros((6, 6))
    add[2] = np.finfo(np.float32).min
    runs = []
    for core in ("fused", "unfused"):
        ctx = Context()
        y, saved = attention_forward(layer.params, x, ctx, n_heads=2, attn_mask=add, core=core)
        runs.append((y, *attention_backward(saved, dy, ctx)))
        assert saved["core"] == core and ("fused:dS" in ctx.report.checked) == (core == "fused")
    (y, dx, grads), (y_u, dx_u, grads_u) = runs
    np.testing.assert_allclose(dx, dx_u, rtol=0, atol=1e-12)  # 3.7 apart with lse alone
    for name in grads:
        np.testing.assert_allclose(grads[name], grads_u[name], rtol=0, atol=1e-12)


def test_torch_module_says_which_core_ran():
    torch = pytest.importorskip("torch")
    from attention.torch_core import ProtectedCore
    q, k, v = (torch.randn(1, 2, 30, 16, requires_grad=True) for _ in range(3))
    core = ProtectedCore()
    out, _ = core(q, k, v, is_causal=True)
    assert core.last_core == "fused"
    out.sum().backward()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    core(q, k, v, is_causal=True, need_weights=True)
    assert core.last_core == "unfused"
    forced = ProtectedCore(core="unfused")
    forced(q, k, v, is_causal=True)
    assert forced.last_core == "unfused"
    with pytest.raises(ValueError, match="core must be one of"):
        ProtectedCore(core="flash")


def test_torch_core_forced_fused_refuses_the_weights():
    """``core="fused"`` forces the fused core, which makes no attention weights: asked for them,
    ``attention_core`` and ``ProtectedCore`` raise as the layer and the PyTorch module do (they
    ran the unfused core in its place, saying nothing but ``last_core``)."""
    torch = pytest.importorskip("torch")
    from attention.torch_core import ProtectedCore
    from attention.torch_functional import Protection, attention_core
    q = torch.randn(1, 2, 6, 8)
    protection = Protection()
    with pytest.raises(ValueError, match="weights"):
        attention_core(q, q, q, protection=protection, need_weights=True, core="fused")
    assert protection.last_core is None
    with pytest.raises(ValueError, match="weights"):
        ProtectedCore(core="fused")(q, q, q, need_weights=True)
    out, weights = attention_core(q, q, q, protection=protection, need_weights=True)
    assert protection.last_core == "unfused" and weights.shape == (1, 2, 6, 6)


def test_float16_output_overflow_passes_through_as_on_the_unfused_core():
    """A genuine float16 overflow of the output (``V = 65504``, kept and scaled by ``1 / (1 -
    p)``): the fused core's final check could not tell it from a fault and raised
    (``check="correct"``) or warned (``"detect"``); ``core="auto"`` now runs the unfused core,
    which passes it through as plain math gives it, in ``attention.core`` and in the layer."""
    import warnings

    from attention import MultiHeadAttention
    from attention.dropout_hash import keep_mask

    p = 0.01
    seed = next(s for s in range(100) if keep_mask(s, p, (1, 1, 1))[0, 0, 0])
    q = k = np.zeros((1, 1, 1), np.float16)
    v = np.full((1, 1, 1), 65504, np.float16)
    layer = MultiHeadAttention(2, 1, dtype="float16", causal=False)
    for name in layer.params:
        layer.params[name][...] = 0
    layer.params["wv"][0] = 65504
    layer.params["wo"][...] = np.eye(2, dtype=np.float16)
    for check in ("detect", "correct"):
        ctx = Context(check=check)
        layer.check = check
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, saved = core_forward(q, k, v, ctx, dropout=p, dropout_seed=seed)
            y, cache = layer.forward(np.array([[[1, 0]]], np.float16), dropout=p,
                                     dropout_seed=seed)
        assert saved["core"] == cache["core"] == "unfused"
        assert np.isposinf(out).all() and not np.isfinite(y).any()
        assert not ctx.report.detected and not layer.last_report.detected


def test_forced_fused_core_does_not_fall_back_on_an_output_overflow():
    """``core="fused"`` keeps the fused core: a float16 output overflow raises there (the
    fallback to the unfused core is ``"auto"``'s, as documented)."""
    from abftgemm import UncorrectableError
    from attention.dropout_hash import keep_mask

    p = 0.01
    seed = next(s for s in range(100) if keep_mask(s, p, (1, 1, 1))[0, 0, 0])
    q = k = np.zeros((1, 1, 1), np.float16)
    v = np.full((1, 1, 1), 65504, np.float16)
    with pytest.raises(UncorrectableError):
        core_forward(q, k, v, Context(), core="fused", dropout=p, dropout_seed=seed)
