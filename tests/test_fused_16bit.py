"""The fused attention core on float16 and bfloat16 data (attention/fused.py: tiles in float32,
results rounded to the data's dtype) and its final checks (attention/fused_final.py)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from abftgemm.checksums import smallest_normal, unit_roundoff
from abftgemm.faults import Fault
from attention.context import Context
from attention.core import core_backward, core_forward
from attention.fused import fused_backward, fused_forward
from attention.fused_final import FINAL_SITES, verify_grads, verify_output
from test_fused import HOOK_SITES, _data, _reference, _run, assert_corrected

HALF = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def _probs(q, k, scale, causal):
    s = scale * q.astype(np.float64) @ k.astype(np.float64).transpose(0, 2, 1)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[1:], bool)), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _tolerances(q, k, v, do, causal):
    """The float64 results and their tolerances for 16-bit data: the float32 tiles' (test_fused)
    plus the roundings to the data's dtype: of each result (1.01 u |x|, and u times the smallest
    normal number for subnormal results) and of the stored O that
    ``D = rowsum(dO O)`` reads (u times ``P (|dO| |O|) 1`` through dS into dQ and dK)."""
    scale = 1 / math.sqrt(q.shape[2])
    want, tol = _reference(q, k, v, do, scale, causal)
    u = unit_roundoff(q.dtype)
    p = _probs(q, k, scale, causal)
    dd = (np.abs(do.astype(np.float64)) * np.abs(want[0])).sum(-1, keepdims=True)
    ds = p * dd * 1.01 * u
    extra = (0.0, scale * ds @ np.abs(k.astype(np.float64)),
             scale * ds.transpose(0, 2, 1) @ np.abs(q.astype(np.float64)), 0.0)
    tiny = u * smallest_normal(q.dtype)
    ours = [t + 1.01 * u * np.abs(w) + tiny + 2 * e for t, w, e in zip(tol, want, extra)]
    # the unfused core rounds S, P, dP, dS and every product to the 16-bit dtype: the same
    # rounding model with the 16-bit unit roundoff
    return want, ours, [t * (u / unit_roundoff(np.float32)) + tiny for t in tol]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_matches_float64_reference_and_the_unfused_core(dtype, causal):
    q, k, v, do = _data(np.random.default_rng(11), 2, 100, 100, 32, dtype)
    ctx = Context()
    got = _run(q, k, v, do, ctx, causal=causal)
    assert not ctx.report.events, ctx.report.summary()
    assert {"fused:out", "fused:dV_out", "fused:dK_out"} <= set(ctx.report.checked)
    assert all(g.dtype == dtype for g in got)
    want, tol, theirs = _tolerances(q, k, v, do, causal)
    for name, g, w, t in zip(("out", "dq", "dk", "dv"), got, want, tol):
        err = np.abs(g.astype(np.float64) - w)
        assert np.all(err <= t), (name, np.max(err / t))
    uctx = Context()
    out, saved = core_forward(q, k, v, uctx, causal=causal, core="unfused")
    unfused = (out,) + core_backward(saved, do, uctx)
    assert not uctx.report.events
    for name, g, f, t, t2 in zip(("out", "dq", "dk", "dv"), got, unfused, tol, theirs):
        assert np.all(np.abs(g.astype(np.float64) - f.astype(np.float64)) <= t + t2), name


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_core_runs_the_fused_core_on_16bit_data(dtype):
    q, k, v, do = _data(np.random.default_rng(12), 2, 70, 70, 16, dtype)
    out, saved = core_forward(q, k, v, Context())
    assert saved["core"] == "fused" and out.dtype == dtype


@pytest.mark.parametrize("site", HOOK_SITES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_fault_in_16bit_data_is_detected_and_corrected(dtype, site):
    q, k, v, do = _data(np.random.default_rng(13), 2, 130, 130, 32, dtype)
    assert_corrected(q, k, v, do, Fault("additive", "element", seed=3, sites=site,
                                        magnitude=100.0), site)


@pytest.mark.parametrize("site", ["fused:out", "fused:dV_out", "fused:dK_out"])
def test_final_check_sees_what_the_kernels_cannot(site):
    """A fault after the kernels returned: their checks pass (no event at a kernel site), the
    final check finds it; in detect mode it is reported and left in place (an ``O`` left wrong
    feeds the backward's ``D``, which ``fused:dK_out`` then flags too)."""
    q, k, v, do = _data(np.random.default_rng(14), 2, 100, 100, 16, np.float16)
    clean = _run(q, k, v, do, Context())
    ctx = Context(check="detect", fault_hook=Fault("additive", "element", seed=1, sites=site,
                                                   magnitude=1.0))
    with pytest.warns(Warning, match=site):
        got = _run(q, k, v, do, ctx)
    sites = [e.site for e in ctx.report.events]
    assert sites[0] == site and set(sites) <= set(FINAL_SITES), sites
    assert any(not np.array_equal(g, c) for g, c in zip(got, clean))


def test_persistent_fault_after_the_kernel_raises():
    from abftgemm import UncorrectableError
    q, k, v, _ = _data(np.random.default_rng(15), 1, 64, 64, 16, np.float32)
    ctx = Context(fault_hook=Fault("additive", "element", seed=0, sites="fused:out",
                                   magnitude=10.0, times=None))
    with pytest.raises(UncorrectableError, match="fused:out"):
        verify_output(*fused_forward(q, k, v, ctx), ctx)


def test_final_checks_off():
    q, k, v, do = _data(np.random.default_rng(16), 1, 64, 64, 16, np.float16)
    ctx = Context(check="off")
    out, saved = verify_output(*fused_forward(q, k, v, ctx), ctx)
    verify_grads(saved, do, fused_backward(saved, do, ctx), ctx)
    assert not ctx.report.checked
