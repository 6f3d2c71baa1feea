"""scripts/fused_clean_calls.py, the fused core's false-positive campaign, in small: its
adversarial clean calls (logits near overflow and far beyond, flat rows, key padding, a head that
sees no key, additive masks with "not allowed" entries, dropout) flag nothing on either backend (the numba kernels; the CUDA kernels on a GPU or on
``cupy-on-cpu``), and it reports what it ran. A GPU session runs it at length with
``--backend cupy``."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import BACKENDS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fused_clean_calls.py"


def _main(argv: list[str], monkeypatch) -> int:
    spec = importlib.util.spec_from_file_location("fused_clean_calls", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_clean_call_campaign_flags_nothing(xp, dtype, capsys, monkeypatch):
    backend = "numpy" if xp is np else "cupy"
    status = _main(["--calls", "16", "--max-len", "40", "--long-calls", "1", "--long-len", "70",
                    "--dtype", dtype, "--backend", backend, "--seed", "3"], monkeypatch)
    out = capsys.readouterr().out
    assert f"backend {backend}, dtype {dtype}" in out
    assert "random lengths (L 1..40): 16 clean fwd+bwd calls" in out, out
    assert "additive-mask 2, dropout 2, far-beyond 2, flat-rows 2" in out, out
    assert "long (L 70): 1 clean fwd+bwd calls" in out, out
    assert out.count("0 flagged (false positives), 0 raised, 0 with INF/NaN") == 2, out
    assert status == 0
