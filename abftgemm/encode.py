"""The checksum passes: predicted checksums from the operands, observed ones from the product."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from abftgemm.backend import Backend, array_module
from abftgemm.checksums import Checksums, location_weights
from abftgemm.operands import Operands


def predict(be: Backend, op: Operands, a_checksums: Checksums | None,
            b_checksums: Checksums | None) -> tuple[Any, Any]:
    """Predicted column and row checksums of ``a @ b (+ bias)``, float64 ``(batch, n|m, 5)``.

    Field 2 is ``S``, the predicted sum of ``|a||b|`` terms that scales the threshold.
    """
    xp = op.xp
    a_cols = a_checksums.cols if a_checksums is not None and a_checksums.cols is not None \
        else _reduce(be.col_reduce, op.a, None, op.a.shape[0], op.k)[..., :3]
    b_rows = b_checksums.rows if b_checksums is not None and b_checksums.rows is not None \
        else _reduce(be.row_reduce, op.b, None, op.b.shape[0], op.k)[..., :3]
    pred_col = _reduce(be.col_reduce, op.b, xp.ascontiguousarray(a_cols), op.batch, op.n)
    pred_row = _reduce(be.row_reduce, op.a, xp.ascontiguousarray(b_rows), op.batch, op.m)
    if op.bias is not None:
        bias = op.bias.astype(np.float64)
        m, n = op.m, op.n
        pred_col[..., 0] += m * bias
        pred_col[..., 1] += (m + 1) / 2 * bias  # sum of the location weights (i+1)/m
        pred_col[..., 2] += m * xp.abs(bias)
        pred_row[..., 0] += bias.sum()
        pred_row[..., 1] += (location_weights(n, xp) * bias).sum()
        pred_row[..., 2] += xp.abs(bias).sum()
    return pred_col, pred_row


def observe(be: Backend, out: Any) -> tuple[Any, Any]:
    """Column and row checksums of the delivered product, float64 ``(batch, n|m, 5)``."""
    batch, m, n = out.shape
    return (_reduce(be.col_reduce, out, None, batch, n), _reduce(be.row_reduce, out, None, batch, m))


def _reduce(fn: Callable, x: Any, coef: Any, batch: int, vectors: int) -> Any:
    xp = array_module(x)
    if coef is not None:
        batch = max(batch, x.shape[0], coef.shape[0])
    out = xp.empty((batch, vectors, 5), dtype=np.float64)
    fn(x, coef, out)
    return out
