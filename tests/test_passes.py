"""The attention pass as data (attention.passes): the printed table is what a pass runs."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from abftgemm.backend import to_host
from attention import (BACKWARD, FORWARD, PARAM_KEYS, CheckingPlan, Context, MultiHeadAttention,
                       Variant, attention_backward, attention_forward)
from attention.core import core_backward, core_forward
from attention.passes import (BACKWARD_INPUTS, BACKWARD_OUTPUTS, CORE_BACKWARD, CORE_FORWARD,
                              FORWARD_INPUTS, FORWARD_OUTPUT, Step, carried, checksums, describe,
                              steps, with_core)
from attention.plan import VARIANTS, plan_markdown, table_rows
from conftest import BACKENDS

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ("wq", "wk", "wv", "wo")
CASES = {"self": Variant(), "cross": Variant(cross=True), "causal": Variant(causal=True),
         "dropout": Variant(dropout=True), "W layout": Variant(w_layout=True),
         "cross, causal, dropout, W layout": Variant(True, True, True, True),
         "fused": Variant(fused=True), "fused, causal": Variant(causal=True, fused=True),
         "fused, cross, W layout": Variant(cross=True, w_layout=True, fused=True)}


def _step(xp, variant, w_layout_buffers=True, seed=0):
    """One forward and backward of a small float64 layer in ``variant``; returns the trace of
    both passes, the output and the gradients."""
    layer = MultiHeadAttention(8, 2, causal=variant.causal, dtype="float64", xp=xp, seed=seed)
    rng = np.random.default_rng(seed + 1)
    x, key, dy = (xp.asarray(rng.standard_normal((2, n, 8))) for n in (5, 6, 5))
    kv = {"key": key, "value": key * 0.5} if variant.cross else {}
    keep = rng.random((4, 5, 6 if variant.cross else 5)) >= 0.3
    drop = {"dropout": 0.3, "dropout_keep": xp.asarray(keep)}
    grads = {}
    if variant.w_layout and w_layout_buffers:  # PyTorch's gradient buffers, W = w^T
        grads = {k: xp.empty(layer.params[k].shape[::-1]).T for k in WEIGHTS}
    ctx = Context(trace=[])
    y, saved = attention_forward(layer.params, x, ctx, n_heads=2, causal=variant.causal,
                                 **(drop if variant.dropout else {}), **kv,
                                 core="fused" if variant.fused else "unfused")
    dx, g = attention_backward(saved, dy, ctx, grads_out=grads)
    assert not ctx.report.detected, ctx.report.summary()
    return ctx.trace, y, dx, g


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_the_printed_table_is_what_a_pass_runs(xp, case):
    """Every step the executor ran, and what it took or made of the encodings (recorded as it
    ran, from the arrays it had), is the plan's table row for row."""
    variant = CASES[case]
    if xp is not np:
        if variant.fused:
            pytest.skip("the fused core between the projections runs on NumPy arrays")
        variant = Variant(variant.cross, variant.causal, variant.dropout, variant.w_layout,
                          gpu=True)
    trace, *_ = _step(xp, variant)
    ran = [(s, describe(s, taken)) for s, taken in trace]
    assert ran == [(s, d) for _, s, d in table_rows(variant)]
    printed = CheckingPlan().table(variant).splitlines()[2:]
    assert len(printed) == len(trace)
    for line, (s, d) in zip(printed, ran):
        assert f"`{s.computes()}` | {d} |" in line


@pytest.mark.parametrize("xp", BACKENDS)
def test_w_layout_writes_the_same_gradients_and_encodes_its_own_operand(xp):
    """PyTorch's buffers (the transposes of C-contiguous arrays) get the gradients of the x @ w
    layout; their four products are written transposed and encode their own a (dY^T, dQ^T, dK^T,
    dV^T) instead of taking X^T's encoding, as the table says."""
    _, y, dx, g = _step(xp, Variant())
    trace, y_w, dx_w, g_w = _step(xp, Variant(w_layout=True))
    assert np.array_equal(to_host(y), to_host(y_w))
    assert np.allclose(to_host(dx), to_host(dx_w), rtol=1e-13, atol=1e-13)
    for k in PARAM_KEYS:
        assert np.allclose(to_host(g[k]), to_host(g_w[k]), rtol=1e-13, atol=1e-13), k
        if k in WEIGHTS:
            assert g_w[k].T.flags.c_contiguous, k
    weight_steps = {s.site: (s.transposed, t) for s, t in trace if s.weight}
    assert weight_steps == {f"d_{k}": (True, None) for k in WEIGHTS}
    rows = {s.site: d for _, s, d in table_rows(Variant(w_layout=True)) if s.weight}
    assert all(d.startswith("encoded: written transposed") for d in rows.values())


@pytest.mark.parametrize("xp", BACKENDS)
def test_weight_gradients_in_two_layouts_are_refused(xp):
    layer = MultiHeadAttention(8, 2, dtype="float64", xp=xp)
    x = xp.asarray(np.random.default_rng(0).standard_normal((1, 3, 8)))
    _, saved = attention_forward(layer.params, x, Context(), n_heads=2)
    grads = {"wq": xp.zeros((8, 8)).T, "wk": xp.zeros((8, 8))}
    with pytest.raises(ValueError, match="one layout"):
        attention_backward(saved, x, Context(), grads_out=grads)
    assert not to_host(grads["wq"]).any() and not to_host(grads["wk"]).any()


@pytest.mark.parametrize("xp", BACKENDS)
def test_the_core_runs_the_core_steps_of_the_layer(xp):
    """attention.core runs CORE_FORWARD and CORE_BACKWARD, the contiguous part of the layer's
    tables between the head split and merge, with the same executor."""
    for core, table in ((CORE_FORWARD, FORWARD), (CORE_BACKWARD, BACKWARD)):
        one = (Step("fused", "out", ("qh",)),)
        assert with_core(table, core, one) == table[:table.index(core[0])] + one + \
            table[table.index(core[-1]) + 1:]
        assert len(with_core(table, core, one)) == len(table) - len(core) + 1
    with pytest.raises(ValueError):
        with_core(FORWARD, CORE_FORWARD[::-1], ())
    rng = np.random.default_rng(0)
    q, k, v, d_out = (xp.asarray(rng.standard_normal((4, 6, 4))) for _ in range(4))
    ctx = Context(trace=[])
    _, saved = core_forward(q, k, v, ctx, core="unfused")
    core_backward(saved, d_out, ctx)
    gpu = xp is not np
    variant = Variant(gpu=gpu)
    cf, cb = steps(CORE_FORWARD, variant), steps(CORE_BACKWARD, variant)
    given = carried(cf, cb, gpu)[1]
    assert ctx.trace == [*zip(cf, checksums(cf, gpu)), *zip(cb, checksums(cb, gpu, given))]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_name_a_step_reads_is_bound_or_made_before(name):
    variant = VARIANTS[name]
    fwd, bwd = steps(FORWARD, variant), steps(BACKWARD, variant)
    for table, start, outputs in ((fwd, set(FORWARD_INPUTS), {FORWARD_OUTPUT}),
                                  (bwd, set(BACKWARD_INPUTS) | carried(fwd, bwd)[0],
                                   set(BACKWARD_OUTPUTS[:3 if variant.cross else 1]))):
        have = set(start)
        for s in table:
            for n in (*s.ins, s.bias):
                assert n is None or n.removesuffix("^T") in have, (s, n)
            have.add(s.out)
        assert outputs <= have - set(start), outputs - have


def test_docs_table_is_the_generated_one():
    """docs/checking_plan.md shows plan_markdown() (python scripts/checking_plan_table.py
    writes it there)."""
    doc = (ROOT / "docs" / "checking_plan.md").read_text(encoding="utf-8")
    shown = re.search(r"<!-- BEGIN checking plan table -->\n(.*?)\n<!-- END checking plan table",
                      doc, re.DOTALL).group(1)
    assert shown == plan_markdown()


@pytest.mark.parametrize("core", ["unfused", "auto"])
def test_pytorch_runs_the_w_layout_table(monkeypatch, core):
    """attention.torch hands the backward PyTorch's gradient buffers: the pass it runs is the
    table's W-layout variant, step for step (with the fused core where ``"auto"`` runs it)."""
    torch = pytest.importorskip("torch")
    from attention.torch import MultiheadAttention

    traces = []

    def tracing(*args, **kwargs):
        traces.append([])
        return Context(*args, **kwargs, trace=traces[-1])

    monkeypatch.setattr("attention._torch_state.Context", tracing)
    module = MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64, core=core)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    module(x, x, x, need_weights=False)[0].sum().backward()
    ran = [s for trace in traces for s, _ in trace]
    assert module.last_core == ("fused" if core == "auto" else "unfused")
    variant = Variant(w_layout=True, fused=core == "auto")
    assert ran == [s for _, s, _ in table_rows(variant)]
