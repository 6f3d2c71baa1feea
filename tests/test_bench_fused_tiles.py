"""bench/fused_tiles.py calls the fused core's numba leaves directly: it must keep up with their
signatures (a leaf that gained an argument broke the benchmark, which no other test runs)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fused_tiles_runs_every_step():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "fused_tiles.py"), "--calls", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for line in ("S = Q K^T", "softmax invariant", "dS invariant", "forward tile:",
                 "backward tile:"):
        assert line in run.stdout, line
