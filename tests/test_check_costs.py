"""The counted check costs (attention.experiments.check_costs) and the worked example using them."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from attention import SITES, Variant
from attention.experiments.check_costs import CheckCost, check_costs, model_ms

ROOT = Path(__file__).resolve().parents[1]


def test_counts_by_hand() -> None:
    # batch 1, 1 head, seq 2, head_dim 2: every product is 2x2 @ 2x2, float32 (4 bytes). Every
    # element a pass reads (or sums) costs 3 multiply-adds = 6 FLOPs; every checked vector
    # (column, or row for the consumer-verified sites) 48 bytes of checksums (3 x 2 x float64).
    costs = check_costs(1, 1, 2, 2)
    # q_proj: columns, X encoded (no step hands its encoding on): encode A 4 + predict (reads B) 4
    # + observe C 4 = 12 elements read, 12 * 6 = 72 FLOPs; 2 columns checked.
    assert costs["q_proj"] == CheckCost(bytes=12 * 4 + 2 * 48, flops=72)
    # k_proj and v_proj take q_proj's encoding of X (the table hands it on): reads B 4 + C 4 = 8
    assert costs["k_proj"] == costs["v_proj"] == CheckCost(bytes=8 * 4 + 2 * 48, flops=48)
    # d_wq encodes X^T, which d_wk and d_wv then take; d_x takes [dQ dK dV]'s, composed
    assert costs["d_wq"] == costs["q_proj"]
    assert costs["d_wk"] == costs["d_wv"] == costs["k_proj"]
    # context gets P's column encoding passed (a_sums): reads B 4 + C 4 = 8, 48 FLOPs
    assert costs["context"] == CheckCost(bytes=8 * 4 + 2 * 48, flops=48)
    # out_proj gets the context's observed encoding: the same
    assert costs["out_proj"] == costs["context"]
    # scores: row checksums A (B E) only, B E passed: reads A 4; the softmax sums C's 4
    # elements on its own read (FLOPs, no bytes): (4 + 4) * 6 = 48 FLOPs; 2 rows checked.
    assert costs["scores"] == CheckCost(bytes=4 * 4 + 2 * 48, flops=48)
    assert costs["d_probs"] == costs["scores"]
    assert set(costs) == set(SITES)
    # PyTorch's W layout: the weight gradients are written transposed, each encoding its own A
    w_layout = check_costs(1, 1, 2, 2, variant=Variant(w_layout=True))
    assert w_layout["d_wk"] == w_layout["d_wv"] == costs["d_wq"] == w_layout["d_wq"]
    assert {s: c for s, c in w_layout.items() if c != costs[s]}.keys() == {"d_wk", "d_wv"}


def test_per_head_sites_scale_with_batch_times_heads() -> None:
    one, six = check_costs(1, 2, 8, 4), check_costs(3, 2, 8, 4)
    for site in ("scores", "context", "d_probs", "d_v", "d_q", "d_k"):
        assert six[site] == CheckCost(3 * one[site].bytes, 3 * one[site].flops), site


def test_model_ms_and_bad_input() -> None:
    # 2e7 bytes at 20 GB/s = 1 ms; 1e7 FLOPs at 10 GFLOP/s = 1 ms
    assert model_ms(CheckCost(20_000_000, 10_000_000), 20.0, 10.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        model_ms(CheckCost(1, 1), 0.0, 10.0)
    with pytest.raises(ValueError):
        check_costs(1, 0, 8, 4)


def test_worked_example_reproduces() -> None:
    """docs/checking_plan.md's table is exactly what its command prints."""
    doc = (ROOT / "docs" / "checking_plan.md").read_text(encoding="utf-8")
    command = re.search(r"Command: `python (scripts/plan_example\.py[^`]*)`", doc).group(1)
    shown = re.search(r"<!-- BEGIN plan_example output -->\n```text\n(.*?)\n```", doc,
                      re.DOTALL).group(1)
    done = subprocess.run([sys.executable, *command.split()], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert done.stdout.rstrip("\n") == shown


def test_the_fused_variant_is_refused() -> None:
    """The fused core has no per-site GEMMs to count: a clear error, not unfused figures."""
    with pytest.raises(ValueError, match="fused"):
        check_costs(2, 2, 16, 8, variant=Variant(fused=True))
