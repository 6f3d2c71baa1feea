"""``abft train --model`` and ``abft campaign --model`` on tiny transformers models of the four
families: the same four training runs and the fault-propagation campaign, with numbers that add
up."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from attention.experiments.cli import main  # noqa: E402
from attention.experiments.hf_campaign import first_layer_sites  # noqa: E402

TINY = ["--seq", "8", "--d-model", "16", "--heads", "2", "--batch", "2"]


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_train_a_transformers_model_under_faults(family: str, tmp_path: Path) -> None:
    status = main(["train", "--backend", "numpy", "--model", family, "--out", str(tmp_path),
                   "--no-progress", "--steps", "10", "--fault-rate", "0.5",
                   "--checkpoint-every", "3", "--layers", "1", "--d-ff", "16", *TINY])
    assert status == 0
    summary = json.loads((tmp_path / "train.json").read_text())
    assert summary["config"]["model"] == family
    protected = summary["runs"]["protected"]
    assert all(isinstance(v, float) and math.isfinite(v) for v in protected["losses"])
    assert protected["faults_injected"] == len(summary["schedule"]) > 0
    assert protected["detected"] == protected["faults_injected"]
    assert all(":" in f["site"] for f in summary["schedule"])  # full names of protected products
    # repaired at the source: the loss curve is the fault-free one up to the rounding of rebuilt
    # elements carried through later steps (2 ulps of the largest loss per step)
    fault_free = summary["runs"]["fault_free"]["losses"]
    ulp = float(np.spacing(np.float32(max(fault_free))))
    assert protected["max_abs_loss_diff"] <= 2 * len(fault_free) * ulp
    assert (tmp_path / "checkpoints" / "checkpoint.pt").exists()


@pytest.mark.parametrize("family", ["roberta", "gpt-neo"])
def test_propagation_campaign_of_a_transformers_model(family: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["campaign", "--backend", "numpy", "--model", family, "--out", str(tmp_path),
                   "--no-progress", "--trials", "1", "--steps", "3", "--layers", "1",
                   "--kinds", "nan", *TINY])
    assert status == 0
    assert f"campaign: {family} (1 layers), PyTorch on cpu," in capsys.readouterr().out
    result = json.loads((tmp_path / "campaign.json").read_text())
    records = result["records"]
    # every protected product of the layer (forward and backward), each kind, both modes
    sites = {r["site"] for r in records}
    assert sites == set(result["sites"]) and len(sites) >= 8
    assert len(records) == len(sites) * 2
    for r in records:
        assert r["fired"], r
        if r["protected"]:
            assert r["detected"] >= 1 and r["non_trainable_at"] is None, r
            assert r["max_abs_loss_diff"] == 0.0 or r["max_abs_loss_diff"] < 1e-5, r
        else:
            assert r["detected"] == 0
    # unprotected, INF/NaN in the scores makes a causal LM's loss non-finite in that very step
    # (every position is predicted); a masked LM's only where the row is a predicted position,
    # else its gradients, and so the next step's loss (RoBERTa: measured 1 step later)
    forward = [r for r in records if not r["protected"] and r["site"].endswith(":scores")]
    assert forward and all(r["steps_to_non_trainable"] in ((0,) if family == "gpt-neo" else (0, 1))
                           for r in forward)
    assert "became non-trainable" in (tmp_path / "campaign.md").read_text()


def test_propagation_campaign_says_what_was_run(tmp_path: Path) -> None:
    """campaign.md and campaign.json of a --model campaign held the tables and records alone:
    nothing said which sizes, steps, trials or seed, nor when, on what machine and from which
    commit it ran (the layer's campaign.md and train.md/train.json do)."""
    status = main(["campaign", "--backend", "numpy", "--model", "gpt2", "--out", str(tmp_path),
                   "--no-progress", "--trials", "1", "--steps", "3", "--layers", "1",
                   "--kinds", "nan", "--seed", "3", *TINY])
    assert status == 0
    text = (tmp_path / "campaign.md").read_text()
    for part in ("steps=3", "trials=1", "layers=1", "seq=8", "d_model=16", "seed=3",
                 "PyTorch on cpu", " UTC on machine ", ", commit "):
        assert part in text, part
    result = json.loads((tmp_path / "campaign.json").read_text())
    assert {"date", "commit", "machine"} <= set(result["provenance"])
    assert result["config"]["steps"] == 3 and result["config"]["kinds"] == ["nan"]
    assert result["device"] == "cpu"


def test_propagation_campaign_with_a_seq_past_its_corpus(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The campaign's corpus has CORPUS_CHARS characters: a --seq within 2 of it (20000 and
    more) ended in a traceback, "ValueError: --corpus-chars must be at least ...", a flag
    abft campaign does not have. The corpus now grows to fit."""
    from attention.experiments import hf_campaign

    monkeypatch.setattr(hf_campaign, "CORPUS_CHARS", 9)
    status = main(["campaign", "--backend", "numpy", "--model", "gpt2", "--out", str(tmp_path),
                   "--no-progress", "--trials", "1", "--steps", "3", "--layers", "1",
                   "--kinds", "nan", *TINY])
    assert status == 0
    records = json.loads((tmp_path / "campaign.json").read_text())["records"]
    assert records and all(r["fired"] for r in records)


@pytest.mark.parametrize("command", ["train", "campaign"])
def test_a_model_past_memory_one_line_exit_2(command: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """PyTorch reports an allocation it cannot make as a RuntimeError ("DefaultCPUAllocator:
    can't allocate memory"), not a MemoryError: a --model too large for the machine ended in
    that traceback instead of abft's one line (as NumPy's MemoryError gets)."""
    code = main([command, "--backend", "numpy", "--model", "gpt2", "--out", str(tmp_path),
                 "--no-progress", "--d-model", str(10 ** 9), "--heads", "2", "--seq", "4",
                 "--batch", "1", "--layers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"abft {command}: error: not enough memory for these sizes"), err


def test_first_layer_sites():
    names = ["m.h.0.attn:scores", "m.h.1.attn:scores", "m.h.10.attn:d_q", "m.h.0.attn.c:fwd"]
    assert first_layer_sites(names) == ["m.h.0.attn:scores", "m.h.0.attn.c:fwd"]


@pytest.mark.parametrize("flags", [["train", "--model", "gpt3"],
                                   ["train", "--model", "gpt2", "--dtype", "float64"],
                                   ["campaign", "--model", "gpt2", "--steps", "1"],
                                   # the fault strikes in the last step: a NaN gradient's
                                   # damage is never seen ("0% non-trainable")
                                   ["campaign", "--model", "gpt2", "--steps", "2"],
                                   # past torch.manual_seed's range: a ValueError traceback
                                   ["train", "--model", "gpt2", "--seed", str(2 ** 64)],
                                   ["campaign", "--model", "bert", "--seed", str(2 ** 64)],
                                   # Llama's rotary positions need heads of an even width: a
                                   # RuntimeError traceback from inside the first step
                                   ["train", "--model", "llama", "--d-model", "6", "--heads", "2"],
                                   ["campaign", "--model", "llama", "--d-model", "6", "--heads",
                                    "2"]])
def test_bad_model_flags_exit_2(flags: list[str], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([flags[0], "--backend", "numpy", "--out", str(tmp_path / "o"),
                               *flags[1:]]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and len(err.strip().splitlines()) == 1, err
