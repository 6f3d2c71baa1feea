"""The checksum passes: predicted checksums from the operands, observed ones from the product,
and :func:`checksums_of`, the encodings of any array to hand on."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from abftgemm.backend import Backend, array_module, get_backend
from abftgemm.checksums import Checksums, encoding_of, location_weights
from abftgemm.operands import Operands, float_dtype


def predict(be: Backend, op: Operands, a_checksums: Checksums | None) -> tuple[Any, Any]:
    """Predicted column and row checksums of ``a @ b (+ bias)``, float64 ``(batch, n|m, 5)``;
    field 2 is ``S``, the sum of ``|a||b|`` terms that scales the threshold. Passes: ``b`` for its
    row encoding, ``a`` for its column encoding and the row checksums, ``b`` for the column ones."""
    b_rows = _row_encoding_of_b(be, op)
    a_cols = None if a_checksums is None else a_checksums.cols
    if a_cols is None:
        # op.batch, not max(a's, b's): an empty batch broadcasts a b of batch 1
        enc_a, pred_row = (op.xp.empty((op.batch, v, 5), dtype=np.float64) for v in (op.k, op.m))
        be.both_reduce(op.a, None, b_rows, enc_a, pred_row)
        a_cols = encoding_of(enc_a)
    else:
        pred_row = _reduce(be.row_reduce, op.a, b_rows, op.batch, op.m)
    pred_col = _reduce(be.col_reduce, op.b, a_cols, op.batch, op.n)
    if op.bias is not None:
        bias, m = op.bias.astype(np.float64), op.m
        pred_col[..., 0] += m * bias
        # the sum of the location weights (i+1)/m: (m+1)/2, and 0 without rows (no bias term)
        pred_col[..., 1] += ((m + 1) / 2 if m else 0.0) * bias
        pred_col[..., 2] += m * op.xp.abs(bias)
        _add_bias_to_rows(op, pred_row)
    return pred_col, pred_row


def predict_rows(be: Backend, op: Operands) -> Any:
    """Predicted row checksums only, float64 ``(batch, m, 5)`` (reads ``b``, then ``a``)."""
    pred_row = _reduce(be.row_reduce, op.a, _row_encoding_of_b(be, op), op.batch, op.m)
    if op.bias is not None:
        _add_bias_to_rows(op, pred_row)
    return pred_row


def _row_encoding_of_b(be: Backend, op: Operands) -> Any:
    """``b``'s row encoding ``(3, batch or 1, k)``, contiguous: one pass over ``b``."""
    return encoding_of(_reduce(be.row_reduce, op.b, None, op.b.shape[0], op.k))


def _add_bias_to_rows(op: Operands, pred_row: Any) -> None:
    bias, xp = op.bias.astype(np.float64), op.xp
    pred_row[..., 0] += bias.sum()
    pred_row[..., 1] += (location_weights(op.n, xp) * bias).sum()
    pred_row[..., 2] += xp.abs(bias).sum()


def observe(be: Backend, out: Any) -> tuple[Any, Any]:
    """Column and row checksums of the delivered product (one read), float64 ``(batch, n|m, 5)``."""
    xp = array_module(out)
    batch, m, n = out.shape
    obs_col, obs_row = (xp.empty((batch, v, 5), dtype=np.float64) for v in (n, m))
    be.both_reduce(out, None, None, obs_col, obs_row)
    return obs_col, obs_row


def _reduce(fn: Callable, x: Any, coef: Any, batch: int, vectors: int) -> Any:
    out = array_module(x).empty((batch, vectors, 5), dtype=np.float64)
    fn(x, coef, out)
    return out


def checksums_of(x: Any, rows: bool = True) -> Checksums:
    """Column and (unless ``rows=False``) row encodings of ``x`` (``(..., r, c)``, batch
    flattened), to pass to matmul. ``x`` has one of :data:`abftgemm.SUPPORTED_DTYPES` (else
    ``TypeError``).

    Use it to encode an operand once and reuse it across several products (e.g. the input of the
    query, key and value projections, whose column encoding is all they need).
    """
    xp = array_module(x)  # a TypeError for what is not an array
    if x.ndim < 2:
        raise ValueError(f"checksums_of needs a matrix or a batch of matrices, got shape {x.shape}")
    dtype = float_dtype("x", x, "checksums_of")
    if x.dtype != dtype:  # as matmul takes it: in native byte order
        x = x.astype(dtype)
    r, c = x.shape[-2:]
    x3 = x.reshape(int(np.prod(x.shape[:-2], dtype=np.int64)), r, c)  # -1: ambiguous at size 0
    be = get_backend(xp)
    if not rows:
        return Checksums(cols=encoding_of(_reduce(be.col_reduce, x3, None, x3.shape[0], c)))
    cols, row_sums = observe(be, x3)
    return Checksums(cols=encoding_of(cols), rows=encoding_of(row_sums))
