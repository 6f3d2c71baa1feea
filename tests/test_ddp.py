"""DistributedDataParallel over 2 processes (gloo, CPU): a fault on one rank is repaired there
before the gradient all-reduce; unprotected, it reaches every rank (scripts/ddp_check.py)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_check.py"


def test_fault_on_one_rank_is_repaired_before_the_all_reduce(tmp_path):
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--backend", "gloo", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.exists(), run.stdout + run.stderr
    result = json.loads(out.read_text())
    ranks, tol = result["ranks"], result["tolerance"]
    assert [r["faulted"] for r in ranks] == [False, True]
    for r in ranks:
        assert r["protected"] <= tol, r  # equal to the fault-free gradients, on every rank
        # unprotected: the fault of rank 1 is in rank 0's gradients too (the all-reduce)
        assert r["unprotected"] > tol or math.isinf(r["unprotected"]), r
    assert result["ok"] and run.returncode == 0, run.stdout + run.stderr
