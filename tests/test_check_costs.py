"""The counted check costs (attention.experiments.check_costs) and the worked example using them."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from attention import SITES
from attention.experiments.check_costs import CheckCost, check_costs, model_ms

ROOT = Path(__file__).resolve().parents[1]


def test_counts_by_hand() -> None:
    # batch 1, 1 head, seq 2, head_dim 2: every product is 2x2 @ 2x2, float32 (4 bytes).
    costs = check_costs(1, 1, 2, 2)
    # scores: row checksums only, operands' encodings passed, observed by the softmax:
    # predict A (B E) reads A (4 elements, 4*2*2 = 16 FLOPs), observe 4*2*2 = 16 FLOPs,
    # 2 checksum entries of 32 bytes.
    assert costs["scores"] == CheckCost(bytes=4 * 4 + 2 * 32, flops=16 + 16)
    # q_proj: both directions, both operands encoded (X's shared encoding is charged here):
    # reads: encode A 4 + encode B 4 + predict columns (reads B) 4 + predict rows (reads A) 4
    # + C once 4 = 20 elements; FLOPs 4 * 4 each for the two encodings, the two predictions and
    # the two observations = 96; 4 checksum entries.
    assert costs["q_proj"] == CheckCost(bytes=20 * 4 + 4 * 32, flops=96)
    # k_proj gets X's encoding passed: 4 elements and 16 FLOPs fewer
    assert costs["k_proj"] == CheckCost(bytes=16 * 4 + 4 * 32, flops=80)
    assert set(costs) == set(SITES)


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
