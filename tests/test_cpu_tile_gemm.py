"""The fused core's CPU tile products (attention._cpu_tile_gemm): BLAS on strided views, in
place, in pieces of rows, against float64 products; and the fused core with every piece size."""
from __future__ import annotations

import numpy as np
import pytest

from attention import _cpu_fused as K
from attention import fused
from attention._cpu_tile_gemm import gemm, gemm_rows
from attention.context import Context

SHAPES = [(128, 128, 64), (128, 64, 128), (100, 77, 33), (1, 5, 3), (5, 1, 3), (5, 3, 1)]


def _padded(rng: np.random.Generator, rows: int, cols: int, dtype: type, pad: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """A ``rows x cols`` view of a wider array (its rows ``pad`` elements apart more), and the
    array."""
    whole = rng.standard_normal((rows, cols + pad)).astype(dtype)
    return whole[:, :cols], whole


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("rows", [1, 16, 64, 128, 1000])
def test_gemm_matches_float64_products(dtype: type, trans_a: bool, beta: float, rows: int
                                       ) -> None:
    rng = np.random.default_rng(rows)
    u = np.finfo(dtype).eps / 2
    for m, n, k in SHAPES:
        a, _ = _padded(rng, k, m, dtype, 3) if trans_a else _padded(rng, m, k, dtype, 3)
        b, _ = _padded(rng, k, n, dtype, 2)
        c, c_whole = _padded(rng, m, n, dtype, 5)
        before, pad_before = c.copy(), c_whole[:, n:].copy()
        a_in, b_in = a.copy(), b.copy()
        gemm(a, b, c, beta, trans_a, rows)
        op_a = (a.T if trans_a else a).astype(np.float64)
        exact = op_a @ b.astype(np.float64) + beta * before
        bound = (k + 2) * u * (np.abs(op_a) @ np.abs(b.astype(np.float64)) + np.abs(before))
        assert np.all(np.abs(c - exact) <= bound), (m, n, k)
        assert np.array_equal(c_whole[:, n:], pad_before)  # nothing written past the view
        assert np.array_equal(a, a_in) and np.array_equal(b, b_in)


def test_gemm_empty_inner_dimension() -> None:
    c = np.full((3, 4), 7.0, np.float32)
    gemm(np.empty((3, 0), np.float32), np.empty((0, 4), np.float32), c, 1.0, False, 2)
    assert np.all(c == 7.0)
    gemm(np.empty((3, 0), np.float32), np.empty((0, 4), np.float32), c, 0.0, False, 2)
    assert np.all(c == 0.0)


def test_gemm_refuses_strided_overlapping_or_reversed_rows() -> None:
    c = np.zeros((4, 3), np.float32)
    b = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="rows are not contiguous"):
        gemm(np.ones((4, 8), np.float32)[:, ::2], b, c, 0.0, False, 4)
    for a in (np.ones((4, 4), np.float32)[::-1], np.broadcast_to(np.ones(4, np.float32), (4, 4))):
        with pytest.raises(ValueError, match="rows overlap or run backwards"):
            gemm(a, b, c, 0.0, False, 4)
    assert np.all(c == 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_rows_is_a_tile_or_its_half_or_quarter(dtype: type) -> None:
    assert gemm_rows(np.dtype(dtype), 64, K.BR) in (K.BR, K.BR // 2, K.BR // 4)


@pytest.mark.parametrize("rows", [K.BR, 48, 16])
def test_fused_core_with_every_piece_size(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever rows per BLAS call were measured fastest, the fused core's outputs and gradients
    match float64 attention and no check flags."""
    monkeypatch.setattr(fused, "gemm_rows", lambda dtype, d, tile: rows)
    rng = np.random.default_rng(7)
    n, lq, lk, d = 2, 200, 150, 40
    q = rng.standard_normal((n, lq, d)).astype(np.float32)
    k, v = (rng.standard_normal((n, lk, d)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal((n, lq, d)).astype(np.float32)
    ctx = Context(check="correct")
    out, saved = fused.fused_forward(q, k, v, ctx)
    dq, dk, dv = fused.fused_backward(saved, d_out, ctx)
    assert ctx.report.events == []
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, d_out))
    s = q64 @ k64.transpose(0, 2, 1) / np.sqrt(d)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    dp = do64 @ v64.transpose(0, 2, 1)
    ds = p * (dp - (dp * p).sum(axis=2, keepdims=True)) / np.sqrt(d)
    expected = (p @ v64, ds @ k64, ds.transpose(0, 2, 1) @ q64, p.transpose(0, 2, 1) @ do64)
    for got, want in zip((out, dq, dk, dv), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
