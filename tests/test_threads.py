"""The library's CPU thread policy (abftgemm.threads): BLAS threads inside its calls, the
caller's setting restored and respected, numba's pool started only by the fused core and by
products large enough to split (tests/test_cpu_gemm.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController, threadpool_limits

import abftgemm
from abftgemm import threads
from attention import MultiHeadAttention
from fresh_python import run_python

CONTROLLER = ThreadpoolController()


def blas_threads() -> int:
    """NumPy's BLAS thread count now."""
    return min(c.get_num_threads() for c in CONTROLLER.select(user_api="blas").lib_controllers)


@pytest.fixture
def fixed():
    """Restore the automatic policy after a test that fixes a count."""
    yield threads.set_threads
    threads.set_threads(None)


def seen_inside(fn) -> list[int]:
    """The BLAS thread counts the fault hooks of ``fn(hook)`` saw (inside the library's calls)."""
    seen: list[int] = []
    fn(lambda site, c: seen.append(blas_threads()))
    return seen


def operands():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((64, 96)).astype(np.float32),
            rng.standard_normal((96, 80)).astype(np.float32))


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match="positive int or None"):
        abftgemm.set_threads(bad)


def test_fixed_count_holds_inside_matmul_and_the_callers_setting_comes_back(fixed):
    with threadpool_limits(2, user_api="blas"):
        fixed(1)
        a, b = operands()
        assert seen_inside(lambda hook: abftgemm.matmul(a, b, fault_hook=hook)) == [1]
        assert blas_threads() == 2
    assert abftgemm.get_threads() == 1


def test_fixed_count_holds_for_every_site_of_an_attention_pass(fixed):
    fixed(1)
    layer = MultiHeadAttention(32, 4, causal=True, dtype="float32", xp=np, seed=0)
    x = np.random.default_rng(1).standard_normal((2, 8, 32)).astype(np.float32)

    def both(hook):
        y, cache = layer.forward(x, fault_hook=hook)
        layer.backward(np.ones_like(y), cache, fault_hook=hook)
    with threadpool_limits(2, user_api="blas"):
        seen = seen_inside(both)
        assert len(seen) >= 16 and set(seen) == {1}
        assert blas_threads() == 2


def test_the_callers_lower_setting_is_kept(fixed):
    fixed(2)
    a, b = operands()
    with threadpool_limits(1, user_api="blas"):
        assert seen_inside(lambda hook: abftgemm.matmul(a, b, fault_hook=hook)) == [1]


def test_pytorch_threads_count_as_busy_cores():
    cores = threads._cores()
    assert threads.current_policy(torch_threads=cores) == 1
    assert threads.current_policy(torch_threads=cores + 5) == 1


def test_nested_scopes_keep_the_first_count(fixed):
    with threadpool_limits(2, user_api="blas"):
        fixed(1)
        with threads.blas_scope():
            fixed(2)
            with threads.blas_scope():
                assert blas_threads() == 1
            assert blas_threads() == 1
        assert blas_threads() == 2


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="needs Linux /proc")
def test_another_running_process_is_counted_and_our_own_threads_are_not():
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert max(threads._sample() for _ in range(20)) >= 1
    finally:
        burner.kill()
        burner.wait()


def test_numba_never_starts_its_thread_pool_for_small_products_outside_the_fused_core():
    code = ("import numpy as np, numba.np.ufunc.parallel as par\n"
            "from attention import MultiHeadAttention\n"
            "layer = MultiHeadAttention(32, 4, causal=True, dtype='float32', xp=np, seed=0,\n"
            "                           core='unfused')\n"
            "x = np.ones((2, 8, 32), np.float32)\n"
            "y, cache = layer.forward(x)\n"
            "layer.backward(np.ones_like(y), cache)\n"
            "assert layer.last_core == 'unfused', layer.last_core\n"
            "assert not par._is_initialized, 'numba started its thread pool'\n")
    run_python("-c", code)


def test_every_blas_runs_one_thread_inside_the_fused_core_and_the_setting_comes_back(fixed):
    """The fused core's tile products call SciPy's BLAS from numba's threads: every BLAS the
    process has loaded (SciPy's among them) is at one thread inside its kernels, whatever the
    policy and the caller's setting, and the caller's setting is back after."""
    import scipy.linalg.cython_blas  # noqa: F401  (loaded before the limit below, so it is set too)

    from attention.context import Context
    from attention.fused import fused_backward, fused_forward

    fixed(2)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 40, 16)).astype(np.float32) for _ in range(3))
    seen: list[dict[str, int]] = []

    def hook(site, tile):
        seen.append({c.filepath: c.get_num_threads()
                     for c in ThreadpoolController().select(user_api="blas").lib_controllers})
    with threadpool_limits(2, user_api="blas"):
        ctx = Context(fault_hook=hook)
        out, saved = fused_forward(q, k, v, ctx, causal=True)
        fused_backward(saved, np.ones_like(out), ctx)
        libs = ThreadpoolController().select(user_api="blas").lib_controllers
        assert {c.get_num_threads() for c in libs} == {2}
    assert seen and all(set(counts.values()) == {1} for counts in seen)
    assert {path for counts in seen for path in counts} == {c.filepath for c in libs}


def test_the_fused_core_runs_numba_at_the_policys_thread_count():
    code = ("import numpy as np, numba, numba.np.ufunc.parallel as par, abftgemm\n"
            "from attention import MultiHeadAttention\n"
            "abftgemm.set_threads(1)\n"
            "layer = MultiHeadAttention(32, 4, causal=True, dtype='float32', xp=np, seed=0)\n"
            "x = np.ones((2, 8, 32), np.float32)\n"
            "y, cache = layer.forward(x)\n"
            "layer.backward(np.ones_like(y), cache)\n"
            "assert layer.last_core == 'fused', layer.last_core\n"
            "assert par._is_initialized, 'the fused core did not run in numba pool'\n"
            "assert numba.get_num_threads() == 1, numba.get_num_threads()\n")
    run_python("-c", code)


def test_the_policy_holds_in_a_thread_other_than_the_first_to_set_it(fixed):
    """threadpoolctl lets one thread set a process-wide BLAS pool and ignores the others; the
    library's scopes set it from any thread: after the main thread has run them, another
    thread's calls still run their BLAS, and the fused core its tile products, at the policy's
    count (without this, at the full count: 2.6-4x slower fused calls)."""
    import threading

    import scipy.linalg.cython_blas  # noqa: F401  (loaded before the scopes, so it is set too)

    def inside() -> list[int]:
        counts = []
        with threads.one_blas_thread():
            counts.append(blas_threads())
        with threads.blas_scope():
            counts.append(blas_threads())
        return counts

    fixed(1)
    with threadpool_limits(2, user_api="blas"):
        assert inside() == [1, 1]  # the main thread first
        seen: list[list[int]] = []
        worker = threading.Thread(target=lambda: seen.append(inside()))
        worker.start()
        worker.join()
        assert seen == [[1, 1]]
        assert blas_threads() == 2


def test_numba_pool_launch_keeps_pytorchs_thread_count():
    """numba's OpenMP pool, as it starts, set the process's OpenMP thread count, which PyTorch
    reads: a user's ``torch.set_num_threads(1)`` became numba's pool size after the first
    fused-core call (8 under ``NUMBA_NUM_THREADS=8`` on 2 cores). In a new process, since the
    pool starts once."""
    pytest.importorskip("torch")
    run_python("-c", "import os; os.environ['NUMBA_NUM_THREADS'] = '4'; import torch; "
               "torch.set_num_threads(1); assert torch.get_num_threads() == 1; "
               "from attention.torch import MultiheadAttention; "
               "m = MultiheadAttention(64, 4, batch_first=True); x = torch.randn(2, 384, 64); "
               "m(x, x, x, need_weights=False); assert m.last_core == 'fused', m.last_core; "
               "assert torch.get_num_threads() == 1, torch.get_num_threads()")
