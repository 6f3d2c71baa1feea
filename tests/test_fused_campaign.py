"""The campaign of the fused attention core (``abft campaign --core fused``) and the conversion of a
toolkit Fault into the CUDA kernels' DeviceFault: every extreme fault at every internal site (and
on NumPy at every final check's site, float16 and bfloat16 data too) is detected and repaired, on
NumPy and on CuPy (cupy-on-cpu without a GPU)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from abftgemm.faults import Fault
from attention.context import Context
from attention.experiments.campaign import CampaignConfig, OUTCOMES, run_campaign
from attention.experiments.cli import main
from attention.dropout_hash import keep_mask
from attention.experiments.fused_campaign import (MASKS, SITES, FusedTestbed, backend_problem,
                                                  exact, masks, site_dtype, sites_of)
from attention.fused import FUSED_SITES
from attention.fused_final import FINAL_SITES
from conftest import BACKENDS
from test_fused_cuda import _fault, _faulted_run, _run
from test_fused import _data

CUDA = [p for p in BACKENDS if p.id != "numpy"]
#: The extreme kinds: INF, NaN, near-INF and the top exponent bit flipped.
EXTREME = ("inf", "-inf", "nan", "near-inf", "bitflip-exp")


def _assert_all_repaired(records: list[dict], trials: int, sites: tuple[str, ...]) -> None:
    """Every protected faulty trial injected, detected at its site and repaired (recomputed, the
    results within the bound); the unprotected ones flag nothing; no clean false positive."""
    assert {r["site"] for r in records if r["kind"] != "none"} == set(sites)
    for r in records:
        assert sum(r[k] for k in OUTCOMES) == r["trials"]
        if r["kind"] == "none":
            assert r["site"] == "fused" and r["false_positives"] == 0, r
            assert r["masked"] == r["trials"]  # protected clean = unprotected clean, bit for bit
            continue
        assert r["trials"] == trials and r["injected"] == trials, r
        if r["protected"]:
            assert r["detected"] == r["detected_at_site"] == r["recomputed"] == trials, r
            assert r["silent"] == r["miscorrected"] == r["uncorrectable"] == 0, r
        else:
            assert r["detected"] == 0


def test_numpy_campaign_repairs_every_extreme_fault_at_every_site():
    """Three query blocks and key tiles of 64 (seq 150): the faults land in any tile, forward or
    backward, or in the returned O, dV, dK, at an element, a row or a 4x4 block of it."""
    config = CampaignConfig(trials=1, clean_trials=1, batch=1, seq=150, d_model=32, n_heads=2,
                            kinds=EXTREME, patterns=("element", "row", "tile"), core="fused")
    assert config.sites == SITES == FUSED_SITES + FINAL_SITES
    _assert_all_repaired(run_campaign(config, np, progress=False), 1, SITES)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numpy_campaign_on_16bit_data(dtype):
    """16-bit data on NumPy: the faults at internal sites hit the float32 tiles (their kinds are
    float32's: near-INF is float32's largest number, bit 30 the top exponent bit), those at the
    final sites the returned 16-bit arrays; every one is detected at its site and repaired."""
    assert site_dtype(dtype, "fused:S") == np.float32
    assert site_dtype(dtype, "fused:dK_acc") == np.float32
    assert all(site_dtype(dtype, s).name == dtype for s in FINAL_SITES)
    config = CampaignConfig(trials=1, clean_trials=1, batch=1, seq=70, d_model=16, n_heads=2,
                            kinds=EXTREME, patterns=("element",), core="fused", dtype=dtype)
    records = run_campaign(config, np, progress=False)
    _assert_all_repaired(records, 1, SITES)
    bits = {r["site"]: r["fault"]["bit"] for r in records if r["kind"] == "bitflip-exp"}
    assert bits["fused:S"] == 30 and bits["fused:out"] == 14  # 16-bit: 5 or 8 exponent bits
    # unprotected, the final sites' faults reach the results (the campaign can see them)
    for r in records:
        if r["site"] in FINAL_SITES and not r["protected"] and r["kind"] != "none":
            assert r["silent"] + r["silent_within_bound"] == r["trials"], r


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fault_free_runs_with_masks_and_dropout_are_float64_attention(mask, dropout):
    """The testbed's fault-free run with each mask and dropout equals float64 attention with the
    same mask and keep decisions (``exact``: what the campaign's noise term is measured against),
    and each mask does what MASKS says."""
    shape = (3, 150, 16)
    bench = FusedTestbed("float32", shape, 0, np, 0, mask, dropout)
    causal, visible, add = masks(mask, shape)
    keep = keep_mask(bench.dropout_seed, dropout, shape[:2] + shape[1:2]) if dropout else None
    want = exact(bench.q, bench.k, bench.v, bench.do, causal=causal, visible=visible, add=add,
                 keep=keep, scale_kept=1 / (1 - dropout))
    for name, got in bench.reference.items():
        assert np.max(np.abs(got - want[name])) <= 2e-5 * np.max(np.abs(want[name])), name
    assert causal == (mask != "full")
    assert (add is not None) == (mask == "alibi") and (visible is not None) == (mask == "padding")
    if mask == "alibi":  # a slope per head, 0 on the diagonal, lower the farther the key
        assert add.shape == (3, 150, 150) and np.all(add[:, 5, 5] == 0)
        assert add[0, 9, 1] == -4.0 and add[1, 9, 1] == -2.0
    if mask == "padding":  # head 1 sees no key before 25, head 2 none at all
        assert visible[0].all() and not visible[1, :25].any() and visible[1, 25:].all()
        assert not visible[2].any()
        assert not bench.reference["out"][1, :25].any() and not bench.reference["out"][2].any()
        assert bench.reference["out"][1, 25:].all()


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("mask,dropout", [("full", 0.0), ("alibi", 0.2), ("padding", 0.1)])
def test_campaign_with_masks_and_dropout(xp, mask, dropout):
    """Every extreme fault at every site with the other masks and with dropout (and then at the
    dropped probabilities), on NumPy (three 64-key tiles a row) and
    on the CUDA kernels (two of 32): none silent, none uncorrectable, each detected and repaired,
    or changing nothing (a fault in a row that sees no key, whose output is written 0); clean
    runs without a flag."""
    config = CampaignConfig(trials=1, clean_trials=1, batch=2, seq=150 if xp is np else 40,
                            d_model=32, n_heads=2, kinds=EXTREME, patterns=("element",),
                            core="fused", mask=mask, dropout=dropout)
    assert config.sites == sites_of(dropout)
    assert ("fused:dropout" in config.sites) == bool(dropout) and "fused:dV_out" in config.sites
    records = run_campaign(config, xp, progress=False)
    assert {r["site"] for r in records if r["kind"] != "none"} == set(config.sites)
    # the unprotected runs' faults land too (with dropout the unchecked forward carries no sums
    # for dV's final check, and its fault was never injected, yet counted as masked)
    assert all(r["injected"] == 1 for r in records if r["kind"] != "none"), records
    faulted = [r for r in records if r["kind"] != "none" and r["protected"]]
    for r in faulted:
        assert r["trials"] == r["injected"] == 1, r
        assert r["silent"] == r["miscorrected"] == r["uncorrectable"] == 0, r
        assert r["detected"] == r["recomputed"] or r["masked"] == 1, r
    # padding: of 4 heads one sees no key, another none in its first rows
    undetected = sum(1 - r["detected"] for r in faulted)
    assert undetected <= (len(faulted) // 3 if mask == "padding" else 0), undetected
    for r in records:
        if r["kind"] == "none":
            assert r["false_positives"] == 0 and r["masked"] == r["trials"] == 1, r


def test_numpy_final_sites_are_faulted_once_a_pass():
    """The final checks run in the trial: the hook sees each of them once, on the returned
    array, and a fault there is reported at that site in check="detect"."""
    bench = FusedTestbed("float16", (2, 70, 8), 0, np, 0)
    assert {s: bench.calls[s] for s in FINAL_SITES} == dict.fromkeys(FINAL_SITES, 1)
    for site in FINAL_SITES:
        fault = bench.fault(site, {"kind": "nan"}, "element", 3)
        with pytest.warns(Warning, match=site):
            trial = bench.run(site, "detect", fault)
        assert trial.injected and [e.site for e in trial.report.events][:1] == [site]


def test_numpy_faults_pick_tiles_across_the_run():
    """The hook's calls per site are counted on the clean run; ``skip`` picks among all of
    them (different seeds, different tiles)."""
    from attention._cpu_fused import BC, BR

    assert BR == BC
    bench = FusedTestbed("float32", (2, 150, 16), 0, np, 0)
    blocks = -(-150 // BR)
    pairs = blocks * (blocks + 1) // 2  # causal: (block, tile) pairs per head, each pass
    assert bench.calls["fused:S"] == bench.calls["fused:P"] == 2 * (pairs + pairs)
    assert bench.calls["fused:O_acc"] == bench.calls["fused:rowsum"] == 2 * pairs
    assert set(bench.calls) == set(SITES)
    skips = {bench.fault("fused:S", {"kind": "inf"}, "element", seed).skip for seed in range(40)}
    assert len(skips) > 10 and max(skips) < bench.calls["fused:S"]


def test_cli_core_fused(tmp_path: Path):
    out = tmp_path / "camp"
    status = main(["campaign", "--backend", "numpy", "--core", "fused", "--out", str(out),
                   "--no-progress", "--trials", "1", "--clean-trials", "1", "--seq", "70",
                   "--d-model", "16", "--heads", "2", "--batch", "1", "--sites", "fused:P",
                   "fused:dK_acc", "--kinds", "nan", "bitflip-exp", "--patterns", "element"])
    assert status == 0
    records = json.loads((out / "campaign.json").read_text())["records"]
    assert {r["site"] for r in records} == {"fused:P", "fused:dK_acc", "fused"}
    text = (out / "campaign.md").read_text()
    assert "fused attention core (causal), 2 heads of seq=70 x head_dim=8" in text
    assert "Propagation" not in text
    status = main(["campaign", "--backend", "numpy", "--core", "fused", "--out", str(out),
                   "--no-progress", "--trials", "1", "--clean-trials", "0", "--seq", "40",
                   "--d-model", "16", "--heads", "2", "--batch", "1", "--sites", "fused:dropout",
                   "--kinds", "nan", "--patterns", "element", "--mask", "alibi", "--dropout",
                   "0.25"])
    assert status == 0
    assert "fused attention core (causal, ALiBi biases, dropout 0.25), 2 heads of seq=40" in \
        (out / "campaign.md").read_text()
    (cell,) = [r for r in json.loads((out / "campaign.json").read_text())["records"]
               if r["protected"] and r["kind"] != "none"]
    assert (cell["site"], cell["injected"], cell["detected"]) == ("fused:dropout", 1, 1)


@pytest.mark.parametrize("flags,message", [
    (["--core", "fused", "--sites", "scores"], "--sites: unknown scores"),
    (["--core", "fused", "--model", "gpt2"], "--model layer"),
    (["--model", "gpt2", "--dtype", "float16", "--patterns", "row"],
     "--dtype, --patterns: for --model layer only"),
    (["--sites", "fused:S"], "--sites: unknown fused:S"),
    (["--mask", "alibi"], "--mask: for --core fused only"),
    (["--dropout", "0.1"], "--dropout: for --core fused only"),
    (["--core", "fused", "--dropout", "1.5"], "--dropout must be a probability"),
    (["--core", "fused", "--gemm", "8", "8", "8"], "--gemm: for --core unfused only"),
    (["--layers", "3"], "--layers: for a --model family only"),
    (["--steps", "3", "--core", "fused"], "--steps: for a --model family only"),
    (["--core", "fused", "--sites", "fused:S", "fused:dropout"],
     "--sites fused:dropout: the dropped probabilities, with --dropout only"),
])
def test_cli_refuses_bad_core_flags(flags, message, tmp_path, capsys):
    assert main(["campaign", "--backend", "numpy", "--out", str(tmp_path / "x"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cupy_campaign_flags():
    """On CuPy (any array module but NumPy) the kernels inject one element a fault: other
    patterns are refused unless every site is a final check's."""
    gpu = object()
    assert backend_problem(SITES, ("element",), gpu) is None
    assert "--patterns element" in backend_problem(SITES, ("element", "row"), gpu)
    assert "--patterns element" in backend_problem(("fused:S", "fused:out"), ("row",), gpu)
    assert backend_problem(FINAL_SITES, ("row", "tile"), gpu) is None
    assert backend_problem(SITES, ("row",), np) is None


@pytest.mark.parametrize("xp", CUDA)
def test_cupy_campaign_repairs_every_extreme_fault_at_every_site(xp):
    """The same campaign on the CUDA kernels (32 x 32 tiles: seq 40 makes two blocks), each
    toolkit Fault at an internal site converted by device_fault, those at the final sites (O,
    dV, dK as returned) injected as on NumPy."""
    config = CampaignConfig(trials=1, clean_trials=1, batch=1, seq=40, d_model=16, n_heads=2,
                            kinds=EXTREME, patterns=("element",), core="fused")
    assert config.sites == SITES
    _assert_all_repaired(run_campaign(config, xp, progress=False), 1, SITES)
    with pytest.raises(ValueError, match="--patterns element"):
        run_campaign(CampaignConfig(core="fused", patterns=("row",)), xp, progress=False)
    tiles = CampaignConfig(trials=1, clean_trials=0, batch=1, seq=40, d_model=16, n_heads=2,
                           kinds=("nan",), patterns=("row", "tile"), sites=FINAL_SITES,
                           core="fused")
    _assert_all_repaired(run_campaign(tiles, xp, progress=False), 1, FINAL_SITES)


@pytest.mark.parametrize("xp", CUDA)
def test_device_fault_converts_the_toolkit_fault(xp):
    from attention._cuda_fused import BR, DeviceFault, device_fault

    shape = (3, 70, 16)
    got = device_fault(Fault("additive", sites="fused:O_acc", batch=2, row=45, col=3,
                             magnitude=7.0), shape, 70, np.float32, causal=True, step=1)
    assert got == DeviceFault("fused:O_acc", 45, 3, head=2, step=1, kind="additive", value=7.0)
    got = device_fault(Fault("scale", sites="fused:dS", factor=-3.0, times=None, seed=4), shape,
                       70, np.float32)
    assert (got.kind, got.value, got.persistent, got.step) == ("scale", -3.0, True, 0)
    assert got.head < 3 and got.row < 70 and got.col < 70
    # 16-bit data: the tiles hold float32, whose 32 bits a drawn flip picks from
    bits = {device_fault(Fault("bitflip", sites="fused:S", seed=s), shape, 70, np.float16).bit
            for s in range(60)}
    assert max(bits) > 16 and bits <= set(range(32))
    # drawn positions are computed ones: causal tiles at or below the diagonal's; steps of the
    # block's sweep (key rows of the last block: one query block to sweep)
    for seed in range(30):
        f = device_fault(Fault("nan", sites="fused:P", seed=seed), shape, 70, np.float32,
                         causal=True)
        assert f.col < (f.row // BR + 1) * BR
        f = device_fault(Fault("nan", sites="fused:dK_acc", row=69, seed=seed), shape, 70,
                         np.float32, causal=True)
        assert f.step == 0 and f.col < 16
        f = device_fault(Fault("nan", sites="fused:rowsum", seed=seed), shape, 70, np.float32)
        assert f.col == 0 and f.step < 3
    for fault, error in [(Fault("nan", "row", sites="fused:S"), "pattern"),
                         (Fault("multibit", sites="fused:S"), "one bit"),
                         (Fault("nan", sites="fused:S", skip=2), "skip"),
                         (Fault("nan", sites=("fused:S", "fused:P")), "one site"),
                         (Fault("nan", sites="scores"), "one site"),
                         (Fault("nan", sites="fused:S", times=2), "times")]:
        with pytest.raises(ValueError, match=error):
            device_fault(fault, shape, 70, np.float32)
    with pytest.raises(IndexError, match="step"):
        device_fault(Fault("nan", sites="fused:dQ_acc", row=10), shape, 70, np.float32,
                     causal=True, step=1)
    with pytest.raises(ValueError, match="tile site"):
        device_fault(Fault("nan", sites="fused:S"), shape, 70, np.float32, step=1)


@pytest.mark.parametrize("xp", CUDA)
@pytest.mark.parametrize("dtype,bit", [(np.float32, 30), (np.float64, 62), (np.float64, 63)])
def test_kernels_flip_a_bit(xp, dtype, bit):
    """Kind "bitflip" in the kernels (float32 and float64 tiles, the top exponent and the sign
    bit): it changes the results unprotected, and the flipped S element is repaired."""
    q, k, v, do = _data(np.random.default_rng(2), 2, 70, 70, 16, dtype)
    clean = _run(xp, q, k, v, do, Context(), causal=True)
    fault = _fault("fused:S", "inf", 0.0)
    fault.kind, fault.bit = "bitflip", bit
    off, _ = _faulted_run(xp, q, k, v, do, "fused:S", "forward", fault, check="off")
    assert fault.hits == 1 and np.isfinite(fault.old)
    assert any(not np.array_equal(g, c) for g, c in zip(off, clean))
    fault = _fault("fused:S", "inf", 0.0)
    fault.kind, fault.bit = "bitflip", bit
    got, ctx = _faulted_run(xp, q, k, v, do, "fused:S", "forward", fault)
    assert "fused:S" in ctx.report.sites
    for g, c in zip(got, clean):
        assert np.array_equal(g, c)
