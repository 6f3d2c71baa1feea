"""The fused core's CPU tile products (attention._cpu_tile_gemm): the rows per BLAS call it
measures, and the fused core with every piece size."""
from __future__ import annotations

import numpy as np
import pytest

from attention import _cpu_fused as K
from attention import fused
from attention._cpu_tile_gemm import gemm_rows
from attention.context import Context


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
