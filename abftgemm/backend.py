"""Resolve the array backend (NumPy on the CPU, CuPy on the GPU) from the inputs.

CuPy is imported only when an input is already a CuPy array, so the package imports and runs on a
machine without CUDA.

Both backends implement the same primitives over 3-D operands ``(batch, rows, cols)`` whose
batch dimension is either the full batch or 1 (broadcast):

``gemm(a, b, out, bias, triangle=None, out_triangle=None)``
    ``out[i] = a[i or 0] @ b[i or 0] (+ bias)``; ``out`` is C-contiguous ``(batch, m, n)``.
    ``triangle`` (``"lower"`` or ``"upper"``) promises that ``a`` is zero outside that triangle
    of its last two axes (``"lower"``: ``a[..., i, j] == 0`` for ``j > i``); the CPU backend
    then multiplies only the blocks the triangle can hold (the GPU backend, not yet: it runs
    the whole product, which the promise makes equal). ``out_triangle="lower"`` (no bias): only
    entries ``j <= i`` of the product are wanted; row ``i`` is computed at least up to
    ``row_limits(m, n, dtype)[i]`` (the rest of the row is left as it was).
``row_limits(m, n, dtype)``
    Those limits, ``(m,)`` int64, or None when every row is computed whole (always, on the
    GPU). A backend that returns limits also implements :class:`RowPrefixes`.
``col_reduce(x, coef, out)`` / ``row_reduce(x, coef, out)``
    One pass over ``x`` writing to float64 ``out`` ``(batch, vectors, 5)``, per column (resp.
    row) vector ``v`` of length ``L``:
    ``[sum(c0*v), sum(c1*v), sum(c2*|v|), count(!isfinite(v)), last non-finite index or -1]``.
    ``coef`` is an encoding (:mod:`abftgemm.checksums`), float64 ``(3, batch or 1, L)`` whose
    field vectors are contiguous (last axis), read in place; or None for the defaults ``c0=1,
    c1=(index+1)/L, c2=1``.
``both_reduce(x, col_coef, row_coef, out_col, out_row)``
    ``col_reduce`` and ``row_reduce`` of the same ``x`` in one read of it.
``flag(pred, obs, (c_obs, c_pred, floor, c_mag), safe, counts) -> (tau, bad, verifiable)``
    Per vector of predicted/observed checksums ``(batch, vectors, 5)``: the threshold
    ``c_obs * obs[2] + c_pred * pred[2] + floor``, whether checksums can judge it (verifiable:
    the prediction is finite, and unless ``pred[2] < safe`` the observed elements are finite too,
    otherwise it may have overflowed and is settled element by element), and whether a
    verifiable vector disagrees (either checksum difference above the threshold, non-finite
    observed elements, or an observed ``sum |C|`` above ``c_mag * pred[2] + floor``); adds the
    numbers of bad and unverifiable vectors to ``counts``. ``out`` (optional): the three
    ``(batch, vectors)`` arrays to write, for callers that must not allocate.
``synchronize()``
    Wait until every launch queued so far has finished (nothing to wait for on the CPU).
``plan_workspace(op, counters, thresholds, verdicts)``
    The :class:`Workspace` of a planned product (:class:`abftgemm.plan.ProtectedMatmul`); a
    verdict kept on the device goes in a slot of the ledger ``verdicts`` (:mod:`abftgemm.verdicts`).

On top of these, array-module generic and written once: the checksum passes
(:mod:`abftgemm.encode`), verdicts and location (:mod:`abftgemm.locate`), the rare path of
verification, repair and recomputation (:mod:`abftgemm.rare_path`), and the planned products
(:mod:`abftgemm.plan`, :mod:`abftgemm.consumer_rows`).
"""
from __future__ import annotations

import contextvars
import sys
from types import ModuleType
from typing import Any, Protocol

import numpy

#: ``(c_obs, c_pred, floor, c_mag)`` of :func:`abftgemm.thresholds.threshold_coefficients` and the
#: ``safe`` bound of :func:`abftgemm.thresholds.safe_magnitude`: how a plan judges its columns.
ColumnThresholds = tuple[tuple[float, float, float, float], float]


class Workspace(Protocol):
    """Every array a planned product needs, allocated at planning, and its launches, which add
    to the plan's :class:`abftgemm.plan.Counters` (the CPU's :mod:`abftgemm._cpu_plan`, the GPU's
    :mod:`abftgemm._cuda_plan`).

    Made by :meth:`Backend.plan_workspace` with the column thresholds, or None for a plan that
    verifies on settle only (``directions="both"``): then only :meth:`gemm` and :meth:`release`
    may be called.
    """

    def gemm(self, op: Any, c: Any, triangle: str | None = None) -> None:
        """``c = op.a @ op.b (+ op.bias)`` into the ``(batch, m, n)`` buffer ``c``."""

    def encode(self, a: Any) -> None:
        """Column encoding of ``a`` now, kept for every later prediction (a constant ``a``)."""

    def set_encoding(self, cols: Any) -> None:
        """Use the column encoding ``cols`` ``(3, batch or 1, k)`` in the next prediction, read in
        place."""

    def predict(self, op: Any, encode_a: bool) -> None:
        """Launch 1: the predicted column checksums of the product (``encode_a``: from ``op.a``
        itself, else from the encoding kept or set)."""

    def observe_flag(self, c: Any) -> None:
        """Launch 2: observe the product's column checksums and judge every column."""

    def ready_verdict(self) -> None:
        """Make the copy of the verdict ledger to the host (queued next on the current stream)
        wait for this workspace's launches."""

    def verdict_flagged(self) -> bool:
        """After the ledger's fetch and a synchronization: whether a column flagged or was
        unverifiable since the last read."""

    def abandon(self) -> None:
        """Forget the verdict of an execute that will not be settled."""

    def a_encoding(self) -> Any | None:
        """The column encoding of ``a`` the last prediction used, ``(3, batch or 1, k)``, or None
        where the backend keeps none whole."""

    def observed_cols(self) -> Any:
        """The observed column encoding of the last product, ``(3, batch, n)``, as the
        observation wrote it."""

    def release(self) -> None:
        """Free what the workspace holds beyond its arrays."""


class Backend(Protocol):
    """The primitives every backend provides; see the module docstring."""

    name: str
    xp: ModuleType

    def gemm(self, a: Any, b: Any, out: Any, bias: Any | None, triangle: str | None = None,
             out_triangle: str | None = None) -> None: ...

    def row_limits(self, m: int, n: int, dtype: Any) -> Any | None: ...

    def col_reduce(self, x: Any, coef: Any | None, out: Any) -> None: ...

    def row_reduce(self, x: Any, coef: Any | None, out: Any) -> None: ...

    def both_reduce(self, x: Any, col_coef: Any | None, row_coef: Any | None, out_col: Any,
                    out_row: Any) -> None: ...

    def flag(self, pred: Any, obs: Any, coefficients: tuple[float, float, float, float],
             safe: float, counts: Any,
             out: tuple[Any, Any, Any] | None = None) -> tuple[Any, Any, Any]: ...

    def synchronize(self) -> None: ...

    def plan_workspace(self, op: Any, counters: Any, thresholds: ColumnThresholds | None,
                       verdicts: Any) -> Workspace: ...


class RowPrefixes(Protocol):
    """What a backend whose :meth:`Backend.row_limits` returns limits also provides (the CPU's):
    the products of ``gemm(..., out_triangle="lower")`` that compute each row only up to its
    limit."""

    def predict_lower_rows(self, a: Any, b: Any, limits: Any, enc: Any, pred: Any) -> None:
        """The predicted row checksums ``pred`` ``(batch, m, 5)`` of such a product, row ``i``
        over its first ``limits[i]`` columns; ``enc`` is a ``(3, k)`` float64 workspace."""

    def complete_lower(self, a: Any, b: Any, out: Any) -> None:
        """Compute the rest of such a product, so that ``out`` is the whole ``a @ b`` (the rare
        path)."""


def is_cupy_array(x: object) -> bool:
    """True when ``x`` is a CuPy ndarray, without importing CuPy unless it is already loaded."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


#: The counters of the block :func:`reads_counted_by` opened last in this thread (or task).
_READ_COUNTERS: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "abftgemm_read_counters", default=None)


class reads_counted_by:
    """Within the block, every :func:`to_host` of a CuPy array adds one to
    ``counters.host_reads`` (:class:`abftgemm.plan.Counters`): the reads of the rare path and of
    the fused core, beside the ledger's own fetches. ``None`` leaves the enclosing block's. (A
    class, not a generator: every settle enters one.)"""

    __slots__ = ("counters", "token")

    def __init__(self, counters: Any | None):
        self.counters = counters

    def __enter__(self) -> None:
        self.token = None if self.counters is None else _READ_COUNTERS.set(self.counters)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _READ_COUNTERS.reset(self.token)


def to_host(x: Any) -> Any:
    """A NumPy array with the contents of NumPy or CuPy array ``x`` (CuPy arrays are copied, and
    the copy counted where :func:`reads_counted_by` says)."""
    if not is_cupy_array(x):
        return numpy.asarray(x)
    counters = _READ_COUNTERS.get()
    if counters is not None:
        counters.host_reads += 1
    return x.get()


def astype(x: Any, dtype: Any) -> Any:
    """``x`` as ``dtype`` (``x`` itself when it already is), NumPy or CuPy.

    CuPy has no bfloat16 arithmetic, so a CuPy bfloat16 array is widened through its bits (exact:
    a bfloat16 is the top half of a float32). Converting a CuPy array *to* bfloat16 raises
    TypeError.
    """
    dtype = numpy.dtype(dtype)
    if x.dtype == dtype:
        return x
    if is_cupy_array(x):
        if dtype.name == "bfloat16":
            raise TypeError(f"CuPy arrays cannot be converted to bfloat16 here (from {x.dtype})")
        if x.dtype.name == "bfloat16":
            x = (x.view(numpy.uint16).astype(numpy.uint32) << 16).view(numpy.float32)
    return x.astype(dtype)


def copy_into(out: Any, src: Any) -> None:
    """Copy ``src`` into ``out`` (any layout; NumPy: ``src`` broadcasts), casting ``same_kind``.

    Same-dtype copies go through unsigned-integer views, which CuPy supports for every element
    type (bfloat16 included).
    """
    bits = {2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}.get(out.dtype.itemsize)
    if out.dtype == src.dtype and bits is not None:
        out.view(bits)[...] = src.view(bits)
    elif is_cupy_array(out):
        out[...] = astype(src, out.dtype)
    else:
        numpy.copyto(out, src, casting="same_kind")


def array_module(*arrays: object) -> ModuleType:
    """The array module (numpy or cupy) of ``arrays``.

    Raises
    ------
    TypeError
        If the arrays mix NumPy and CuPy, or one of them is not an array.
    """
    present = [x for x in arrays if x is not None]
    for x in present:
        if not (is_cupy_array(x) or isinstance(x, numpy.ndarray)):
            raise TypeError(f"expected a NumPy or CuPy array, got {type(x).__name__}")
    on_gpu = sum(map(is_cupy_array, present))
    if 0 < on_gpu < len(present):
        raise TypeError("operands mix NumPy and CuPy arrays; move them to one device first")
    return sys.modules["cupy"] if on_gpu else numpy


def get_backend(xp: ModuleType) -> Backend:
    """The backend object for array module ``xp`` (created once, then cached)."""
    if xp.__name__ == "cupy":
        from abftgemm import _cuda

        return _cuda.backend()
    from abftgemm import _cpu

    return _cpu.backend()
