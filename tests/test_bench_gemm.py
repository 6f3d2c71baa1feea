"""The GEMM benchmark runs end to end on the CPU and writes a well-formed results file.

Not a timed test: only the structure of the output and the positivity of the numbers are checked.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fresh_python import ROOT, env_with_checkout

RECORD_FIELDS = {"group", "case", "dtype", "shape", "protected_ms", "unprotected_ms", "ratio",
                 "floor_ms", "peers"}


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _check_doc(doc: dict, groups: set[str]) -> None:
    assert {"device", "date", "copy_TBps", "records"} <= doc.keys()
    assert isinstance(doc["device"], str) and doc["device"]
    assert isinstance(doc["date"], str) and doc["date"][:4].isdigit()
    assert _positive(doc["copy_TBps"])
    records = doc["records"]
    assert {r["group"] for r in records} == groups
    for r in records:
        assert RECORD_FIELDS <= r.keys(), r
        for key in ("protected_ms", "unprotected_ms", "ratio", "floor_ms"):
            assert _positive(r[key]), (key, r)
        assert r["ratio"] == pytest.approx(r["protected_ms"] / r["unprotected_ms"])
        assert len(r["shape"]) == 4 and all(isinstance(s, int) and s > 0 for s in r["shape"])
        assert isinstance(r["peers"], dict)
        assert all(_positive(v) for v in r["peers"].values()), r["peers"]
        assert r.get("flags", 0) == 0, f"false flags on clean data: {r}"


def _run_bench(script: str, *args: str, timeout: int, env: dict | None = None) -> str:
    """Run ``bench/<script>`` with ``args`` from the repository root; its stdout (it must exit 0)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_bench_gemm_cpu_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    stdout = _run_bench("gemm.py", "--quick", "--backend", "numpy", "--json", str(out),
                        "--repeats", "2", timeout=120, env=env_with_checkout())
    doc = json.loads(out.read_text())
    _check_doc(doc, {"cpu-square", "cpu-batched", "cpu-dtype", "cpu-cold"})
    assert "ratio" in stdout and "cpu-square" in stdout
    for r in doc["records"]:  # the targets' ratio and the machine's floor, side by side
        if r["group"] != "cpu-cold":
            assert _positive(r["ratio_vs_numpy"]), r
            assert r["ratio_vs_numpy"] == pytest.approx(
                r["protected_ms"] / r["peers"]["numpy.matmul"])
        if r["group"] != "cpu-cold" and r["dtype"] in ("float32", "float64"):
            assert r["floor_ratio_vs_numpy"] == pytest.approx(
                r["peers"]["numpy.matmul+thin"] / r["peers"]["numpy.matmul"])
    assert "thin-GEMM floor / numpy.matmul" in stdout


@pytest.mark.parametrize("lead", [(), (3,)])
def test_thin_gemm_floor_computes_the_product(lead: tuple[int, ...]) -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench.gemm import thin_gemm_floor
    finally:
        sys.path.remove(str(ROOT))
    rng = np.random.default_rng(0)
    a = rng.standard_normal(lead + (5, 4)).astype(np.float32)
    b = rng.standard_normal(lead + (4, 3)).astype(np.float32)
    np.testing.assert_allclose(thin_gemm_floor(a, b)(), a @ b, rtol=1e-6)


def test_bench_gemm_gpu_groups_dry_run_on_numpy(tmp_path: Path, monkeypatch) -> None:
    """The GPU groups' code path (chained checksums included), run on NumPy with tiny shapes."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench import gemm
    finally:
        sys.path.remove(str(ROOT))
    shapes = {"gemm-projection": [(1, 96, 64, 80)], "gemm-chained": [(1, 96, 64, 80)]}
    monkeypatch.setattr(gemm, "cases", lambda group, quick: [
        (s, d) for s in shapes[group] for d in gemm.GPU_DTYPES])
    out = tmp_path / "dry.json"
    assert gemm.main(["--quick", "--backend", "numpy", "--json", str(out), "--repeats", "1",
                      "--warmup", "0", "--groups", "gemm-chained,gemm-projection"]) == 0
    doc = json.loads(out.read_text())
    _check_doc(doc, {"gemm-chained", "gemm-projection"})
    assert {r["dtype"] for r in doc["records"]} == {"float16", "bfloat16", "float32"}


def test_random_bfloat16_matches_ml_dtypes_rounding() -> None:
    """The bit-level float32 -> bfloat16 rounding used on CuPy equals ml_dtypes' cast."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench import gemm
    finally:
        sys.path.remove(str(ROOT))
    x = gemm.random_array(np, (64, 33), "float32", 0.37, seed=5)
    y = gemm.random_array(np, (64, 33), "bfloat16", 0.37, seed=5)
    assert y.dtype == gemm.dtype_of("bfloat16")
    np.testing.assert_array_equal(y.view(np.uint16), x.astype(y.dtype).view(np.uint16))
    assert np.count_nonzero(x) == x.size


def test_cpu_passes_script_times_every_pass() -> None:
    stdout = _run_bench("cpu_passes.py", "--size", "64", "--repeats", "2", timeout=120)
    rows = [line for line in stdout.splitlines()[2:] if line.strip()]
    assert len(rows) == 6, stdout
    for line in rows:
        hot, memory = (float(v) for v in line.split()[-2:])
        assert hot > 0 and memory > 0, line


def test_causal_triangles_script_times_both_ways() -> None:
    stdout = _run_bench("causal_triangles.py", "--cases", "small", "--repeats", "2",
                        timeout=300)
    line = stdout.splitlines()[-1]
    times = [float(w) for w in line.replace("|", " ").split() if w.replace(".", "").isdigit()]
    assert line.startswith("small") and len(times) == 8 and min(times) > 0, stdout


def test_handed_on_script_times_both_encodings() -> None:
    stdout = _run_bench("handed_on.py", "--repeats", "2", timeout=300)
    rows = stdout.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["proj", "proj-bT", "d_x-bT"], stdout
    for line in rows:
        assert all(float(v) > 0 for v in line.split()[-3:]), line


def test_loaded_script_runs_each_scenario_in_its_own_interpreter(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "loaded.json"
    stdout = _run_bench("loaded.py", "--cases", "tiny", "--repeats", "1", "--json", str(out),
                        timeout=300)
    doc = json.loads(out.read_text())
    assert doc["device"] and [s["scenario"] for s in doc["scenarios"]] == ["idle", "loaded"]
    idle, loaded = doc["scenarios"]
    assert "while True" in loaded["load"] and idle["load"] == "none started"
    for scenario in doc["scenarios"]:
        (record,) = scenario["records"]
        assert record["case"] == "tiny" and all(_positive(v) for v in record["ms"].values())
        assert set(record["ms"]) == {"numpy_protected", "numpy_off", "torch_protected",
                                     "torch_stock", "numpy_protected_blas1",
                                     "torch_protected_blas1"}
    assert "torch_protected/stock" in stdout
