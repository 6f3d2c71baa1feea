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
        def wrapped(trainer, name, *args, **kwargs):
            run[0] = name
            return function(trainer, name, *args, **kwargs)
        return wrapped

    def checkpointed(*args, **kwargs):
        run[0] = "checkpoint"
        return run_checkpointed(*args, **kwargs)

    run_checkpointed = train._run_checkpointed
    monkeypatch.setattr(type(backend.get_backend(np)), "gemm", counting_gemm)
    monkeypatch.setattr(train, "_run_plain", named(train._run_plain))
    monkeypatch.setattr(train, "_run_checkpointed", checkpointed)
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
