"""The CPU's GEMMs (abftgemm._cpu_gemm): BLAS from numba on strided views, transposed or not, in
place, in pieces of rows, against float64 products; large 2-D products split over numba's pool
equal NumPy's product in every layout and dtype it takes, everything else goes to
``np.matmul``, and only the attention passes that run the fused core ask for the pool."""
from __future__ import annotations

import numba
import numpy as np
import pytest

from abftgemm import _cpu_gemm, threads
from abftgemm.cpu_kernels import blas_gemm
from fresh_python import run_python

needs_two = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                               reason="numba's pool has one thread on this machine")


SHAPES = [(128, 128, 64), (128, 64, 128), (100, 77, 33), (1, 5, 3), (5, 1, 3), (5, 3, 1)]


def _padded(rng: np.random.Generator, rows: int, cols: int, dtype: type, pad: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """A ``rows x cols`` view of a wider array (its rows ``pad`` elements apart more), and the
    array."""
    whole = rng.standard_normal((rows, cols + pad)).astype(dtype)
    return whole[:, :cols], whole


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("rows", [1, 16, 64, 128, 1000])
def test_blas_gemm_matches_float64_products(dtype: type, trans_a: bool, trans_b: bool,
                                            beta: float, rows: int) -> None:
    rng = np.random.default_rng(rows)
    u = np.finfo(dtype).eps / 2
    for m, n, k in SHAPES:
        a, _ = _padded(rng, k, m, dtype, 3) if trans_a else _padded(rng, m, k, dtype, 3)
        b, _ = _padded(rng, n, k, dtype, 2) if trans_b else _padded(rng, k, n, dtype, 2)
        c, c_whole = _padded(rng, m, n, dtype, 5)
        before, pad_before = c.copy(), c_whole[:, n:].copy()
        a_in, b_in = a.copy(), b.copy()
        blas_gemm(a, b, c, beta, trans_a, trans_b, rows)
        op_a = (a.T if trans_a else a).astype(np.float64)
        op_b = (b.T if trans_b else b).astype(np.float64)
        exact = op_a @ op_b + beta * before
        bound = (k + 2) * u * (np.abs(op_a) @ np.abs(op_b) + np.abs(before))
        assert np.all(np.abs(c - exact) <= bound), (m, n, k)
        assert np.array_equal(c_whole[:, n:], pad_before)  # nothing written past the view
        assert np.array_equal(a, a_in) and np.array_equal(b, b_in)


def test_blas_gemm_empty_inner_dimension() -> None:
    c = np.full((3, 4), 7.0, np.float32)
    a, b = np.empty((3, 0), np.float32), np.empty((0, 4), np.float32)
    blas_gemm(a, b, c, 1.0, False, False, 2)
    assert np.all(c == 7.0)
    blas_gemm(a, b, c, 0.0, False, False, 2)
    assert np.all(c == 0.0)


def test_blas_gemm_refuses_strided_overlapping_or_reversed_rows() -> None:
    c = np.zeros((4, 3), np.float32)
    b = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="rows are not contiguous"):
        blas_gemm(np.ones((4, 8), np.float32)[:, ::2], b, c, 0.0, False, False, 4)
    for a in (np.ones((4, 4), np.float32)[::-1], np.broadcast_to(np.ones(4, np.float32), (4, 4))):
        with pytest.raises(ValueError, match="rows overlap or run backwards"):
            blas_gemm(a, b, c, 0.0, False, False, 4)
    assert np.all(c == 0.0)


@pytest.fixture
def two_threads():
    threads.set_threads(2)
    yield
    threads.set_threads(None)


def operands(dtype, m, k, n, a_order="C", b_order="C", seed=0):
    """``a`` and ``b`` C- or F-contiguous, or ("rows apart", "columns apart") views of a wider
    array whose rows (columns) are contiguous and further apart than their length."""
    rng = np.random.default_rng(seed)
    return tuple(_laid_out(rng.standard_normal(shape).astype(dtype), order)
                 for shape, order in (((m, k), a_order), ((k, n), b_order)))


def _laid_out(x, order):
    if order == "rows apart":
        return np.concatenate([x, x[:, :3]], axis=1)[:, :x.shape[1]]
    if order == "columns apart":
        return _laid_out(x.T, "rows apart").T
    return np.asarray(x, order=order)


@pytest.fixture
def pooled_calls(monkeypatch):
    """The calls that reached numba's pool (``_cpu_gemm._row_blocks``), which still runs."""
    calls: list[int] = []
    run = _cpu_gemm._row_blocks

    def spy(a, trans_a, b, trans_b, out, step):
        calls.append(step)
        run(a, trans_a, b, trans_b, out, step)
    monkeypatch.setattr(_cpu_gemm, "_row_blocks", spy)
    return calls


def product(a, b, out):
    with threads.blas_scope(numba_pool=True):
        _cpu_gemm.gemm(a, b, out)
    return out


def assert_product(a, b, out):
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = 4 * a.shape[1] * np.finfo(a.dtype).eps * (np.abs(a) @ np.abs(b))
    assert np.all(np.abs(out - exact) <= bound)


@needs_two
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("a_order", ["C", "F", "rows apart", "columns apart"])
@pytest.mark.parametrize("b_order", ["C", "F", "rows apart", "columns apart"])
@pytest.mark.parametrize("m", [97, 256])
def test_pooled_product_equals_the_exact_one(two_threads, pooled_calls, dtype, a_order, b_order,
                                            m):
    a, b = operands(dtype, m, 150, 70, a_order, b_order)
    assert_product(a, b, product(a, b, np.full((m, 70), np.nan, dtype)))
    assert pooled_calls == [-(-m // 2)]


@needs_two
@pytest.mark.parametrize("case", ["small", "few rows", "float16", "mixed", "strided out",
                                  "strided a", "out is a"])
def test_what_the_pool_cannot_take_goes_to_numpy_and_is_right(two_threads, pooled_calls, case):
    a, b = operands(np.float32, 128, 128, 128)
    out = np.zeros((128, 128), np.float32)
    if case == "small":
        a, b, out = a[:8, :8], b[:8, :8], out[:8, :8].copy()
    elif case == "few rows":
        a, out = a[:20], out[:20]
    elif case == "float16":
        a, b, out = a.astype(np.float16), b.astype(np.float16), out.astype(np.float16)
    elif case == "mixed":
        b = b.astype(np.float64)
        out = out.astype(np.float64)
    elif case == "strided out":
        out = np.empty((128, 256), np.float32)[:, ::2]
    elif case == "strided a":
        a = np.concatenate([a, a], axis=1)[:, ::2]
    elif case == "out is a":
        expected = a @ b
        assert np.array_equal(product(a, b, a), expected)
    else:
        expected = (a.astype(np.float64) @ b.astype(np.float64)).astype(out.dtype)
        np.testing.assert_allclose(product(a, b, out), expected, rtol=1e-2 if case == "float16"
                                   else 1e-4, atol=1e-2 if case == "float16" else 1e-3)
    assert pooled_calls == []


@needs_two
@pytest.mark.parametrize("case", ["a rows on one address", "b rows on one address",
                                  "b columns on one address"])
def test_an_inner_dimension_of_one_read_through_a_zero_stride_goes_to_numpy(
        two_threads, pooled_calls, case):
    """Outer products (inner dimension 1) of broadcast views: a zero stride is neither
    contiguous rows nor contiguous columns, whichever dimension it is on (the pool once took such
    an operand, which its BLAS call then refused)."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((1024, 1)).astype(np.float32)
    b = rng.standard_normal((1, 1024)).astype(np.float32)
    if case == "a rows on one address":
        a = np.broadcast_to(np.float32(3.0), (1024, 1))
    elif case == "b rows on one address":
        b = np.broadcast_to(np.float32(2.0), (1, 1024))
    else:
        b = np.broadcast_to(b[:, :1], (1, 1024))
    out = product(a, b, np.full((1024, 1024), np.nan, np.float32))
    assert np.array_equal(out, a @ b)
    assert pooled_calls == []


@needs_two
def test_large_products_run_in_numbas_pool_only_where_the_scope_asks_at_the_policys_count():
    code = ("import numpy as np, numba, numba.np.ufunc.parallel as par, abftgemm\n"
            "from abftgemm import threads\n"
            "from abftgemm._cpu_gemm import gemm\n"
            "a = np.ones((512, 256), np.float32); b = np.ones((256, 128), np.float32)\n"
            "out = np.empty((512, 128), np.float32)\n"
            "abftgemm.set_threads(2)\n"
            "assert (abftgemm.matmul(a, b) == 256).all()\n"
            "assert not par._is_initialized, 'abftgemm.matmul started numba pool'\n"
            "abftgemm.set_threads(1)\n"
            "with threads.blas_scope(numba_pool=True):\n"
            "    gemm(a, b, out)\n"
            "assert (out == 256).all() and not par._is_initialized, 'one thread started it'\n"
            "abftgemm.set_threads(2)\n"
            "with threads.blas_scope(numba_pool=True):\n"
            "    out[:] = 0\n"
            "    gemm(a, b, out)\n"
            "assert (out == 256).all() and par._is_initialized, 'the product ran outside it'\n"
            "assert numba.get_num_threads() == 2\n")
    run_python("-c", code)


@pytest.mark.parametrize("core", ["fused", "unfused"])
def test_an_attention_pass_asks_for_the_pool_when_it_runs_the_fused_core(core):
    from attention import MultiHeadAttention

    layer = MultiHeadAttention(32, 4, causal=True, dtype="float32", xp=np, seed=0, core=core)
    x = np.random.default_rng(1).standard_normal((2, 8, 32)).astype(np.float32)
    seen: list[bool] = []

    def hook(site, c):
        seen.append(threads.scope_pool())
    y, cache = layer.forward(x, fault_hook=hook)
    layer.backward(np.ones_like(y), cache, fault_hook=hook)
    assert layer.last_core == core
    assert len(seen) >= 4 and set(seen) == {core == "fused"}
    assert not threads.scope_pool()
