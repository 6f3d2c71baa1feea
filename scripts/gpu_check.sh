#!/usr/bin/env bash
# GPU acceptance run, from the repository root on a machine with an NVIDIA GPU:
#   OUT=/some/dir PYTHONPATH=. bash scripts/gpu_check.sh
# Runs the CuPy smoke checks, the test suite with the GPU required, then the calibration and the
# benchmarks (most important first, in case an outer timeout cuts the run short); keeps going when
# a step fails, and exits non-zero if any did. Each step has its own timeout (750 s if every one
# ran out); the whole run took 206 s on an H200 before the per-site, plan and PyTorch steps were
# added (they have never run: no GPU since).
set -u

OUT="${OUT:-./gpu_check_out}"
PY="${PYTHON:-python3}"
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
failed=()

# step NAME SECONDS LOG COMMAND...: run COMMAND under a timeout, tee its output into $OUT/LOG.
step() {
    local name=$1 seconds=$2 log=$3
    shift 3
    echo "=== $name (timeout ${seconds}s)"
    timeout --kill-after=5 "$seconds" "$@" 2>&1 | tee "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "=== $name FAILED (exit $rc)"
        failed+=("$name")
    fi
}

step smoke 60 cuda_smoke.log $PY scripts/cuda_smoke.py
step smoke_softmax 90 cuda_smoke_softmax.log $PY scripts/cuda_smoke_softmax.py
# The GPU cases (every test body parametrized with xp=cupy) and the NVRTC compile check; the
# CPU cases run in CI.
ABFT_REQUIRE_GPU=1 step pytest 240 pytest.log $PY -m pytest -q --maxfail=25 -p no:cacheprovider -k "cupy or cuda or kernels" tests
step calibrate 40 calibrate.log $PY scripts/calibrate_thresholds.py --backend cupy
step bench_gemm 100 bench_gemm.log \
    $PY bench/gemm.py --backend cupy --json "$OUT/bench_gemm.json"
step bench_attention 100 bench_attention.log \
    $PY bench/attention.py --backend cupy --json "$OUT/bench_attention.json"
step bench_sites 60 bench_sites.log \
    $PY bench/attention.py --backend cupy --sites --cases bert-base --repeats 10 \
    --json "$OUT/bench_attention_sites.json"
step bench_torch 60 bench_torch.log \
    $PY bench/torch_adapter.py --device cuda --json "$OUT/bench_torch_adapter.json"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || failed+=("nvidia-smi")

if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
