"""The layer's head split and merge on the CPU (attention._cpu_heads): in numba's pool, serially
and by NumPy, the same bits, from and into any column block of a wider matrix, in every dtype;
each touches nothing outside its columns."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from abftgemm import threads
from attention import _cpu_heads as H

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


def _ways(monkeypatch: pytest.MonkeyPatch, way: str):
    """A context in which :mod:`attention._cpu_heads` copies ``way``: "pool", "serial" (its
    twins) or "numpy" (outside a pooled scope)."""
    if way == "serial":
        monkeypatch.setattr(H, "pool_kernels", lambda parallel, serial: serial)
    return threads.blas_scope(numba_pool=way != "numpy")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("way", ["pool", "serial", "numpy"])
@pytest.mark.parametrize("col0", [0, 24])
def test_split_and_merge_move_each_head_to_and_from_its_columns(dtype, way, col0, monkeypatch):
    n, h, seq, d = 3, 4, 160, 40  # 76,800 elements: from POOL_MIN_ELEMENTS on
    assert n * h * seq * d >= H.POOL_MIN_ELEMENTS
    rng = np.random.default_rng(0)
    width = col0 + h * d + 8
    rows = rng.standard_normal((n * seq, width)).astype(dtype)
    heads = np.full((n, h, seq, d), np.nan, dtype)
    block = rows[:, col0:col0 + h * d].reshape(n, seq, h, d)
    with _ways(monkeypatch, way):
        H.split_heads(rows, col0, heads)
    for j in range(h):
        assert np.array_equal(heads[:, j].view(np.uint8), block[:, :, j].view(np.uint8))
    back = rows.copy()
    back[:, col0:col0 + h * d] = np.nan
    with _ways(monkeypatch, way):
        H.merge_heads(heads, back, col0)
    assert np.array_equal(back.view(np.uint8), rows.view(np.uint8))  # outside columns too


def test_only_large_c_contiguous_numpy_copies_run_in_the_pool(monkeypatch):
    calls = []
    monkeypatch.setattr(H, "pool_kernels", lambda parallel, serial: calls.append(1) or serial)
    heads = np.zeros((2, 4, 128, 64), np.float32)
    rows = np.ones((256, 256), np.float32)
    with threads.blas_scope(numba_pool=True):
        H.split_heads(rows, 0, heads)
        H.split_heads(rows[:, ::-1], 0, heads)  # not C-contiguous: NumPy
        H.split_heads(rows[:16], 0, heads[:, :, :8])  # small: NumPy
    with threads.blas_scope(numba_pool=False):
        H.split_heads(rows, 0, heads)
    assert calls == [1] and np.all(heads == 1)
