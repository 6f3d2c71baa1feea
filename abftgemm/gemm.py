"""Protected matrix product: encode -> GEMM -> verify -> locate -> correct (or recompute).

Everything here is array-module generic; the heavy passes are the backend's primitives
(:mod:`abftgemm.backend`). The fast path (no fault) costs one GEMM, one read of ``a``, two of
``b`` (one when its encoding is passed in), one read of the product for both check directions,
a flag pass over the checksums and a single device-to-host transfer of two counts.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from abftgemm.backend import Backend, array_module, get_backend
from abftgemm.checksums import Checksums
from abftgemm.encode import observe, predict, predict_rows
from abftgemm.locate import Verdict, diagnose, verify, verify_rows
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
    be, op, out = _product(a, b, bias, fault_hook, name)
    report = Report()
    checksums = None
    if check != "off" and out.size:
        checksums = _protect(be, op, out, check, name, report, a_checksums, b_checksums)
        report.checked[name] = report.checked.get(name, 0) + op.batch
    result = op.restore(out)
    extras = ([report] if return_report else []) + ([checksums] if return_checksums else [])
    return (result, *extras) if extras else result


def _product(a: Any, b: Any, bias: Any | None, fault_hook: FaultHook | None,
             name: str) -> tuple[Backend, Operands, Any]:
    """Validate, run the GEMM into a fresh ``(batch, m, n)`` array, let ``fault_hook`` see it."""
    op = Operands.prepare(a, b, bias)
    be = get_backend(op.xp)
    out = op.xp.empty((op.batch, op.m, op.n), dtype=op.dtype)
    be.gemm(op.a, op.b, out, op.bias)
    if fault_hook is not None:
        fault_hook(name, out.reshape(op.batch_shape + (op.m, op.n)))
    return be, op, out


def matmul_deferred(a: Any, b: Any, *, check: str = "correct",
                    fault_hook: FaultHook | None = None, name: str = "matmul",
                    b_checksums: Checksums | None = None) -> tuple[Any, "DeferredCheck | None"]:
    """``a @ b`` whose verification is left to the kernel that consumes the product.

    Reading a large product only to verify it can cost more than a third of the GEMM (attention
    scores); the kernel that reads it anyway (the softmax) can observe its row checksums on the
    way through and hand them to :meth:`DeferredCheck.verify_rows`. Only the row checksums are
    predicted (one read of ``a``, at most one of ``b``); a flagged row is repaired with full
    two-direction verification, as in :func:`matmul`.

    Parameters
    ----------
    a, b, check, fault_hook, name
        As in :func:`matmul`.
    b_checksums : Checksums, optional
        Row encoding of ``b`` (``b_checksums.rows``), handed on from an earlier product.

    Returns
    -------
    c : array (..., m, n)
        The unverified product.
    deferred : DeferredCheck or None
        None when ``check == "off"`` (or the product is empty).
    """
    if check not in CHECK_MODES:
        raise ValueError(f"check must be one of {CHECK_MODES}, got {check!r}")
    be, op, out = _product(a, b, None, fault_hook, name)
    if check == "off" or not out.size:
        return op.restore(out), None
    return op.restore(out), DeferredCheck(be, op, out, predict_rows(be, op, b_checksums), check,
                                          name)


class DeferredCheck:
    """The pending row verification of a product from :func:`matmul_deferred`."""

    def __init__(self, be: Backend, op: Operands, out: Any, pred_row: Any, check: str, name: str):
        self.be, self.op, self.out, self.pred_row = be, op, out, pred_row
        self.check, self.name = check, name

    def verify_rows(self, obs_row: Any, report: Report) -> list[int]:
        """Verify the product against its observed row checksums; repair it in place.

        Parameters
        ----------
        obs_row : array (batch, m, 5) float64
            Per row of the product as it was read: ``[sum, sum of (j+1)/n weighted, sum of |.|,
            non-finite count, last non-finite index or -1]`` (what the backends' ``row_reduce``
            computes with default weights).
        report : Report
            Receives the events.

        Returns
        -------
        list of int
            Flat batch indices whose product was modified (the consumer must redo its work on
            them). Raises :class:`UncorrectableError` as :func:`matmul` does.
        """
        op = self.op
        verdict = verify_rows(self.be, op, self.pred_row, obs_row)
        report.checked[self.name] = report.checked.get(self.name, 0) + op.batch
        return _settle(self.be, op, self.out, verdict, self.check, self.name, report)


def _protect(be: Backend, op: Operands, out: Any, check: str, name: str, report: Report,
             a_checksums: Checksums | None, b_checksums: Checksums | None) -> Checksums:
    """Verify ``out`` (and repair it when ``check == "correct"``); return its encodings."""
    obs_col, obs_row = observe(be, out)  # first: the product is freshest in cache
    pred_col, pred_row = predict(be, op, a_checksums, b_checksums)
    verdict = verify(be, op, pred_col, pred_row, obs_col, obs_row)
    for b in _settle(be, op, out, verdict, check, name, report):
        obs_col[b], obs_row[b] = (o[0] for o in observe(be, out[b:b + 1]))
    return Checksums(cols=obs_col[..., :3], rows=obs_row[..., :3])


def _settle(be: Backend, op: Operands, out: Any, verdict: Verdict, check: str, name: str,
            report: Report) -> list[int]:
    """Report what ``verdict`` found; with ``check == "correct"`` repair every flagged batch item
    in place (or raise). Returns the batch indices that were repaired."""
    report.events.extend(verdict.input_events(name))
    repaired = []
    for b in ([] if verdict.clean else verdict.flagged_batches()):
        if check == "detect":
            report.events.append(diagnose(verdict, b).event(name, b, "reported"))
            continue
        repair_batch(be, op, out, b, verdict, name, report)
        repaired.append(b)
    return repaired


def checksums_of(x: Any, rows: bool = True) -> Checksums:
    """Column and (unless ``rows=False``) row encodings of ``x`` (``(..., r, c)``, batch
    flattened), to pass to matmul.

    Use it to encode an operand once and reuse it across several products (e.g. the input of the
    query, key and value projections, whose column encoding is all they need).
    """
    xp = array_module(x)
    if x.ndim < 2:
        raise ValueError(f"checksums_of needs a matrix or a batch of matrices, got shape {x.shape}")
    r, c = x.shape[-2:]
    x3 = x.reshape(-1, r, c)
    be = get_backend(xp)
    if not rows:
        cols = xp.empty((x3.shape[0], c, 5), dtype=np.float64)
        be.col_reduce(x3, None, cols)
        return Checksums(cols=cols[..., :3])
    cols, row_sums = observe(be, x3)
    return Checksums(cols=cols[..., :3], rows=row_sums[..., :3])
