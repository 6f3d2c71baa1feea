#!/usr/bin/env bash
# GPU acceptance run, from the repository root on a machine with an NVIDIA GPU:
#   OUT=/some/dir PYTHONPATH=. bash scripts/gpu_check.sh
# Runs the CuPy smoke check, the GPU test cases (the fused core's apart, last: NVRTC compiles its
# kernels for 30-60 s per element type on a fresh machine), then the benchmarks and the
# calibration (most important first); keeps going when a step fails, and exits non-zero if any did.
# The fused core's GPU tests compare with the CPU cores on NumPy data, whose numba kernels a fresh
# machine compiles for minutes: scripts/warm_cpu_kernels.py compiles them in the background, on the
# spare cores, from the start of the run, into a numba cache of their own (NUMBA_CACHE_DIR, outside
# $OUT, so that no other step writes to it meanwhile); the pytest_fused step waits for it (at most
# until 60 s before the run's end, then stops it), logs its output or its failure, and runs with
# that cache.
#
# Sized for a short device lease (15 minutes, machine starts included: a full run, then a second
# run of what the first had no time for):
# - the whole run ends within GPU_CHECK_SECONDS (default 480): each step gets its own timeout,
#   cut to what is left, and a step with less than 20 s left is skipped (and reported);
# - GPU_CHECK_STEPS (default: all, in the order below) picks steps by name, so a second run can do
#   what a first one had no time for, e.g. GPU_CHECK_STEPS="bench_sites bench_torch";
# - everything is written to 5 files at most (the device tool returns 8): gpu_check.log (every
#   step's output, nvidia-smi first, the numba warm-up's before pytest_fused) and the benchmarks'
#   JSON files, each rewritten as it goes.
# On an H200 (2026-12-04) the smoke check took 22 s, calibrate 35 s, bench_gemm 14 s and
# bench_attention, bench_torch and bench_fused 30-60 s each; the GPU tests ran 378 cases in 240 s,
# most of it compiling the fused kernels (bench/NOTES.md).
set -u

OUT="${OUT:-./gpu_check_out}"
PY="${PYTHON:-python3}"
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1
# 30 examples per property: the device time is short, and CI runs the CPU cases with 300.
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}"
STEPS=" ${GPU_CHECK_STEPS:-smoke pytest pytest_rest pytest_fused bench_fused clean_calls bench_attention bench_torch calibrate bench_gemm bench_sites smoke_softmax} "
END=$((SECONDS + ${GPU_CHECK_SECONDS:-480}))
LOG="$OUT/gpu_check.log"
mkdir -p "$OUT"
: > "$LOG"
failed=()
skipped=()

{ echo "=== nvidia-smi"; nvidia-smi; echo "=== git"; git log -1 --oneline 2>/dev/null; } \
    2>&1 | tee -a "$LOG"

# The CPU kernels of pytest_fused's NumPy comparisons, compiled meanwhile (header); the output goes
# to the log when pytest_fused waits for it.
WARM_PID=""
WARM_CACHE="${TMPDIR:-/tmp}/abftgemm-gpu-check-numba"
case "$STEPS" in
    *" pytest_fused "*)
        WARM_LOG=$(mktemp)
        NUMBA_CACHE_DIR="$WARM_CACHE" $PY scripts/warm_cpu_kernels.py > "$WARM_LOG" 2>&1 &
        WARM_PID=$!
        trap '[ -n "$WARM_PID" ] && kill "$WARM_PID" 2>/dev/null' EXIT
        ;;
esac

# wait_warm: wait for the warm-up (until 60 s before the run's end at most, then stop it), log its
# output and how it ended; a failure is counted as a failed step, and the run goes on.
wait_warm() {
    [ -n "$WARM_PID" ] || return
    while kill -0 "$WARM_PID" 2>/dev/null && [ $((END - SECONDS)) -gt 60 ]; do
        sleep 1
    done
    local how="done"
    if kill -0 "$WARM_PID" 2>/dev/null; then
        kill "$WARM_PID"
        how="STOPPED (60 s left of the run): pytest_fused compiles the rest"
    fi
    wait "$WARM_PID"
    local rc=$?
    WARM_PID=""
    if [ "$how" = "done" ] && [ "$rc" -ne 0 ]; then
        how="FAILED (exit $rc): pytest_fused compiles what it lacks"
        failed+=("warm_cpu_kernels")
    fi
    { echo "=== warm_cpu_kernels (background, $how at ${SECONDS}s)"; cat "$WARM_LOG"; } \
        2>&1 | tee -a "$LOG"
    rm -f "$WARM_LOG"
}

# step NAME SECONDS COMMAND...: run COMMAND (if NAME was asked for) under a timeout of SECONDS or
# what is left of the run, whichever is less. SIGINT first, so that pytest still prints its
# summary of failures; SIGKILL 15 s later.
step() {
    local name=$1 seconds=$2
    shift 2
    case "$STEPS" in *" $name "*) ;; *) return ;; esac
    local left=$((END - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "=== $name SKIPPED (${left}s left of the run)" | tee -a "$LOG"
        skipped+=("$name")
        return
    fi
    [ "$seconds" -gt "$left" ] && seconds=$left
    echo "=== $name (timeout ${seconds}s, started at ${SECONDS}s)" | tee -a "$LOG"
    timeout -s INT --kill-after=15 "$seconds" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "=== $name FAILED (exit $rc)" | tee -a "$LOG"
        failed+=("$name")
    fi
}

# The smoke check compiles the GEMM kernels (NVRTC, CuPy's cache starts empty).
step smoke 60 $PY scripts/cuda_smoke.py
# Every test body parametrized with xp=cupy or device=cuda (the NVRTC compile test runs in CI, the
# CPU sanitizer's own tests are CI's); with pytest-timeout, no single test may hang a step; without
# it, faulthandler prints every thread's stack when a test has run for 60 s (a kernel that never
# returns, or NVRTC compiling, ignores SIGINT). The fused core's tests come last.
PER_TEST=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout=120")
GPU_TESTS="(cupy or cuda) and not compiles and not cuda_on_cpu"
# The files that had not run on a GPU longest come first, in a step of their own.
FIRST=""
for f in test_matmul test_plan test_numpy_semantics test_nonfinite test_thresholds test_warnings \
         test_softmax_checks test_passes test_torch_matmul test_torch_attention; do
    FIRST="$FIRST tests/$f.py"
done
ABFT_REQUIRE_GPU=1 step pytest 150 $PY -m pytest -q -rfE --maxfail=25 -p no:cacheprovider \
    -o faulthandler_timeout=60 $PER_TEST -k "$GPU_TESTS and not fused" $FIRST
ABFT_REQUIRE_GPU=1 step pytest_rest 150 $PY -m pytest -q -rfE --maxfail=25 -p no:cacheprovider \
    -o faulthandler_timeout=60 $PER_TEST -k "$GPU_TESTS and not fused" \
    $(for f in $FIRST; do echo "--ignore=$f"; done) tests
wait_warm
ABFT_REQUIRE_GPU=1 NUMBA_CACHE_DIR="$WARM_CACHE" step pytest_fused 240 $PY -m pytest -q -rfE \
    --maxfail=25 -p no:cacheprovider -o faulthandler_timeout=90 $PER_TEST \
    -k "$GPU_TESTS and fused" tests
# The fused core's CUDA kernels: fwd+bwd against the unfused core and PyTorch's flash SDPA,
# BERT-base and Llama-like shapes, float16.
step bench_fused 90 $PY bench/fused_cuda.py --repeats 10
# The fused CUDA kernels' false positives: clean calls on adversarial data (logits near overflow
# and far beyond, flat rows, key padding, a head without keys, additive masks, dropout), a
# minute's worth.
step clean_calls 75 $PY scripts/fused_clean_calls.py --backend cupy --calls 1000 --max-len 512 \
    --long-calls 1000 --long-len 4096 --minutes 1
step bench_attention 100 $PY bench/attention.py --backend cupy --json "$OUT/bench_attention.json"
step bench_torch 60 $PY bench/torch_adapter.py --device cuda --json "$OUT/bench_torch_adapter.json"
step calibrate 40 $PY scripts/calibrate_thresholds.py --backend cupy
step bench_gemm 100 $PY bench/gemm.py --backend cupy --json "$OUT/bench_gemm.json"
step bench_sites 60 $PY bench/attention.py --backend cupy --sites --cases bert-base --repeats 10 \
    --json "$OUT/bench_attention_sites.json"
# The softmax kernels against plain CuPy arithmetic (their tests run in the pytest step).
step smoke_softmax 120 $PY scripts/cuda_smoke_softmax.py
echo "=== done at ${SECONDS}s" | tee -a "$LOG"
[ ${#skipped[@]} -ne 0 ] && echo "SKIPPED steps (no time left): ${skipped[*]}" | tee -a "$LOG"
if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED steps: ${failed[*]}" | tee -a "$LOG"
    exit 1
fi
echo "all steps run passed" | tee -a "$LOG"
