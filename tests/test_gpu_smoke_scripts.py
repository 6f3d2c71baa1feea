"""The GPU smoke scripts that ``scripts/gpu_check.sh`` runs first on a GPU, run here on the CUDA
backend on the CPU: a script that no longer matches the library's interfaces fails in CI, not in
the first minute of a short device lease (``cuda_smoke.py`` once passed coefficients in a layout
the reductions had stopped taking, and 192 of its cases failed on an H200 for that alone)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import CUDA_ON_CPU

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

pytestmark = [pytest.mark.cuda_on_cpu,
              pytest.mark.skipif(CUDA_ON_CPU is None, reason="no cupy-on-cpu here (a GPU, or no "
                                                             "C++ compiler): gpu_check.sh runs them")]


@pytest.mark.parametrize("script", ["cuda_smoke.py", "cuda_smoke_softmax.py"])
def test_smoke_script_passes_on_cupy_on_cpu(script, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as when run: the softmax script imports the other
    spec = importlib.util.spec_from_file_location(script[:-3], SCRIPTS / script)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # imports cupy: the stand-in, for the length of this test
        status = module.main()
    finally:
        sys.modules.pop("cuda_smoke", None)  # imported by the softmax script, on the stand-in
    printed = capsys.readouterr().out
    assert status == 0, "\n".join(line for line in printed.splitlines()
                                  if line.startswith("FAIL"))[:4000]
    assert "all passed" in printed
