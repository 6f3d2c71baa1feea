"""The GPT model's manual backward against central finite differences (float64, tiny sizes)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from abftgemm.faults import Fault
from conftest import BACKENDS
from finite_differences import central_differences
from attention.experiments.model import (GPT, MLP_SITES, Block, Gemm, GPTConfig,
                                         cross_entropy_backward, cross_entropy_forward,
                                         gelu_backward, gelu_forward, layer_norm_backward,
                                         layer_norm_forward, linear_backward, linear_forward)

CONFIG = GPTConfig(vocab=7, seq_len=5, d_model=8, n_heads=2, n_layers=2, d_ff=12, dtype="float64")


def _numeric(f: Callable[[], float], arr: np.ndarray, count: int = 6, seed: int = 0,
             h: float = 1e-6) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Central differences of ``f`` at ``count`` random entries of ``arr``."""
    rng = np.random.default_rng(seed)
    indices = [tuple(int(rng.integers(s)) for s in arr.shape) for _ in range(count)]
    return indices, central_differences(f, arr, indices, h)


def _assert_grad(f: Callable[[], float], arr: np.ndarray, grad: np.ndarray, **kw: Any) -> None:
    indices, numeric = _numeric(f, arr, **kw)
    analytic = np.array([grad[ix] for ix in indices])
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_layer_norm() -> None:
    rng = np.random.default_rng(1)
    x, g, b = rng.standard_normal((3, 4, 6)), rng.standard_normal(6), rng.standard_normal(6)
    r = rng.standard_normal((3, 4, 6))

    def loss() -> float:
        return float((layer_norm_forward(x, g, b)[0] * r).sum())

    dx, dg, db = layer_norm_backward(r, layer_norm_forward(x, g, b)[1])
    for arr, grad in ((x, dx), (g, dg), (b, db)):
        _assert_grad(loss, arr, grad)


def test_gelu() -> None:
    rng = np.random.default_rng(2)
    x, r = 2 * rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    dx = gelu_backward(r, gelu_forward(x)[1])
    _assert_grad(lambda: float((gelu_forward(x)[0] * r).sum()), x, dx)


def test_cross_entropy() -> None:
    rng = np.random.default_rng(3)
    logits, targets = rng.standard_normal((2, 3, 5)), rng.integers(5, size=(2, 3))
    d = cross_entropy_backward(cross_entropy_forward(logits, targets)[1])
    _assert_grad(lambda: cross_entropy_forward(logits, targets)[0], logits, d)
    loss = cross_entropy_forward(logits, targets)[0]
    flat = logits.reshape(-1, 5)
    expected = np.mean(np.log(np.exp(flat).sum(1)) - flat[np.arange(6), targets.ravel()])
    assert loss == pytest.approx(expected)


def test_linear() -> None:
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    r = rng.standard_normal((2, 3, 5))
    gemm = Gemm("correct")

    def loss() -> float:
        return float((linear_forward(x, w, b, "lin", gemm) * r).sum())

    dx, dw, db = linear_backward(r, x, w, "lin", gemm)
    for arr, grad in ((x, dx), (w, dw), (b, db)):
        _assert_grad(loss, arr, grad)
    assert {"lin", "d_lin_w", "d_lin_x"} <= set(gemm.report.checked)


def test_block() -> None:
    block = Block(CONFIG, np, seed=5)
    rng = np.random.default_rng(5)
    x, r = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))

    def loss() -> float:
        return float((block.forward(x, Gemm("correct"))[0] * r).sum())

    dx, grads = block.backward(r, block.forward(x, Gemm("correct"))[1], Gemm("correct"))
    _assert_grad(loss, x, dx)
    params = block.parameters()
    assert set(grads) == set(params)
    for name, arr in params.items():
        _assert_grad(loss, arr, grads[name], count=3)


def _batch(seed: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(CONFIG.vocab, size=(2, CONFIG.seq_len + 1))
    return tokens[:, :-1], tokens[:, 1:]


def test_gpt_gradients() -> None:
    model = GPT(CONFIG, np, seed=7)
    tokens, targets = _batch()
    loss, grads, _ = model.loss_and_grads(tokens, targets)
    params = model.parameters()
    assert set(grads) == set(params)
    assert np.isfinite(loss)
    for name, arr in params.items():
        _assert_grad(lambda: model.loss_and_grads(tokens, targets)[0], arr, grads[name], count=2)


def test_gpt_fault_is_corrected_or_breaks_training() -> None:
    model = GPT(CONFIG, np, seed=8)
    tokens, targets = _batch(8)
    clean, clean_grads, _ = model.loss_and_grads(tokens, targets, check="off")
    for site in ("q_proj", "mlp_up", "d_mlp_down_x", "d_wv"):
        fault = Fault("nan", "element", seed=1, sites=site)
        loss, grads, report = model.loss_and_grads(tokens, targets, check="correct",
                                                   fault_hook=fault, fault_layer=1)
        assert fault.injected and report.detected and site in report.sites
        assert loss == pytest.approx(clean, rel=1e-12)
        for name, g in grads.items():
            np.testing.assert_allclose(g, clean_grads[name], rtol=1e-9, atol=1e-12)
        off = Fault("nan", "element", seed=1, sites=site)
        _, grads, report = model.loss_and_grads(tokens, targets, check="off", fault_hook=off,
                                                fault_layer=1)
        assert off.injected and not report.detected
        assert not all(np.isfinite(g).all() for g in grads.values())


def test_fault_layer_targets_one_block() -> None:
    model = GPT(CONFIG, np, seed=9)
    tokens, targets = _batch(9)
    fault = Fault("inf", "element", seed=0, sites="mlp_up", times=None)
    model.loss_and_grads(tokens, targets, fault_hook=fault, fault_layer=0)
    assert len(fault.injected) == 1


@pytest.mark.parametrize("xp", BACKENDS)
def test_no_plan_is_made_after_the_first_training_step(xp) -> None:
    """issue 27: the plan cache was keyed by site name and held 8 plans, and the demo GPT's own
    GEMMs run 9 sites a step, so every plan was rebuilt every step. Its plans are now the
    model's, one per distinct product; the attention layers keep theirs per site."""
    model = GPT(CONFIG, xp, seed=3)
    tokens, targets = (xp.asarray(t) for t in _batch())
    counters = [model.plans.counters] + [block.attn.counters for block in model.blocks]
    made = []
    for _ in range(3):
        model.loss_and_grads(tokens, targets)
        made.append([c.plans for c in counters])
    assert all(made[0]) and made[1] == made[2] == made[0], made
    # one plan per distinct product: 2 blocks run each MLP site, 15 products on 9 plans
    assert made[0][0] == len(MLP_SITES) + 3, made


def test_training_warm_up_runs_each_scheduled_fault_kind_in_both_modes(tmp_path, monkeypatch):
    """``abft train`` timed its runs after one clean warm-up step per mode: the paths a fault
    takes compiled inside the timed runs, and a cold numba cache (a fresh clone) made a
    protected run of 0.3 s take 20. The warm-up also runs each (kind, site) of the schedule,
    unprotected and protected."""
    from attention.experiments import train as train_module

    seen = []
    grads = train_module._Trainer.grads

    def spy(self, step, check, fault, result):
        if result.name == "warm-up":
            seen.append((check, None if fault is None else (fault.kind, fault.site)))
        return grads(self, step, check, fault, result)

    monkeypatch.setattr(train_module._Trainer, "grads", spy)
    config = train_module.TrainConfig(steps=12, batch=2, seq=8, d_model=16, n_heads=2,
                                      n_layers=1, d_ff=16, fault_rate=0.5, checkpoint_every=4,
                                      corpus_chars=200)
    summary = train_module.train(config, np, tmp_path, progress=False)
    kinds = {(f["kind"], f["site"]) for f in summary["schedule"]}
    assert kinds
    for check in ("off", "correct"):
        assert {f for c, f in seen if c == check} == kinds | {None}
