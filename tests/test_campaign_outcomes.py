"""The campaign's outcome classes judged against cases whose truth is known."""
from __future__ import annotations

import numpy as np
import pytest

from abftgemm.faults import Fault
from attention.experiments.campaign import CampaignConfig, Record, _tally
from attention.experiments.campaign import testbed as make_testbed

SMALL = dict(trials=1, clean_trials=0, batch=1, seq=8, d_model=16, n_heads=2, gemm=(8, 12, 8))


@pytest.fixture(scope="module")
def bench():
    return make_testbed(CampaignConfig(**SMALL), np, 0)


def _outcome(bench, site: str, check: str, hook) -> dict[str, int]:
    record = Record(site, "additive", "element", check != "off", {})
    with np.errstate(all="ignore"):
        _tally(record, bench, bench.run(site, check, hook))
    return {k: v for k, v in record.counts.items() if v}


@pytest.mark.parametrize("check", ["off", "correct"])
@pytest.mark.parametrize("site", ["q_proj", "d_probs", "softmax_backward", "gemm"])
def test_a_fault_that_changes_nothing_is_masked(bench, site: str, check: str) -> None:
    """An additive 1e-30 is absorbed by the float32 element it hits: every result is the
    fault-free run's, bit for bit, so the trial is masked, not "silent, within bound" (a float32
    layer run with a fault hook takes the softmax backward's unscaled dS, which rounds
    differently from the hook-free path: the reference must be the hooked path's)."""
    fault = Fault("additive", "element", seed=3, sites=site, magnitude=1e-30)
    assert _outcome(bench, site, check, fault) == {"injected": 1, "masked": 1}


@pytest.mark.parametrize("site", ["q_proj", "softmax", "gemm"])
def test_known_truth(bench, site: str) -> None:
    """A large fault unprotected is silent corruption; with check="detect" it is detected and
    delivered wrong (miscorrected), never corrected; with check="correct" detected and repaired."""
    def fault() -> Fault:
        return Fault("additive", "element", seed=3, sites=site, magnitude=100.0)

    assert _outcome(bench, site, "off", fault()) == {"injected": 1, "silent": 1}
    with pytest.warns(Warning):
        got = _outcome(bench, site, "detect", fault())
    assert got["detected"] == got["miscorrected"] == 1
    assert "corrected" not in got and "silent" not in got
    got = _outcome(bench, site, "correct", fault())
    assert got["detected"] == 1 and "miscorrected" not in got and "silent" not in got


@pytest.mark.parametrize("mask", ["causal", "padding"])
def test_fused_core_a_hook_that_changes_nothing_is_masked(mask: str) -> None:
    """The fused core computes the same with and without a hook: its faulted trials may be
    compared with the hook-free run (FusedTestbed.compare ignores ``faulted``)."""
    config = CampaignConfig(**{**SMALL, "gemm": (32, 32, 32)}, core="fused", mask=mask)
    bench = make_testbed(config, np, 0)
    record = Record("fused:S", "additive", "element", True, {})
    fault = Fault("additive", "element", seed=3, sites="fused:S", magnitude=1e-30)
    _tally(record, bench, bench.run("fused:S", "correct", fault))
    assert record.counts["masked"] == 1 and record.counts["injected"] == 1


class _NeverFires:
    """A fault hook whose site is never reached: it runs and never fires."""

    injected = False

    def __call__(self, site, tile) -> None:
        pass


@pytest.mark.parametrize("site", ["q_proj", "gemm"])
def test_a_fault_that_never_fired_is_no_outcome(bench, site: str) -> None:
    """A faulted trial whose fault never fired says nothing of protection: it counts as
    ``not_fired``, not as masked (its results equal the fault-free run's), and campaign.md
    says so."""
    from attention.experiments.campaign import markdown

    assert _outcome(bench, site, "correct", _NeverFires()) == {"not_fired": 1}
    record = Record(site, "additive", "element", True, {})
    _tally(record, bench, bench.run(site, "correct", _NeverFires()))
    text = markdown([record.as_dict()], None, CampaignConfig(**SMALL), "numpy")
    assert f"**Faults that never fired** (trials counted in no outcome): {site} 1." in text


@pytest.mark.parametrize("site, pattern", [("fused:O_acc", "element"), ("fused:dS", "element"),
                                           ("fused:out", "tile"), ("fused:dropout", "row")])
def test_a_subnormal_where_every_result_is_zero_is_within_bound(site: str, pattern: str) -> None:
    """With dropout 1 every result of the fused core is exactly 0, so the tolerance's terms (a
    multiple of ``max |r_ref|`` and of the run's rounding error) were 0 and a mantissa flip of a
    zero (bit 51 of a float64: 1.1e-308, a subnormal, below the checks' absolute floors, and
    what it becomes downstream) counted as silent corruption; it is within the bound."""
    config = CampaignConfig(**{**SMALL, "gemm": (32, 32, 32)}, core="fused", dtype="float64",
                            dropout=1.0)
    bench = make_testbed(config, np, 0)
    record = Record(site, "bitflip-mant", pattern, True, {})
    fault = Fault("bitflip", pattern, seed=3, sites=site, bit=51)
    _tally(record, bench, bench.run(site, "correct", fault))
    assert fault.injected and not any(fault.injected[0].old)
    assert record.counts["silent"] == 0 and record.counts["silent_within_bound"] == 1


def test_campaign_md_says_when_where_and_from_which_commit() -> None:
    from attention.experiments.campaign import markdown

    text = markdown([], None, CampaignConfig(**SMALL), "numpy")
    assert " UTC on machine " in text and ", commit " in text


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bit_flips_hit_the_bits_of_the_dtype_the_site_holds(dtype: str) -> None:
    """The softmax backward hands its hook the unscaled dS in float32 for 16-bit data, but the
    campaign placed its bit flips by the data's layout: "bitflip-exp" flipped float32's
    mantissa bit 14 (float16), "bitflip-mant" its bit 9, a change of 2^-14 that the rounding to
    float16 undid (masked, unprotected). The GEMM sites hold the data's dtype."""
    from attention.experiments.campaign import run_campaign

    config = CampaignConfig(**{**SMALL, "dtype": dtype}, sites=("q_proj", "softmax_backward"),
                            kinds=("bitflip-exp", "bitflip-mant"), patterns=("element",))
    bits = {(r["site"], r["kind"]): r["fault"]["bit"]
            for r in run_campaign(config, np, progress=False) if r["kind"] != "none"}
    mantissa = 10 if dtype == "float16" else 7  # bit 14 is the top exponent bit of both
    assert bits == {("q_proj", "bitflip-exp"): 14, ("q_proj", "bitflip-mant"): mantissa - 1,
                    ("softmax_backward", "bitflip-exp"): 30,
                    ("softmax_backward", "bitflip-mant"): 22}


def test_campaign_md_states_the_bound_the_verdicts_used() -> None:
    """campaign.md gave the bound's atol as max(atol_scale max|r_ref|, 10 noise) without its
    absolute floor ``tiny / u``: with dropout 1 every result is 0, the stated bound was 0, yet a
    subnormal change counted within it."""
    from attention.experiments.campaign import markdown

    config = CampaignConfig(**{**SMALL, "gemm": (32, 32, 32)}, core="fused", dtype="float64",
                            dropout=1.0)
    bench = make_testbed(config, np, 0)
    floor = set(bench.atol.values())
    assert len(floor) == 1 and floor.pop() > 0  # every result 0: the floor alone
    text = " ".join(markdown([], None, config, "numpy").split())
    assert f"{bench.atol['out']:.3g}" in text, text
