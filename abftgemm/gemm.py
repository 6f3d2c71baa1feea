"""The entry point: :func:`matmul`, a protected ``a @ b``, which executes and settles a cached
plan (:mod:`abftgemm.plan_cache`, :mod:`abftgemm.plan`)."""
from __future__ import annotations

from typing import Any

import numpy as np

from abftgemm.tensors import any_tensor, tensor_matmul
from abftgemm.backend import array_module, get_backend
from abftgemm.checksums import Checksums, check_checksums
from abftgemm.faults import FaultHook
from abftgemm.operands import Operands
from abftgemm.plan import CHECK_MODES, DIRECTIONS, check_option
from abftgemm.plan_cache import PlanCache, default_plans
from abftgemm.report import Report
from abftgemm.threads import blas_scope


def matmul(a: Any, b: Any, out: Any | None = None, *, bias: Any | None = None,
           check: str = "correct", directions: str = "columns",
           fault_hook: FaultHook | None = None, name: str = "matmul",
           return_report: bool = False, a_checksums: Checksums | None = None,
           return_checksums: bool = False,
           plans: PlanCache | None = None) -> Any:
    """Checksum-protected ``a @ b``: a drop-in for ``np.matmul`` / ``cupy.matmul`` that detects
    and corrects faults.

    NumPy's semantics hold for NumPy arrays and CuPy's for CuPy arrays (shapes, broadcasting,
    1-D operands, zero sizes, ``out``), except: only float dtypes are accepted (integer, bool,
    complex and object operands raise TypeError instead of being promoted to float64); bfloat16
    @ bfloat16 returns bfloat16 (NumPy returns float32); ``np.matrix`` and masked arrays raise
    TypeError, other ndarray subclasses come back as plain arrays; NumPy's ``casting``,
    ``order``, ``dtype``, ``subok`` and ``axes`` keywords are not taken.

    Parameters
    ----------
    a : array or array-like (..., m, k) or (k,)
        NumPy or CuPy array of float16, bfloat16 (ml_dtypes), float32 or float64, any byte order;
        NumPy array-likes are converted; CuPy operands need CuPy arrays throughout. PyTorch
        tensors (CPU or CUDA, not recording gradients) are used in place and the result is a
        tensor; ``fault_hook`` and the checksums see NumPy/CuPy arrays sharing their memory.
    b : array or array-like (..., k, n) or (k,)
        Same array module as ``a``; batch dimensions broadcast and mixed float dtypes promote as
        in ``np.matmul`` (bfloat16 with float16 or float32 -> float32).
    out : array, optional
        Receives the result, which is returned (positional or keyword, as in ``np.matmul``). Any
        layout; its dtype must accept the result under ``casting="same_kind"``; for NumPy its
        leading dimensions may broadcast the result's, for CuPy its shape is the result's. A bad
        ``out`` raises before anything is written; after :class:`UncorrectableError` its
        contents are unspecified. A tensor ``out`` has its version counter advanced (as
        PyTorch's ``out=``); an expanded one and an inference tensor outside
        ``torch.inference_mode`` raise ValueError, as PyTorch refuses them.
    bias : array (n,), optional
        Added to every row of the product inside the protection (``a @ b + bias``); promoted
        together with ``a`` and ``b``.
    check : {"correct", "detect", "off"}
        ``"correct"``: detect, locate, repair from checksums, recompute what they cannot repair,
        raise :class:`UncorrectableError` if no correct result can be delivered. ``"detect"``:
        report, never modify, and announce every finding as a :class:`FaultDetectedWarning`
        (the report returned or not). ``"off"``: the plain product.
    directions : {"columns", "both"}
        ``"columns"`` (default): verify the column checksums, which detect and locate a bad
        element or row on one read of ``a``, ``b`` and the product (the rows are computed only
        to repair a bad column). ``"both"``: rows and columns on every call, which also detects
        errors that clear only the row threshold (docs/detection.md compares the two).
    fault_hook : callable ``(site, c)``, optional
        Called with ``name`` and the raw product ``(..., m, n)`` before verification; it may
        modify ``c`` in place (fault injection).
    name : str
        Site name in reports and for ``fault_hook``.
    return_report : bool
        Also return the :class:`Report`.
    a_checksums : Checksums, optional
        Encoding handed on from an earlier product: ``a_checksums.cols``, the column encoding of
        ``a`` ``(3, batch or 1, k)`` (batch dimensions flattened), replaces the read of ``a``.
    return_checksums : bool
        Also return the :class:`Checksums` of the delivered product (flattened batch), ready to
        pass to the next product: its column encoding (and rows with ``directions="both"``).
    plans : PlanCache, optional
        Where the planned product is kept (keyed by layout and options, not ``name``): a cache
        the caller owns and uses from one thread; default the thread's cache of the 8 plans
        used last.

    Returns
    -------
    c : array (..., m, n)
        The product, in ``a``'s array module (``out`` when given; a NumPy scalar for NumPy
        vector @ vector, a 0-d array for CuPy), followed by ``report`` and/or ``checksums`` when
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
                             a_checksums=a_checksums, return_checksums=return_checksums,
                             plans=plans)
    check_option("check", check, CHECK_MODES)
    check_option("directions", directions, DIRECTIONS)
    if plans is not None and not isinstance(plans, PlanCache):
        raise TypeError(f"plans must be an abftgemm.PlanCache, got {type(plans).__name__}")
    if fault_hook is not None and not callable(fault_hook):
        raise TypeError(f"fault_hook must be callable (site, c), got {type(fault_hook).__name__}")
    check_checksums(a_checksums, "a_checksums")
    plans = default_plans() if plans is None else plans
    plan = None if check == "off" else plans.find(a, b, bias, check, directions)
    if plan is None:
        op = Operands.prepare(a, b, bias, out)
        if check == "off":  # the unprotected GEMM (an empty product is planned: its checksums)
            buf = op.buffer()
            get_backend(op.xp).gemm(op.a, op.b, buf, op.bias)
            if fault_hook is not None:
                fault_hook(name, buf.reshape(op.batch_shape + (op.m, op.n)))
            return _with_extras(op.deliver(buf), Report(), None, return_report, return_checksums)
        plan = plans.plan(op, check, directions, (a, b, bias))
    try:
        with blas_scope():  # the thread count decided once for the GEMM and the rare path
            result = plan.execute(a, b, bias=bias, out=out, fault_hook=fault_hook,
                                  a_checksums=a_checksums, name=name)
            report, sums = plan.settle(checksums=True)
    except BaseException:
        plan.abandon()
        raise
    if return_checksums:  # the plan's are workspace views: the next call overwrites them
        xp = array_module(sums.cols)
        sums = Checksums(*(None if x is None else xp.array(x) for x in (sums.cols, sums.rows)))
    if out is None and result.ndim == 0 and type(result) is np.ndarray:
        result = result[()]  # NumPy vector @ vector: a scalar (CuPy returns 0-d arrays)
    return _with_extras(result, report, sums, return_report, return_checksums)


def _with_extras(result: Any, report: Report, checksums: Checksums | None, return_report: bool,
                 return_checksums: bool) -> Any:
    extras = ([report] if return_report else []) + ([checksums] if return_checksums else [])
    return (result, *extras) if extras else result
