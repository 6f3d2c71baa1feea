"""The entry points: :func:`matmul` (protected ``a @ b``) and :func:`matmul_deferred`.

:func:`matmul` runs a cached plan (:mod:`abftgemm.plan_cache`): on the fast path one GEMM and two
verification launches that read ``a``, ``b`` and the product once each, then one host read of
the verdict; the rare path (:mod:`abftgemm.rare_path`) runs only when that verdict flags.
"""
from __future__ import annotations

from typing import Any, Callable

from abftgemm._torch import any_tensor, tensor_matmul
from abftgemm.backend import Backend, get_backend
from abftgemm.checksums import Checksums
from abftgemm.encode import predict_rows
from abftgemm.operands import Operands
from abftgemm.plan import DIRECTIONS
from abftgemm.plan_cache import PlanCache, default_plans
from abftgemm.rare_path import DeferredCheck
from abftgemm.report import Report
from abftgemm.threads import blas_scope

FaultHook = Callable[[str, Any], None]
CHECK_MODES = ("correct", "detect", "off")


def matmul(a: Any, b: Any, out: Any | None = None, *, bias: Any | None = None,
           check: str = "correct", directions: str = "columns",
           fault_hook: FaultHook | None = None, name: str = "matmul",
           return_report: bool = False, a_checksums: Checksums | None = None,
           b_checksums: Checksums | None = None, return_checksums: bool = False,
           plans: PlanCache | None = None) -> Any:
    """Checksum-protected ``a @ b``: a drop-in for ``np.matmul`` / ``cupy.matmul`` that detects
    and corrects faults.

    NumPy's semantics hold for NumPy arrays and CuPy's for CuPy arrays (shapes, broadcasting,
    1-D operands, zero sizes, ``out``), with these deliberate differences: only float dtypes
    (float16, bfloat16, float32, float64) are accepted, integer/bool/complex/object operands raise
    TypeError instead of being computed or promoted to float64; bfloat16 @ bfloat16 returns
    bfloat16 (NumPy computes it in float32 and returns float32); ``np.matrix`` and masked arrays
    raise TypeError; other ndarray subclasses come back as plain arrays; NumPy's ``casting``,
    ``order``, ``dtype``, ``subok`` and ``axes`` keywords are not taken.

    Parameters
    ----------
    a : array or array-like (..., m, k) or (k,)
        NumPy or CuPy array of float16, bfloat16 (ml_dtypes), float32 or float64, any byte order;
        NumPy array-likes (lists, objects with ``__array__``) are converted; CuPy operands need
        CuPy arrays throughout, as ``cupy.matmul`` does. PyTorch tensors (CPU or CUDA, not
        recording gradients) are used in place (no copies) and the result is a tensor; the
        ``fault_hook`` and the checksums still see NumPy/CuPy arrays sharing their memory.
    b : array or array-like (..., k, n) or (k,)
        Same array module as ``a``; batch dimensions broadcast as in ``matmul``. Mixed float
        dtypes promote as ``np.matmul`` promotes (float16 with float32 -> float32, bfloat16 with
        float16 or float32 -> float32, anything with float64 -> float64).
    out : array, optional
        Receives the result, which is returned (positional or keyword, as in ``np.matmul``). Any
        layout; its dtype must accept the result under ``casting="same_kind"``; for NumPy its
        leading dimensions may broadcast the result's, for CuPy its shape is the result's. A bad
        ``out`` raises before anything is written. If the call raises
        :class:`UncorrectableError`, the contents of ``out`` are unspecified.
    bias : array (n,), optional
        Added to every row of the product, inside the protection (``a @ b + bias``); promoted
        together with ``a`` and ``b``.
    check : {"correct", "detect", "off"}
        ``"correct"``: detect, locate, repair from checksums, recompute what they cannot repair,
        raise :class:`UncorrectableError` if no correct result can be delivered. ``"detect"``:
        report, never modify, and announce every finding as a :class:`FaultDetectedWarning`
        (whether or not the report is returned). ``"off"``: the plain product.
    directions : {"columns", "both"}
        What every call verifies. ``"columns"`` (default): the column checksums, which detect
        and locate a bad element or a bad row on one read of ``a``, ``b`` and the product; the
        row checksums are computed only when a column flags (to repair a bad column).
        ``"both"``: rows and columns on every call, which also detects errors that clear the row
        threshold but not the column one (docs/detection.md compares the two).
    fault_hook : callable ``(site, c)``, optional
        Called with ``name`` and the raw product, shape ``(..., m, n)``, after the GEMM and before
        verification; it may modify ``c`` in place (fault injection).
    name : str
        Site name used in reports and passed to ``fault_hook``.
    return_report : bool
        Also return the :class:`Report`.
    a_checksums, b_checksums : Checksums, optional
        Encodings handed on from earlier products: ``a_checksums.cols`` (column encoding of ``a``)
        replaces the read of ``a``; ``b_checksums`` is accepted for compatibility and unused (the
        row direction is predicted afresh when it is needed). Batch dimensions are flattened:
        shape ``(batch or 1, vectors, 3)``.
    return_checksums : bool
        Also return the :class:`Checksums` of the delivered product (flattened batch), ready to
        pass to the next product: its column encoding (and the row encoding with
        ``directions="both"``).
    plans : PlanCache, optional
        Where the planned product is kept and found again (keyed by the product's layout and
        the options, not by ``name``): a cache the caller owns and uses from one thread, such
        as one per model; by default the calling thread's cache of the 8 most recently used.

    Returns
    -------
    c : array (..., m, n)
        The product, in ``a``'s array module (``out`` when given; a NumPy scalar for NumPy
        vector @ vector, a 0-d array for CuPy). Followed by ``report`` and/or ``checksums`` when
        requested, in that order.

    Raises
    ------
    TypeError, ValueError
        For bad input (nothing is modified).
    UncorrectableError
        When checksums and recomputation could not produce a verified result.
    """
    if any_tensor(a, b, out, bias):
        return tensor_matmul(matmul, a, b, out, bias, check=check, directions=directions,
                             fault_hook=fault_hook, name=name, return_report=return_report,
                             a_checksums=a_checksums, b_checksums=b_checksums,
                             return_checksums=return_checksums, plans=plans)
    if check not in CHECK_MODES:
        raise ValueError(f"check must be one of {CHECK_MODES}, got {check!r}")
    if directions not in DIRECTIONS:
        raise ValueError(f"directions must be one of {DIRECTIONS}, got {directions!r}")
    if plans is not None and not isinstance(plans, PlanCache):
        raise TypeError(f"plans must be an abftgemm.PlanCache, got {type(plans).__name__}")
    report, checksums = Report(), None
    plans = default_plans() if plans is None else plans
    # a layout seen before takes its cached plan without validation (plan_cache.py)
    found = None if check == "off" else plans.planned_operands(a, b, bias, out, check,
                                                               directions)
    plan, op = found if found else (None, Operands.prepare(a, b, bias, out))
    if plan is None and (check == "off" or op.batch * op.m * op.n == 0):
        _, _, buf = _product(op, fault_hook, name)
    else:
        buf = op.buffer()
        plan = plan or plans.plan(op, check, directions, (a, b, bias))
        try:
            with blas_scope():  # the thread count decided once for the GEMM and the rare path
                plan.run(op, buf, fault_hook, a_checksums, name)
                report, sums = plan.settle(checksums=True)
        except BaseException:
            plan.abandon()
            raise
        if return_checksums:  # the plan's are workspace views: the next call overwrites them
            checksums = Checksums(*(None if x is None else op.xp.array(x)
                                    for x in (sums.cols, sums.rows)))
    result = op.deliver(buf)
    extras = ([report] if return_report else []) + ([checksums] if return_checksums else [])
    return (result, *extras) if extras else result


def _product(op: Operands, fault_hook: FaultHook | None,
             name: str) -> tuple[Backend, Operands, Any]:
    """Run the GEMM into ``op``'s ``(batch, m, n)`` buffer, let ``fault_hook`` see it."""
    be = get_backend(op.xp)
    buf = op.buffer()
    be.gemm(op.a, op.b, buf, op.bias)
    if fault_hook is not None:
        fault_hook(name, buf.reshape(op.batch_shape + (op.m, op.n)))
    return be, op, buf


def matmul_deferred(a: Any, b: Any, *, check: str = "correct",
                    fault_hook: FaultHook | None = None, name: str = "matmul",
                    b_checksums: Checksums | None = None) -> tuple[Any, DeferredCheck | None]:
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
    be, op, out = _product(Operands.prepare(a, b), fault_hook, name)
    if check == "off" or not out.size:
        return op.restore(out), None
    return op.restore(out), DeferredCheck(be, op, out, predict_rows(be, op, b_checksums), check,
                                          name)
