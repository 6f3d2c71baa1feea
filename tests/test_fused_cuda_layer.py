"""The fused CUDA core in the layer's passes (``core="fused"``, on ``cupy-on-cpu`` without a
GPU): its checks are read with the pass's one settle (attention/fused_deferred.py), and what
they find is handled there as the core alone handles it: a kernel's repaired tile booked, a
failed final check recomputed by the pass's replay, a persistent fault raised, non-finite
inputs (a projection's fault) repaired first, a non-finite gradient sent to the unfused
backward."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from abftgemm import FaultDetectedWarning, UncorrectableError
from abftgemm.backend import to_host
from abftgemm.faults import Fault
from attention import MultiHeadAttention
from conftest import BACKENDS, CUDA_ON_CPU, GPU

CUDA = [pytest.param(GPU, id="cupy", marks=pytest.mark.skipif(GPU is None, reason="no GPU"))]
if GPU is None:
    CUDA.append(pytest.param(CUDA_ON_CPU, id="cupy-on-cpu", marks=[
        pytest.mark.cuda_on_cpu,
        pytest.mark.skipif(CUDA_ON_CPU is None, reason="needs the cupy-on-cpu stand-in")]))


def _step(xp, x, dy, hook=None, check="correct", core="fused", **kw):
    """``(y, dx, grads...)`` on the host, and the layer (its reports of the two passes in
    ``layer.sites``, the cores that ran in ``layer.cores``)."""
    layer = MultiHeadAttention(16, 2, causal=True, xp=xp, core=core, check=check)
    y, cache = layer.forward(xp.asarray(x), fault_hook=hook, **kw)
    layer.events = list(layer.last_report.events)
    layer.cores = [layer.last_core]
    dx, grads = layer.backward(xp.asarray(dy), cache, fault_hook=hook)
    layer.events += layer.last_report.events
    layer.sites = {e.site for e in layer.events}
    return [to_host(t) for t in (y, dx, *(grads[k] for k in sorted(grads)))], layer


def _data(seed=0, seq=24):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, seq, 16)).astype(np.float32) for _ in range(2))


def _equal(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("xp", CUDA)
def test_a_clean_pass_equals_the_cpu_kernels(xp):
    x, dy = _data()
    got, layer = _step(xp, x, dy)
    want, _ = _step(np, x, dy)
    assert layer.cores == ["fused"] and not layer.events
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site", ["fused:S", "fused:O_acc", "fused:dS", "fused:dK_acc"])
def test_a_kernel_fault_is_booked_at_the_settle(xp, site):
    """The kernel recomputes the flagged tile itself: the settle books the finding from its
    records, and the step equals the clean one bit for bit."""
    from attention._cuda_fused import DeviceFault

    x, dy = _data(1)
    clean, _ = _step(xp, x, dy)
    fault = DeviceFault(site, 13, 5, head=1, kind="near-inf")
    got, layer = _step(xp, x, dy, fault)
    assert fault.hits == 1 and site in layer.sites
    assert all(e.action == "recomputed" for e in layer.events if e.site == site)
    _equal(got, clean)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("site", ["fused:out", "fused:dV_out", "fused:dK_out"])
def test_a_final_check_fault_is_recomputed_by_the_replay(xp, site):
    x, dy = _data(2)
    clean, _ = _step(xp, x, dy)
    fault = Fault("additive", "element", seed=4, sites=site, magnitude=10.0)
    got, layer = _step(xp, x, dy, fault)
    assert fault.injected and site in layer.sites
    _equal(got, clean)


@pytest.mark.parametrize("xp", CUDA)
def test_a_persistent_kernel_fault_raises(xp):
    from attention._cuda_fused import DeviceFault

    x, dy = _data(3)
    with pytest.raises(UncorrectableError, match="fused"):
        _step(xp, x, dy, DeviceFault("fused:P", 7, 3, kind="inf", persistent=True))


@pytest.mark.parametrize("xp", CUDA)
def test_detect_mode_reports_a_kernel_fault_and_leaves_it(xp):
    from attention._cuda_fused import DeviceFault

    x, dy = _data(4)
    clean, _ = _step(xp, x, dy, check="detect")
    with pytest.warns(FaultDetectedWarning, match="fused:O_acc"):
        got, layer = _step(xp, x, dy, DeviceFault("fused:O_acc", 9, 2, kind="additive",
                                                  value=50.0), check="detect")
    assert {e.action for e in layer.events} == {"reported"} and "fused:O_acc" in layer.sites
    assert not np.array_equal(got[0], clean[0])


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_a_projection_fault_to_inf_reaches_the_forced_fused_core_repaired(xp, kind):
    """``core="fused"`` takes finite data only: a projection's fault that writes INF or NaN is
    found and repaired before it (not a ValueError), and reported."""
    x, dy = _data(5)
    clean, _ = _step(xp, x, dy)
    fault = Fault(kind, "element", seed=6, sites="k_proj")
    got, layer = _step(xp, x, dy, fault)
    assert fault.injected and "k_proj" in layer.sites and layer.cores == ["fused"]
    for g, c in zip(got, clean):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("check", ["detect", "off"])
def test_outside_correct_mode_such_a_fault_is_left_to_the_unfused_steps(xp, check):
    """Detect and off modes leave a projection's INF in place: the unfused steps pass it
    through (as ``core="auto"`` does), and detect mode reports it."""
    x, dy = _data(5)
    fault = Fault("inf", "element", seed=6, sites="k_proj")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, layer = _step(xp, x, dy, fault, check=check)
    assert fault.injected and layer.cores == ["unfused"] and not np.isfinite(got[0]).all()
    reported = {e.site for e in layer.events if e.action == "reported"}
    assert ("k_proj" in reported) == (check == "detect") == bool(caught)


@pytest.mark.parametrize("xp", BACKENDS)
def test_non_finite_data_still_raise_on_the_forced_fused_core(xp):
    x, dy = _data(6)
    x[1, 3, 4] = np.inf
    with pytest.raises(ValueError, match="INF or NaN"):
        _step(xp, x, dy)


@pytest.mark.parametrize("xp", CUDA)
def test_a_non_finite_gradient_takes_the_unfused_backward(xp):
    x, dy = _data(7)
    dy[0, 5, 2] = np.nan
    want, _ = _step(xp, x, dy, core="unfused")
    got, layer = _step(xp, x, dy)
    assert layer.cores == ["fused"]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("xp", CUDA)
def test_a_row_lowered_at_every_key_equals_the_unfused_core(xp):
    """As tests/test_core_choice.py's test for the bare core: a query row that an additive mask
    lowers at every key by 1e9 (``log l`` kept in ``lse_lo``)."""
    x, dy = _data(8)
    add = np.zeros((24, 24), np.float32)
    add[5] = -1e9  # the layer is causal: row 5 sees keys 0 to 5, each lowered
    want, _ = _step(xp, x, dy, core="unfused", attn_mask=xp.asarray(add))
    got, layer = _step(xp, x, dy, attn_mask=xp.asarray(add))
    assert layer.cores == ["fused"] and not layer.events
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("xp", CUDA)
def test_a_float_key_padding_mask_equals_its_folded_mask(xp):
    """A float key padding mask ``key_add`` ``(batch, seq_k)`` reaches the CUDA kernels as it is
    (no ``(batch * heads, L, S)`` array) and gives bit for bit the pass of the float64 mask
    folded from it and ``attn_mask``; the unfused core, which folds it itself, agrees."""
    x, dy = _data(9)
    rng = np.random.default_rng(9)
    add = rng.standard_normal((24, 24))
    keys = rng.standard_normal((2, 24))
    keys[1, 3:7] = -np.inf
    fold = np.repeat(add[None] + keys[:, None, :], 2, axis=0)  # (batch * heads, L, S)
    got, layer = _step(xp, x, dy, attn_mask=xp.asarray(add), key_add=xp.asarray(keys))
    assert layer.cores == ["fused"] and not layer.events
    _equal(got, _step(xp, x, dy, attn_mask=xp.asarray(fold))[0])
    unfused, _ = _step(xp, x, dy, core="unfused", attn_mask=xp.asarray(add),
                       key_add=xp.asarray(keys))
    for g, w in zip(got, unfused):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("xp", CUDA)
def test_a_per_key_mask_overflowing_with_attn_mask_is_refused_at_the_settle(xp):
    x, _ = _data(10)
    big = np.full((24, 24), 0.75 * float(np.finfo(np.float32).max))
    layer = MultiHeadAttention(16, 2, xp=xp, core="fused")
    with pytest.raises(ValueError, match="largest"):
        layer.forward(xp.asarray(x), attn_mask=xp.asarray(big), key_add=xp.asarray(big[:2]))
