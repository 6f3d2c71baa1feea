"""``abft train`` times its four runs with one BLAS thread count: the protected run's products
run at the library's thread policy (abftgemm.threads.blas_scope), the unprotected
``abftgemm.matmul(check="off")`` products at whatever NumPy's BLAS is set to."""
from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")

import abftgemm.backend as backend  # noqa: E402
from abftgemm import threads  # noqa: E402
from attention.experiments import train  # noqa: E402


def test_every_run_sees_the_same_blas_thread_count(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    controller = threadpoolctl.ThreadpoolController()
    blas = controller.select(user_api="blas")
    if not blas.lib_controllers:
        pytest.skip("no BLAS that threadpoolctl controls")
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    run = ["warm-up"]
    gemm = type(backend.get_backend(np)).gemm

    def counting_gemm(self, *args, **kwargs):
        seen[run[0]][blas.lib_controllers[0].num_threads] += 1
        return gemm(self, *args, **kwargs)

    def named(function):
        """``function``'s steps, each counted under its run's name (the runs interleave)."""
        def wrapped(trainer, result, *args, **kwargs):
            steps = function(trainer, result, *args, **kwargs)
            while True:
                run[0] = result.name
                try:
                    new = next(steps)
                except StopIteration:
                    return
                yield new
        return wrapped

    monkeypatch.setattr(type(backend.get_backend(np)), "gemm", counting_gemm)
    monkeypatch.setattr(train, "_plain_steps", named(train._plain_steps))
    monkeypatch.setattr(train, "_checkpointed_steps", named(train._checkpointed_steps))
    # the policy gives the library's products 1 thread (as on a loaded machine), NumPy's BLAS
    # is at 2 (its default on two cores)
    before = threads.get_threads()
    threads.set_threads(1)
    try:
        with threadpoolctl.threadpool_limits(2, user_api="blas"):
            config = train.TrainConfig(steps=3, batch=2, seq=8, d_model=16, n_heads=2,
                                       n_layers=1, d_ff=8, fault_rate=0.5, checkpoint_every=2)
            summary = train.train(config, np, tmp_path, progress=False)
    finally:
        threads.set_threads(before)
    counts = {name: set(c) for name, c in seen.items()}
    assert set(counts) >= {"fault_free", "protected", "checkpoint"}
    assert all(c == {1} for c in counts.values()), counts
    assert summary["blas_threads"] == 1


def test_train_md_says_what_was_run(tmp_path: Path) -> None:
    """train.md names the settings, the machine, the date and the commit it was made with
    (it held the table alone: nothing said how many steps, which fault rate or seed)."""
    from attention.experiments.cli import main

    assert main(["train", "--backend", "numpy", "--out", str(tmp_path), "--no-progress",
                 "--steps", "3", "--fault-rate", "0.5", "--batch", "2", "--seq", "8",
                 "--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "8",
                 "--seed", "7"]) == 0
    text = (tmp_path / "train.md").read_text()
    for part in ("steps=3", "fault_rate=0.5", "seed=7", "backend numpy", "commit ", "machine "):
        assert part in text, part
    summary = __import__("json").loads((tmp_path / "train.json").read_text())
    assert {"date", "commit", "machine"} <= set(summary["provenance"])


def test_the_runs_take_turns_step_by_step(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The four runs interleave their steps, so that other load on the machine reaches each run
    alike (run one after another, the protection overhead of a few-second run swung between
    -7% and +16%); each run's time is its own steps' time."""
    order: list[tuple[str, int]] = []
    grads = train._Trainer.grads

    def logged(self, step, check, fault, result):
        order.append((result.name, step))
        return grads(self, step, check, fault, result)

    monkeypatch.setattr(train._Trainer, "grads", logged)
    config = train.TrainConfig(steps=3, batch=2, seq=8, d_model=16, n_heads=2, n_layers=1,
                               d_ff=8, fault_rate=0.0, checkpoint_every=2)
    summary = train.train(config, np, tmp_path, progress=False)
    runs = ["fault_free", "unprotected", "protected", "checkpoint"]
    timed = [entry for entry in order if entry[0] != "warm-up"]
    assert timed == [(name, step) for step in range(3) for name in runs]
    assert all(0 < summary["runs"][name]["seconds"] for name in runs)
    assert summary["runs"]["protected"]["losses"] == summary["runs"]["fault_free"]["losses"]


def test_a_fault_in_the_last_backward_is_not_called_trained(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A NaN in the last step's weight gradient shows in no loss, but leaves the unprotected
    run's weights NaN: that run is non-trainable at ``steps`` (it was reported "trained"), the
    protected one trained."""
    config = train.TrainConfig(steps=2, batch=2, seq=8, d_model=16, n_heads=2, n_layers=1,
                               d_ff=8, fault_rate=0.0, checkpoint_every=1)

    def schedule(config, sites=train.FAULT_SITES, layers=None):
        return {1: train.ScheduledFault(step=1, kind="nan", site="d_wq", layer=0, seed=3)}

    monkeypatch.setattr(train, "fault_schedule", schedule)
    runs = train.train(config, np, tmp_path, progress=False)["runs"]
    assert runs["unprotected"]["faults_injected"] == 1
    assert runs["unprotected"]["non_trainable_at"] == 2
    assert runs["protected"]["non_trainable_at"] is None
    assert runs["fault_free"]["non_trainable_at"] is None
