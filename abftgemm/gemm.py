"""Protected matrix product: encode -> GEMM -> verify -> locate -> correct (or recompute).

Everything here is array-module generic; the heavy passes are the backend's four primitives
(:mod:`abftgemm.backend`). The fast path (no fault) costs one GEMM, one reduction of each operand
per check direction (fewer when checksums are passed in) and one reduction of the product per
direction, and a single device-to-host transfer of three counts.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from abftgemm.backend import Backend, array_module, get_backend
from abftgemm.checksums import Checksums
from abftgemm.encode import observe, predict
from abftgemm.locate import diagnose, verify
from abftgemm.operands import Operands
from abftgemm.repair import repair_batch
from abftgemm.report import Report

FaultHook = Callable[[str, Any], None]
CHECK_MODES = ("correct", "detect", "off")


def matmul(a: Any, b: Any, *, bias: Any | None = None, check: str = "correct",
           fault_hook: FaultHook | None = None, name: str = "matmul",
           return_report: bool = False, a_checksums: Checksums | None = None,
           b_checksums: Checksums | None = None, return_checksums: bool = False) -> Any:
    """Checksum-protected ``a @ b``: a drop-in for ``xp.matmul`` that detects and corrects faults.

    Parameters
    ----------
    a : array (..., m, k) or (k,)
        NumPy or CuPy array of float16, bfloat16 (ml_dtypes), float32 or float64.
    b : array (..., k, n) or (k,)
        Same array module and dtype as ``a``; batch dimensions broadcast as in ``matmul``.
    bias : array (n,), optional
        Added to every row of the product, inside the protection (``a @ b + bias``).
    check : {"correct", "detect", "off"}
        ``"correct"``: detect, locate, repair from checksums, recompute what they cannot repair,
        raise :class:`UncorrectableError` if no correct result can be delivered. ``"detect"``:
        report, never modify. ``"off"``: the plain product.
    fault_hook : callable ``(site, c)``, optional
        Called with ``name`` and the raw product, shape ``(..., m, n)``, after the GEMM and before
        verification; it may modify ``c`` in place (fault injection).
    name : str
        Site name used in reports and passed to ``fault_hook``.
    return_report : bool
        Also return the :class:`Report`.
    a_checksums, b_checksums : Checksums, optional
        Encodings handed on from earlier products: ``a_checksums.cols`` (column encoding of ``a``)
        and ``b_checksums.rows`` (row encoding of ``b``) replace the encoding passes over the
        operands. Batch dimensions are flattened: shape ``(batch or 1, vectors, 3)``.
    return_checksums : bool
        Also return the :class:`Checksums` of the delivered product (flattened batch), ready to
        pass to the next product.

    Returns
    -------
    c : array (..., m, n)
        The product, in ``a``'s array module. Followed by ``report`` and/or ``checksums`` when
        requested, in that order.

    Raises
    ------
    TypeError, ValueError
        For bad input (nothing is modified).
    UncorrectableError
        When checksums and recomputation could not produce a verified result.
    """
    if check not in CHECK_MODES:
        raise ValueError(f"check must be one of {CHECK_MODES}, got {check!r}")
    op = Operands.prepare(a, b, bias)
    be = get_backend(op.xp)
    out = op.xp.empty((op.batch, op.m, op.n), dtype=op.dtype)
    be.gemm(op.a, op.b, out, op.bias)
    if fault_hook is not None:
        fault_hook(name, out.reshape(op.batch_shape + (op.m, op.n)))
    report = Report()
    checksums = None
    if check != "off" and out.size:
        checksums = _protect(be, op, out, check, name, report, a_checksums, b_checksums)
        report.checked[name] = report.checked.get(name, 0) + op.batch
    result = op.restore(out)
    extras = ([report] if return_report else []) + ([checksums] if return_checksums else [])
    return (result, *extras) if extras else result


def _protect(be: Backend, op: Operands, out: Any, check: str, name: str, report: Report,
             a_checksums: Checksums | None, b_checksums: Checksums | None) -> Checksums:
    """Verify ``out`` (and repair it when ``check == "correct"``); return its encodings."""
    pred_col, pred_row = predict(be, op, a_checksums, b_checksums)
    obs_col, obs_row = observe(be, out)
    verdict = verify(be, op, pred_col, pred_row, obs_col, obs_row)
    report.events.extend(verdict.input_events(name))
    for b in ([] if verdict.clean else verdict.flagged_batches()):
        if check == "detect":
            report.events.append(diagnose(verdict, b).event(name, b, "reported"))
            continue
        repair_batch(be, op, out, b, verdict, name, report)
        obs_col[b], obs_row[b] = (o[0] for o in observe(be, out[b:b + 1]))
    return Checksums(cols=obs_col[..., :3], rows=obs_row[..., :3])


def checksums_of(x: Any) -> Checksums:
    """Column and row encodings of ``x`` (``(..., r, c)``, batch flattened), to pass to matmul.

    Use it to encode an operand once and reuse it across several products (e.g. the input of the
    query, key and value projections).
    """
    xp = array_module(x)
    if x.ndim < 2:
        raise ValueError(f"checksums_of needs a matrix or a batch of matrices, got shape {x.shape}")
    r, c = x.shape[-2:]
    x3 = x.reshape(-1, r, c)
    cols, rows = observe(get_backend(xp), x3)
    return Checksums(cols=cols[..., :3], rows=rows[..., :3])
