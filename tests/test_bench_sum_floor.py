"""bench/sum_floor.py compares the checks' column sums with two faster forms: each must compute
the same sums (else its time says nothing), the float32 form within the error it claims, and
the script must run through."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import sum_floor  # noqa: E402

U32 = 2.0 ** -24


@pytest.mark.parametrize("rows,cols", [(128, 128), (37, 5), (8, 1), (3, 9)])
def test_every_form_computes_the_checks_sums(rows, cols):
    x = np.random.default_rng(rows * cols).standard_normal((rows, cols)).astype(np.float32)
    x[0, 0] = 1e30  # a column far from the others in magnitude
    w = np.arange(1, rows + 1) / rows
    x64 = x.astype(np.float64)
    want = np.stack([x64.sum(0), w @ x64, np.abs(x64).sum(0)])
    scale = np.abs(x64).sum(0)
    for name, form in sum_floor.FORMS.items():
        out = np.full((3, cols), np.nan)
        form(x, w, out)
        # float64 forms: rounding in float64 alone; the float32 trees: 3 u of their terms, and
        # the float32 weights' and products' roundings in the weighted sum
        bound = 4 * U32 if "float32" in name else 1e-14
        assert (np.abs(out - want) <= bound * scale).all(), name
        assert sum_floor.relative_error(x, out) <= bound, name


def test_sum_floor_runs_every_shape():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "sum_floor.py"), "--repeats", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for label, _, _ in sum_floor.SHAPES:
        assert label in run.stdout, label
    for name in sum_floor.FORMS:
        assert run.stdout.count(name) == len(sum_floor.SHAPES), name
