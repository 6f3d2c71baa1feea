"""A process forked after the library ran numba's thread pool (PyTorch's Hogwild training,
``multiprocessing`` and ``ProcessPoolExecutor`` with ``fork``, servers that warm a model up and
fork workers): on GNU OpenMP, numba's default layer without TBB, the child cannot enter that pool
(numba terminates it), so the library runs the same compiled work outside it there
(``abftgemm.threads.numba_pool_usable``), with the parent's results to the bit."""
from __future__ import annotations

import numba
import pytest

from fresh_python import run_python

SCRIPT = """
import multiprocessing, pickle, sys
import numba
import numpy as np
import abftgemm
from abftgemm import threads
from abftgemm._cpu_gemm import gemm
from attention.context import Context
from attention.core import core_backward, core_forward

rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((3, 300, 64)).astype(np.float32) for _ in range(4))
a = rng.standard_normal((512, 256)).astype(np.float32)
b = rng.standard_normal((256, 128)).astype(np.float32)


distance = np.abs(np.arange(300)[:, None] - np.arange(300)[None, :])
window = np.where(distance < 100, 0.0, -np.inf)  # a sliding window: tiles it hides are skipped


def work():
    ctx = Context()
    # the fused core (its hidden tiles, its final checks)
    out, saved = core_forward(q, k, v, ctx, causal=True, attn_mask=window)
    grads = core_backward(saved, do, ctx)
    assert saved["core"] == "fused" and ctx.report.checked["fused:dK_out"], ctx.report.checked
    assert not ctx.report.events, ctx.report.summary()
    product = np.empty((512, 128), np.float32)
    with threads.blas_scope(numba_pool=True):
        gemm(a, b, product)
    return [out, *grads, product, abftgemm.matmul(a, b)], threads.numba_pool_usable()


def child(queue):
    queue.put(pickle.dumps(work()))


abftgemm.set_threads(2)
parent, usable = work()
assert usable
layer = numba.threading_layer()
assert layer in ("omp", "tbb", "workqueue"), layer
context = multiprocessing.get_context("fork")
queue = context.Queue()
process = context.Process(target=child, args=(queue,))
process.start()
results, usable = pickle.loads(queue.get(timeout=600))
process.join(60)
assert process.exitcode == 0, process.exitcode
gnu = False
if layer == "omp":
    from numba.np.ufunc import omppool
    gnu = getattr(omppool, "openmp_vendor", "GNU") == "GNU"
assert usable == (not gnu), (layer, usable)
# the fused core to the bit (the same compiled tasks), and the protected matmul (never in the
# pool); the pooled product is NumPy's in the child (another BLAS call order): within the
# rounding bound of a float32 product of this depth, as tests/test_cpu_gemm.py judges it
for got, want in zip(results[:4] + results[5:], parent[:4] + parent[5:]):
    assert np.array_equal(got, want)
exact = a.astype(np.float64) @ b.astype(np.float64)
bound = 4 * a.shape[1] * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b))
assert np.all(np.abs(results[4] - exact) <= bound)
print(layer, "pool usable in the child:", usable)
"""


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                    reason="numba's pool has one thread on this machine")
def test_a_forked_child_runs_the_parallel_kernels_outside_the_pool():
    run_python("-c", SCRIPT, timeout=900)
