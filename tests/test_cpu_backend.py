"""CPU-backend details that the backend-generic tests do not reach."""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from abftgemm import _cpu, cpu_kernels


def test_float16_upcast_is_bit_exact_for_every_pattern_and_layout():
    """The float16 lookup table gives exactly NumPy's conversion, NaN payloads and signed zeros
    included, for contiguous and strided inputs."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    for x in (every, every.reshape(256, 256)[:, ::3], every.reshape(16, 64, 64).transpose(0, 2, 1)):
        got = cpu_kernels.as_float32(x)
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_array_equal(got.view(np.uint32), x.astype(np.float32).view(np.uint32))


def test_a_product_sharing_one_b_is_exact_in_every_layout():
    """``gemm`` runs a batch of ``a`` that shares one ``b`` (a projection's weight) as one 2-D
    product when ``a`` and ``out`` are stacks of rows; in every other layout as NumPy's batched
    product. Both give the exact product (small integers), and nothing outside ``out`` is
    written."""
    rng = np.random.default_rng(3)
    a = rng.integers(-3, 4, (4, 24, 16)).astype(np.float32)
    b = rng.integers(-3, 4, (1, 16, 8)).astype(np.float32)
    want = a @ b
    a_views = {"stacked": a, "transposed": a.transpose(0, 2, 1).copy().transpose(0, 2, 1),
               "strided rows": np.repeat(a, 2, axis=1)[:, ::2]}
    for name, a_view in a_views.items():
        for b_view in (b, b[0]):
            stacked = np.full((4, 24, 8), np.nan, np.float32)
            padded = np.full((4, 30, 8), np.nan, np.float32)  # batch stride of 30 rows
            for out in (stacked, padded[:, :24]):
                _cpu.backend().gemm(a_view, b_view, out, None)
                np.testing.assert_array_equal(out, want, err_msg=name)
            assert np.isnan(padded[:, 24:]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_all_finite_agrees_with_numpy_on_every_kind_of_bit_pattern(dtype):
    """The exponent-bit test of ``all_finite`` says what ``np.isfinite`` says of one value in a
    clean array: every 16-bit pattern; random 32- and 64-bit ones and those at the edges of the
    exponent (largest finite, INF, NaNs, negative ones)."""
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    unsigned = np.dtype(f"u{dt.itemsize}")
    rng = np.random.default_rng(7)
    if dt.itemsize == 2:  # every pattern
        patterns = np.arange(1 << 16, dtype=unsigned)
    else:  # random patterns, and those next to the exponent's edges
        top = np.array(np.inf, dt).view(unsigned)[()]
        edges = np.array([0, 1, top - 1, top, top + 1, ~unsigned.type(0)], unsigned)
        sign = ~(~unsigned.type(0) >> unsigned.type(1))
        patterns = np.concatenate([rng.integers(0, np.iinfo(unsigned).max, 20000, unsigned,
                                                endpoint=True), edges, edges | sign])
    values = patterns.view(dt)
    with np.errstate(invalid="ignore"):  # casting bfloat16 NaNs
        finite = np.isfinite(values.astype(np.float32) if dt.itemsize == 2 else values)
    clean = np.ones((3, 5), dt)
    for value, expected in zip(values, finite):
        x = clean.copy()
        x[2, 3] = value
        assert cpu_kernels.all_finite(x) == expected, (dtype, value)
    assert cpu_kernels.all_finite(values[finite]) and not cpu_kernels.all_finite(values)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("pool", [True, False])
def test_all_finite_of_a_large_array_finds_one_bad_value_anywhere(dtype, pool, monkeypatch):
    """From ``POOL_MIN_SCAN`` elements the scan runs in parts (in numba's pool, or their serial
    twin where the pool cannot be entered): one INF or NaN is found wherever it lies, the first
    and last element and those next to every part's edges included, at sizes the parts do not
    divide."""
    if not pool:
        monkeypatch.setattr(cpu_kernels, "pool_kernels", lambda parallel, serial: serial)
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    for size in (cpu_kernels.POOL_MIN_SCAN, cpu_kernels.POOL_MIN_SCAN * 3 + 7):
        x = np.ones(size, dt)
        assert cpu_kernels.all_finite(x)
        part = -(-size // cpu_kernels._SCAN_PARTS)
        edges = sorted({0, size - 1} | {min(size - 1, max(0, t * part + o))
                                        for t in range(1, cpu_kernels._SCAN_PARTS + 1)
                                        for o in (-1, 0)})
        for i, bad in zip(edges, itertools.cycle((np.inf, -np.inf, np.nan))):
            x[i] = bad
            assert not cpu_kernels.all_finite(x), (size, i)
            assert not cpu_kernels.all_finite(x.reshape(-1, 1)), (size, i)
            x[i] = 1


def test_all_finite_reads_non_contiguous_and_other_arrays_through_numpy():
    """Strided views are judged on their own elements; integer and empty arrays are finite."""
    x = np.ones((4, 6), np.float32)
    x[1, 1] = np.nan
    assert cpu_kernels.all_finite(x[:, ::2])  # the NaN is in a skipped column
    assert not cpu_kernels.all_finite(x[:, 1::2])
    assert cpu_kernels.all_finite(np.arange(5)) and cpu_kernels.all_finite(np.zeros(0))
