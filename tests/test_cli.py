"""The ``abft`` command line on tiny runs: exit status, output files, numbers that add up."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attention.experiments import cli
from attention.experiments.campaign import COUNTS, DEFAULT_SITES, KINDS, OUTCOMES, CampaignConfig
from attention.experiments.cli import main
from abftgemm.faults import PATTERNS
from conftest import GPU

EXTREME = ("inf", "nan", "bitflip-exp")
TINY_LAYER = ["--seq", "8", "--d-model", "16", "--heads", "2"]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("campaign")
    status = main(["campaign", "--backend", "numpy", "--out", str(out), "--no-progress",
                   "--trials", "2", "--clean-trials", "3", *TINY_LAYER, "--gemm", "8", "12", "8",
                   "--sites", "q_proj", "scores", "softmax", "d_k", "gemm",
                   "--kinds", *EXTREME, "additive", "--patterns", "element", "row", "tile"])
    assert status == 0
    return out, json.loads((out / "campaign.json").read_text())["records"]


def test_campaign_writes_its_files(campaign: tuple[Path, list[dict]]) -> None:
    out, _ = campaign
    for name in ("campaign.json", "campaign.md", "coverage.png", "propagation.png"):
        assert (out / name).stat().st_size > 0
    text = (out / "campaign.md").read_text()
    assert "| fault in | AS | AP | CL | O |" in text
    # every outcome and stage the tables use is defined
    for term in ("**detected**", "**silent corruption**", "**silent, within bound**",
                 "**masked**", "**miscorrected**", "**false positives**", "**AS** attention scores",
                 "**AP** attention probabilities", "**CL** context", "**O** output"):
        assert term in " ".join(text.split()), term


def test_campaign_json_says_what_ran(campaign: tuple[Path, list[dict]]) -> None:
    """campaign.json holds the settings, the backend and the provenance beside the records
    (it was the bare list of records)."""
    out, records = campaign
    result = json.loads((out / "campaign.json").read_text())
    assert (result["model"], result["backend"]) == ("layer", "numpy")
    assert result["config"]["trials"] == 2 and result["config"]["sites"] == [
        "q_proj", "scores", "softmax", "d_k", "gemm"]
    assert set(result["provenance"]) == {"date", "commit", "machine"}
    assert result["records"] == records and records


def test_campaign_records(campaign: tuple[Path, list[dict]]) -> None:
    _, records = campaign
    fields = {"site", "kind", "pattern", "protected", "trials", "detected", "corrected",
              "recomputed", "uncorrectable", "silent", "false_positives", "nonfinite_output"}
    cells = {(r["site"], r["kind"], r["pattern"], r["protected"]) for r in records}
    # 5 sites x 4 kinds x 3 patterns x 2 modes, then the protected clean runs of layer and gemm
    assert len(cells) == len(records) == 5 * 4 * 3 * 2 + 2
    for r in records:
        assert fields | set(COUNTS) <= set(r)
        assert sum(r[k] for k in OUTCOMES) == r["trials"]
        assert r["trials"] == (3 if r["kind"] == "none" else 2)
        if r["kind"] == "none":
            assert r["protected"]  # an unprotected run flags nothing: no false positive to count
        if not r["protected"]:
            assert r["detected"] == r["corrected"] == r["recomputed"] == 0


def test_campaign_protected_numbers(campaign: tuple[Path, list[dict]]) -> None:
    _, records = campaign
    by_cell = {(r["site"], r["kind"], r["pattern"], r["protected"]): r for r in records}
    for r in records:
        if r["kind"] == "none":  # protected clean runs (the records test checks they are)
            assert r["false_positives"] == 0
            continue
        unprotected = by_cell[r["site"], r["kind"], r["pattern"], False]
        if r["protected"] and unprotected["silent"] == unprotected["trials"]:
            # the fault changes the results: protection must flag every trial
            assert r["detected"] + r["silent"] == r["trials"]
            assert r["silent"] == 0 and r["miscorrected"] == 0
        if not r["protected"] and r["kind"] in ("inf", "nan"):
            assert r["silent"] == r["trials"] and r["nonfinite_output"] == r["trials"]


def test_train(tmp_path: Path) -> None:
    status = main(["train", "--backend", "numpy", "--out", str(tmp_path), "--no-progress",
                   "--steps", "16", "--fault-rate", "0.5", "--checkpoint-every", "4", "--batch",
                   "4", "--layers", "1", "--d-ff", "16", *TINY_LAYER])
    assert status == 0
    summary = json.loads((tmp_path / "train.json").read_text())
    assert set(summary["runs"]) == {"fault_free", "unprotected", "protected", "checkpoint"}
    for run in summary["runs"].values():
        assert {"losses", "seconds", "faults_injected", "detected", "corrected", "recomputed",
                "non_trainable_at", "restores", "replayed_steps", "max_abs_loss_diff",
                "final_loss"} <= set(run)
    protected = summary["runs"]["protected"]
    assert len(protected["losses"]) == 16
    assert all(isinstance(v, float) and math.isfinite(v) for v in protected["losses"])
    assert protected["faults_injected"] == len(summary["schedule"]) > 0
    assert protected["detected"] == protected["faults_injected"]
    # Every fault is repaired where it struck, so the protected run differs from the fault-free
    # one only by the rounding of rebuilt elements (a few ulps of the values they replace) as it
    # carries through later steps.  Measured: 4.8e-7, 2 ulps of a float32 loss in [2, 4), over
    # 16 steps.  Budget: 2 ulps of the largest fault-free loss per step.  An unrepaired fault
    # makes the loss non-finite (these faults are INF, NaN, near-INF or exponent flips) or moves
    # it by orders of magnitude more.
    fault_free = summary["runs"]["fault_free"]["losses"]
    ulp = float(np.spacing(np.float32(max(fault_free))))
    assert protected["max_abs_loss_diff"] <= 2 * len(fault_free) * ulp
    assert {"ratio", "t_fault_free", "t_protected", "t_checkpoint", "save_seconds",
            "load_seconds", "replay_seconds", "replayed_steps"} <= set(summary["overhead"])
    for name in ("train.md", "loss.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_bench_runs_scripts_with_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "gemm.py").write_text(
        "import json, sys\n"
        "args = sys.argv[1:]\n"
        "open(args[args.index('--json') + 1], 'w').write(json.dumps(args))\n")
    monkeypatch.setattr(cli, "BENCH_DIR", bench)
    out = tmp_path / "out"
    assert main(["bench", "--backend", "numpy", "--out", str(out), "--quick"]) == 0
    args = json.loads((out / "gemm.json").read_text())
    assert args[:2] == ["--backend", "numpy"] and "--quick" in args
    assert not (out / "attention.json").exists()


def test_bench_without_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "BENCH_DIR", tmp_path / "missing")
    assert main(["bench", "--backend", "numpy", "--out", str(tmp_path)]) == 1


@pytest.mark.skipif(GPU is not None, reason="a GPU is usable")
def test_cupy_without_gpu_is_an_error(tmp_path: Path) -> None:
    assert main(["train", "--backend", "cupy", "--out", str(tmp_path)]) == 2


def test_module_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "attention", "--help"], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1], check=False)
    assert done.returncode == 0
    for command in ("campaign", "train", "bench", "demo"):
        assert command in done.stdout


BAD_FLAGS = [
    ["campaign", "--sites", "q_prj"],               # a typo once ran and called every trial masked
    ["campaign", "--kinds", "bitflip"],
    ["campaign", "--patterns", "diagonal"],
    ["campaign", "--heads", "3"],                   # does not divide --d-model 32
    ["campaign", "--seq", "1"],
    ["campaign", "--trials", "0"],
    ["campaign", "--trials", "-2"],
    ["campaign", "--gemm", "8", "0", "8"],
    ["campaign", "--additive", "nan"],
    ["train", "--heads", "5"],
    ["train", "--seq", "1"],
    ["train", "--checkpoint-every", "0"],
    ["train", "--fault-rate", "1.5"],
    ["train", "--steps", "0"],
    ["train", "--lr", "-1"],
    ["campaign", "--trials", "two"],
    ["campaign", "--seed", "-1"],                   # a traceback from NumPy's generator
    ["train", "--seed", "-1"],
    ["demo", "--seed", "-5"],
    ["train", "--no-such-flag"],
]


@pytest.mark.parametrize("flags", BAD_FLAGS, ids=[" ".join(f) for f in BAD_FLAGS])
def test_bad_flags_one_line_exit_2(flags: list[str], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([flags[0], "--backend", "numpy", "--out", str(out), *flags[1:]]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("abft") and ": error: " in err
    assert not out.exists()  # refused before anything ran


def test_help_lists_defaults_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["campaign", "--help"])
    assert exit_info.value.code == 0
    flat = " ".join(capsys.readouterr().out.split())
    for name in (*DEFAULT_SITES, *KINDS, *PATTERNS):
        assert name in flat, name
    for default in ("(default: 2)", "(default: 10)", "(default: 32 32 32)", "(default: all)",
                    "(default: float32)"):
        assert default in flat, default


@pytest.mark.parametrize("command", [[], ["campaign"], ["train"], ["bench"], ["demo"]])
def test_help_is_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` prints the docstrings' first lines without their reST markup (it showed
    ":func:`train`" and "``abft train``")."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for markup in ("``", ":func:", ":class:", ":mod:", ":data:"):
        assert markup not in out, (markup, out)


def test_without_matplotlib_plots_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" now fails
    monkeypatch.delitem(sys.modules, "attention.experiments.plots", raising=False)
    status = main(["train", "--backend", "numpy", "--out", str(tmp_path), "--no-progress",
                   "--steps", "2", "--batch", "2", "--layers", "1", "--d-ff", "8", *TINY_LAYER])
    assert status == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "plots skipped" in line]
    assert notes == ['plots skipped: matplotlib is not installed (pip install "abftgemm[plots]")']
    assert (tmp_path / "train.json").exists() and not (tmp_path / "loss.png").exists()


def test_a_previous_runs_figures_do_not_stay_with_this_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Into an --out that held a layer campaign, a fused core's campaign (no propagation) left
    the layer's propagation.png beside its own files, and a run without matplotlib the previous
    coverage.png and loss.png: figures of another run, passing for this one's."""
    quick = ["--backend", "numpy", "--out", str(tmp_path), "--no-progress", "--trials", "1",
             "--clean-trials", "0", *TINY_LAYER, "--kinds", "nan", "--patterns", "element"]
    assert main(["campaign", *quick, "--sites", "gemm"]) == 0
    assert (tmp_path / "propagation.png").exists() and (tmp_path / "coverage.png").exists()
    assert main(["campaign", *quick, "--core", "fused", "--sites", "fused:out"]) == 0
    assert not (tmp_path / "propagation.png").exists() and (tmp_path / "coverage.png").exists()
    train = ["train", "--backend", "numpy", "--out", str(tmp_path), "--no-progress", "--steps",
             "1", "--batch", "2", "--layers", "1", "--d-ff", "8", *TINY_LAYER]
    assert main(train) == 0 and (tmp_path / "loss.png").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" now fails
    monkeypatch.delitem(sys.modules, "attention.experiments.plots", raising=False)
    assert main(train) == 0 and not (tmp_path / "loss.png").exists()
    assert main(["campaign", *quick, "--sites", "gemm"]) == 0
    assert not (tmp_path / "coverage.png").exists()
    assert (tmp_path / "campaign.json").exists() and (tmp_path / "train.json").exists()


@pytest.mark.parametrize("command", ["campaign", "train", "bench", "demo"])
@pytest.mark.parametrize("where", ["file", "below-a-file"])
def test_out_that_cannot_be_a_folder_is_refused_before_any_work(
        command: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    out = blocker if where == "file" else blocker / "sub"

    def no_work(args):
        raise AssertionError("the command ran")
    monkeypatch.setattr(cli, f"_{command}", no_work)
    assert main([command, "--out", str(out), "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out}: a file is in the way" in err
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("command", ["campaign", "train"])
@pytest.mark.parametrize("why", ["name too long", "read-only"])
def test_out_that_cannot_be_made_is_refused_before_any_work(
        command: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """A folder name the file system refuses (longer than its 255 bytes) ended in an OSError
    traceback; a folder it cannot create (a read-only mount: os.access can pass, /proc) was
    created after all the work, which ended in a traceback."""
    import errno

    from attention.experiments import campaign, train

    def no_work(*args, **kwargs):
        raise AssertionError("the command ran")
    monkeypatch.setattr(campaign, "run_campaign", no_work)
    monkeypatch.setattr(train, "train", no_work)
    out = tmp_path / ("x" * 300 if why == "name too long" else "out")
    if why == "read-only":
        def refuse(self, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        monkeypatch.setattr(Path, "mkdir", refuse)
    assert main([command, "--out", str(out), "--backend", "numpy", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"abft {command}: error: --out {out}: " in err, err


@pytest.mark.parametrize("missing", ["transformers", "torch"])
@pytest.mark.parametrize("command", ["campaign", "train"])
def test_a_transformers_model_without_the_hf_extra_says_how_to_get_it(
        command: str, missing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """--model FAMILY without transformers (or PyTorch) ended in a ModuleNotFoundError
    traceback from inside the run, leaving an empty --out behind."""
    monkeypatch.setitem(sys.modules, missing, None)  # "import <missing>" now fails
    out = tmp_path / "out"
    assert main([command, "--backend", "numpy", "--model", "gpt2", "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "abftgemm[hf]"' in err, err
    assert f"abft {command}: error: --model gpt2 needs" in err and missing in err, err
    assert not out.exists()


@pytest.mark.parametrize("command", ["campaign", "train"])
def test_a_transformers_model_on_the_gpu_without_cuda_in_pytorch_is_refused(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """--backend cupy runs a --model family with PyTorch on "cuda": where CuPy sees a GPU but
    PyTorch has no CUDA (a CPU-only build) the run ended in a traceback from inside it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setattr(cli, "gpu_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert main([command, "--backend", "cupy", "--model", "gpt2", "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"abft {command}: error: --model gpt2" in err, err
    assert "--backend numpy" in err and not out.exists()


def test_a_step_non_finite_without_a_fault_ends_the_checkpoint_run(tmp_path: Path) -> None:
    """A learning rate that makes the loss non-finite with no fault: checkpoint/restore replays
    the same step to the same result, and the run ends there (it looped forever), non-trainable;
    the loss differences report NaN, not the finite steps' largest."""
    status = main(["train", "--backend", "numpy", "--out", str(tmp_path), "--no-progress",
                   "--steps", "10", "--fault-rate", "0", "--checkpoint-every", "2", "--lr",
                   "1e30", "--batch", "2", "--layers", "1", "--d-ff", "8", *TINY_LAYER])
    assert status == 0
    runs = json.loads((tmp_path / "train.json").read_text())["runs"]
    assert runs["checkpoint"]["non_trainable_at"] is not None
    assert runs["unprotected"]["non_trainable_at"] is not None
    assert runs["unprotected"]["max_abs_loss_diff"] == "nan"  # JSON's spelling of NaN


def test_a_run_whose_loss_became_non_finite_is_not_trained(tmp_path: Path) -> None:
    """The fault-free and protected runs go on past a non-finite loss (only the unprotected run
    stops), and train.md and train.json called them "trained" with a final loss of NaN."""
    status = main(["train", "--backend", "numpy", "--out", str(tmp_path), "--no-progress",
                   "--steps", "4", "--fault-rate", "0", "--lr", "1e30", "--batch", "2",
                   "--layers", "1", "--d-ff", "8", *TINY_LAYER])
    assert status == 0
    runs = json.loads((tmp_path / "train.json").read_text())["runs"]
    for name in ("fault_free", "protected"):
        losses = runs[name]["losses"]
        first = next(i for i, x in enumerate(losses) if x == "nan")
        assert runs[name]["non_trainable_at"] == first, name
        assert len(losses) == 4 and losses[-1] == "nan"  # the run went on
    table = (tmp_path / "train.md").read_text()
    assert "| trained |" not in table, table


def test_a_value_given_twice_is_one_cell() -> None:
    config = CampaignConfig(sites=("gemm", "gemm"), kinds=("inf", "inf", "nan"),
                            patterns=("element", "element"))
    assert (config.sites, config.kinds, config.patterns) == (("gemm",), ("inf", "nan"),
                                                             ("element",))


def test_kind_minus_inf_is_a_value_not_a_flag() -> None:
    # "-inf" starts with "-" like a flag; the campaign reads it as a fault kind, between others
    args = cli.build_parser().parse_args(["campaign", "--kinds", "inf", "-inf", "nan",
                                          "--trials", "2"])
    assert tuple(args.kinds) == ("inf", "-inf", "nan") and args.trials == 2
    args = cli.build_parser().parse_args(["campaign", "--kinds", "-inf"])
    assert tuple(args.kinds) == ("-inf",)
    with pytest.raises(SystemExit):  # other words with a dash stay flags
        cli.build_parser().parse_args(["campaign", "--kinds", "-nan"])


def test_sizes_past_memory_one_line_exit_2(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A size NumPy cannot allocate ended in a MemoryError traceback, exit 1."""
    code = main(["campaign", "--backend", "numpy", "--out", str(tmp_path / "out"),
                 "--no-progress", "--seq", "100000000000"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("abft campaign: error: not enough memory for these sizes")


@pytest.mark.parametrize("given", [None, "active"])
def test_openmp_threads_sleep_when_idle_unless_the_environment_says_otherwise(
        given: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``abft`` runs NumPy's BLAS pool beside numba's OpenMP pool: with both spinning after
    their work, a demo step took 26-49 ms instead of 4-8 on 2 cores. It makes OpenMP's idle
    threads sleep, unless ``OMP_WAIT_POLICY`` is set."""
    monkeypatch.setenv("OMP_WAIT_POLICY", given or "")  # restored after the test
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY")
    assert main(["train", "--steps", "0", "--out", str(tmp_path / "t")]) == 2  # refused: no work
    assert cli.os.environ["OMP_WAIT_POLICY"] == (given or "passive")
