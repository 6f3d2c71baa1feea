"""Planned protected products: plan once, then execute many times with nothing but the work.

:class:`ProtectedMatmul` validates and plans a product once (shapes, dtype, bias, check mode),
allocates every workspace and precomputes what does not change. Each
:meth:`~ProtectedMatmul.execute` then runs the GEMM and, on the default ``directions="columns"``
fast path, two verification launches (predict the column checksums from the operands; observe the
product's column checksums and judge every column on the same read), with no allocation (given
``out=``) and no host synchronization. :meth:`~ProtectedMatmul.settle` reads the verdict (two counts
per batch item) and only when something was flagged runs the rare path: full two-direction
verification, location, repair and recomputation (:mod:`abftgemm.rare_path`), exactly as an
unplanned product would.

Why one direction on the fast path: weighted column checksums alone detect an error, locate it
in its column, and correct a single element or a whole bad row; the row direction is needed only
to repair a bad column, and the rare path computes it then. Reading ``a``, ``b`` and the product
once each instead of ``a`` and ``b`` twice is what brings the CPU overhead near the memory floor
(docs/design.md). ``directions="both"`` keeps the stronger two-direction check on every call
(all of it at :meth:`~ProtectedMatmul.settle`); docs/detection.md compares the two.
``directions="rows by consumer"`` leaves the observation to the kernel that reads the product
anyway (:mod:`abftgemm.consumer_rows`): the execute predicts the row checksums, the consumer
observes them into :attr:`~ProtectedMatmul.observed` and calls :meth:`~ProtectedMatmul.judge`.

Counters (:class:`Counters`) record the launches, workspace allocations and host syncs of a plan,
so that tests can prove the structure on the CPU, where the kernel boundaries are the GPU's.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from abftgemm.backend import Backend, Workspace, get_backend, is_cupy_array, reads_counted_by
from abftgemm.checksums import Checksums, check_checksums
from abftgemm.consumer_rows import ConsumerRows
from abftgemm.faults import FaultHook
from abftgemm.operands import Operands
from abftgemm.rare_path import protect
from abftgemm.report import Report, UncorrectableError
from abftgemm.thresholds import safe_magnitude, threshold_coefficients
from abftgemm.verdicts import Ledger

#: What a check does with a finding (:func:`abftgemm.matmul`): repair it, report it, or no check.
CHECK_MODES = ("correct", "detect", "off")
DIRECTIONS = ("columns", "both")
#: What a plan may verify besides :data:`DIRECTIONS`: the rows its consumer observes.
CONSUMER_ROWS = "rows by consumer"
PLAN_DIRECTIONS = DIRECTIONS + (CONSUMER_ROWS,)
#: What ``a_triangle`` may promise.
TRIANGLES = (None, "lower", "upper")


def check_option(name: str, value: Any, allowed: tuple) -> Any:
    """``value``, or ``ValueError`` naming the option ``name``, what it ``allowed`` and what it
    got: the one validation of the library's string options (``check``, ``directions``, ...)."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


@dataclass
class Counters:
    """What a plan has done since it was created.

    Attributes
    ----------
    launches : int
        Kernel launches: the GEMM counts as one (on the CPU including the float32 copies a 16-bit
        product needs, as the unprotected product makes them too), adding a bias as one more,
        and each verification kernel as one.
    allocations : int
        Arrays allocated by the plan: workspaces at planning; per execute an output when ``out``
        is not a C-contiguous array it can write, and a copy of an operand whose layout the
        product cannot read in place (a batch broadcast in part, ``(2, 1, m, k) @ (1, 3, k,
        n)``; on the GPU negative strides, copied for the GEMM and for the prediction).
    syncs : int
        Host synchronizations (reads of device results by the host; one per clean settle).
    rare_paths : int
        Settles that ran the full two-direction path (verify, locate, repair, recompute; its
        launches are not in ``launches``): every settle of a ``directions="both"`` plan, and of
        a column plan only when its fast path flagged something (never for a clean product).
    plans : int
        Plans made with these counters (a workspace whose plans are reused makes none in steady
        state).
    copies : int
        Checksum encodings copied (:mod:`abftgemm.checksums`): a handed-on encoding whose field
        vectors are not contiguous, copied before a kernel reads it; an encoding made out of a
        reduction's records (a constant ``a`` on the GPU, ``b``'s row encoding a consumer-rows
        plan reads ``b`` for, the rare path's); an encoding kept beyond the workspace that holds
        it. Handed-on encodings in the one layout are read where they were written: none.
    host_reads : int
        Device-to-host transfers of verdicts: one per fetch of a verdict ledger page
        (:mod:`abftgemm.verdicts`; plans that share a ledger, and the checks that reserve slots
        in it, are read in one: one per :func:`settle_all` of an attention pass), and the
        details of a failed check that others read (the attention softmax checks). Zero on the
        CPU, where every verdict is host memory already: nothing is transferred.
    """

    launches: int = 0
    allocations: int = 0
    syncs: int = 0
    rare_paths: int = 0
    plans: int = 0
    copies: int = 0
    host_reads: int = 0


class ProtectedMatmul:
    """A checksum-protected ``a @ b (+ bias)`` planned for one layout, executed many times.

    Parameters
    ----------
    a, b : array
        Operands (NumPy or CuPy) whose shapes, dtype and array module the plan is made for; as in
        :func:`abftgemm.matmul` (batch dimensions broadcast; 1-D operands allowed).
    bias : array (n,), optional
        Planned with a bias: every execute adds one (``a @ b + bias``) inside the protection.
    check : {"correct", "detect"}
        What :meth:`settle` does with a finding: repair (or raise), or report only.
    directions : {"columns", "both", "rows by consumer"}
        ``"columns"`` (default): the fast path verifies column checksums only (see the module
        docstring). ``"both"``: rows and columns on every call. ``"rows by consumer"``: the
        execute predicts the row checksums; the kernel that consumes the product observes them
        on its read into :attr:`observed` and calls :meth:`judge` (no bias;
        :mod:`abftgemm.consumer_rows`).
    name : str
        Site name in reports and for ``fault_hook``.
    constant_a : bool
        ``a`` does not change between executes (a weight): its column encoding is computed once
        here, and again only after :meth:`reset_constant`.
    a_triangle : {None, "lower", "upper"}
        A promise that every ``a`` is zero outside this triangle of its last two axes
        (``"lower"``: ``a[..., i, j] == 0`` for ``j > i``, such as causal attention
        probabilities; ``"upper"``: for ``j < i``, their transpose). The GEMM then multiplies
        only the blocks the triangle can hold (on the CPU; the GPU runs the whole product). The
        verification reads ``a`` whole, so it still sees what the promise says is zero.
    out_triangle : {None, "lower"}
        With ``"rows by consumer"``: only entries ``j <= i`` of the product are read (causal
        attention's scores and ``dP``). Where the backend skips the rest (the CPU,
        float32/float64), row ``i`` is computed and verified up to :attr:`row_limits` ``[i]``
        only, and the consumer observes each row up to there; what lies beyond is never written
        nor read (a fault there changes nothing). The rare path completes the product first.
    counters : Counters, optional
        Counters to add to (several plans may share one, e.g. the sites of a layer); default a
        new one, :attr:`counters`.
    verdicts : Ledger, optional
        Where the plan's verdict counts live (:mod:`abftgemm.verdicts`): plans that share one
        are read from the device together, one transfer for all of them at
        :func:`settle_all`; default a ledger of the plan's own.

    Attributes
    ----------
    observed : array (batch, m, 5) or None
        With ``"rows by consumer"``: where the consumer writes the row checksums it observed
        (the fields of a backend's ``row_reduce`` with default weights).
    row_limits : array (m,) or None
        With ``out_triangle``: how many leading columns of each row are computed, observed and
        verified; None: every row whole.

    Examples
    --------
    >>> with ProtectedMatmul(w, x, constant_a=True) as plan:       # doctest: +SKIP
    ...     for x in batches:                    # w @ x for many x: w's encoding made once
    ...         y = plan.execute(w, x)
    ...         report = plan.settle()
    """

    def __init__(self, a: Any, b: Any, *, bias: Any | None = None, check: str = "correct",
                 directions: str = "columns", name: str = "matmul", constant_a: bool = False,
                 a_triangle: str | None = None, out_triangle: str | None = None,
                 counters: Counters | None = None, verdicts: Ledger | None = None):
        if check not in ("correct", "detect"):
            raise ValueError(f"check must be 'correct' or 'detect' for a plan, got {check!r} "
                             "(check='off' needs no plan: use abftgemm.matmul)")
        check_option("directions", directions, PLAN_DIRECTIONS)
        check_option("a_triangle", a_triangle, TRIANGLES)
        consumer = directions == CONSUMER_ROWS
        if out_triangle not in (None, "lower") or out_triangle and not consumer:
            raise ValueError(f"out_triangle must be None, or 'lower' with directions="
                             f"{CONSUMER_ROWS!r}; got {out_triangle!r} with {directions!r}")
        if consumer and bias is not None:
            raise ValueError(f"{name}: a plan with directions={CONSUMER_ROWS!r} takes no bias")
        for arg, given, kind in (("counters", counters, Counters), ("verdicts", verdicts, Ledger)):
            if given is not None and not isinstance(given, kind):
                raise TypeError(f"{arg} must be an abftgemm {kind.__name__} or None, got "
                                f"{type(given).__name__}")
        op = Operands.prepare(a, b, bias)
        self.check, self.directions, self.name = check, directions, name
        self.counters = Counters() if counters is None else counters
        self.counters.plans += 1
        self._signature = signature_of(op)
        self._layout = _Layout.of(a, b, bias, op)
        self._be: Backend = get_backend(op.xp)
        self._ledger = Ledger(op.xp, self.counters) if verdicts is None else verdicts
        self._constant_a = constant_a
        self._a_triangle = a_triangle
        self._verify_columns = directions == "columns"
        thresholds = (threshold_coefficients(op.k, op.m, op.dtype, op.bias is not None),
                      safe_magnitude(op.k, op.dtype)) if self._verify_columns else None
        self._work: Workspace = self._be.plan_workspace(op, self.counters, thresholds,
                                                        self._ledger)
        if self._verify_columns and constant_a:
            self._work.encode(op.a)
        self._rows = ConsumerRows(self._be, op, out_triangle, self._zeros, self.counters,
                                  self._ledger.reserve(2)) if consumer else None
        self.observed = None if self._rows is None else self._rows.observed
        self.row_limits = None if self._rows is None else self._rows.row_limits
        self._pending: _Pending | None = None
        #: Held from an execute's start to its settle, abandon or failure: one in flight.
        self._claim = threading.Lock()

    @property
    def in_flight(self) -> bool:
        """Whether an execute has started and is not yet settled or abandoned."""
        return self._claim.locked()

    def _zeros(self, shape: tuple[int, ...], dtype: Any = np.float64) -> Any:
        self.counters.allocations += 1
        return self._be.xp.zeros(shape, dtype=dtype)

    # ------------------------------------------------------------------ public

    def execute(self, a: Any, b: Any, *, bias: Any | None = None, out: Any | None = None,
                fault_hook: FaultHook | None = None, a_checksums: Checksums | None = None,
                b_rows: Checksums | None = None, gemm: Callable[[], None] | None = None,
                name: str | None = None) -> Any:
        """Run the product and queue its verification; call :meth:`settle` for the verdict.

        Parameters
        ----------
        a, b, bias : array
            Operands of the planned shapes and dtype (``bias`` if and only if planned with one).
        out : array, optional
            Receives the result, as :func:`abftgemm.matmul`'s ``out``. A C-contiguous array of
            the product's shape and dtype that overlaps no operand receives it directly; any
            other valid ``out`` receives the verified product at :meth:`settle` (the product is
            computed in a new array, as without ``out``: the only allocation of an execute).
        fault_hook : callable ``(site, c)``, optional
            Sees the raw product before verification (fault injection).
        a_checksums : Checksums, optional
            Column encoding of ``a`` ``(3, 1 or a's batch, k)`` handed on from an earlier product
            (``a_checksums.cols``): skips the read of ``a``. Read in place when its last axis is
            contiguous (else copied once, counted in :attr:`Counters.copies`).
        b_rows : Checksums, optional
            With ``"rows by consumer"``: ``b_rows.rows``, the row encoding of ``b``
            ``(3, 1 or b's batch, k)`` handed on from an earlier product, read in place as
            ``a_checksums``; without it ``b`` is read once more (not used with
            :attr:`row_limits`).
        gemm : callable, optional
            Writes ``a @ b (+ bias)`` into ``out`` (which it needs, written directly), in place
            of the plan's own GEMM: for example the framework's GEMM on the tensors behind the
            arrays, run on its own threads. The verification checks what it wrote like any
            product.
        name : str, optional
            The site of this execute, for ``fault_hook`` and the report (default: the plan's
            ``name``), so that one plan serves every site of its signature.

        Returns
        -------
        array
            The product (``out`` when given). Do not trust it before :meth:`settle` returns.

        Raises
        ------
        RuntimeError
            While an execute of this plan is in flight (not yet settled or abandoned), in this
            thread or another: a plan serves one thread at a time.
        TypeError
            When ``fault_hook`` or ``gemm`` is not callable (before anything is written).
        """
        name = self.name if name is None else name
        check_checksums(a_checksums, "a_checksums")
        check_checksums(b_rows, "b_rows")
        for arg, fn in (("fault_hook", fault_hook), ("gemm", gemm)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{arg} must be callable, got {type(fn).__name__}")
        if not self._claim.acquire(blocking=False):
            raise RuntimeError(f"{self.name}: an execute of this plan is in flight (settle() or "
                               "abandon() it first; a plan serves one thread at a time)")
        try:
            return self._execute(a, b, bias, out, fault_hook, a_checksums, b_rows, gemm, name)
        except BaseException:
            self._forget()
            raise

    def _execute(self, a: Any, b: Any, bias: Any | None, out: Any | None,
                 fault_hook: FaultHook | None, a_checksums: Checksums | None,
                 b_rows: Checksums | None, gemm: Callable[[], None] | None, name: str) -> Any:
        """:meth:`execute` once the plan is claimed."""
        op = self._planned(a, b, bias, out)
        for given, used in ((a, op.a), (b, op.b)):  # a copy into the batch layout, counted
            self.counters.allocations += used.size > 0 and not op.xp.may_share_memory(given, used)
        if not op.direct:
            if gemm is not None or self._rows is not None and out is not None:
                raise ValueError(f"{name}: a gemm or a consumer needs out, a C-contiguous "
                                 f"{op.dtype} array of shape {op.shape} that overlaps no operand")
            self.counters.allocations += 1
        if a_checksums is not None and self._constant_a:
            raise ValueError(f"{name}: a_checksums given to a plan with a constant a")
        if a_checksums is not None and a_checksums.cols is not None:
            _check_encoding(op.a, op.k, a_checksums.cols, name, "a_checksums.cols",
                            "the column encoding of a")
            a_checksums = Checksums(cols=self._readable(a_checksums.cols))
        if b_rows is not None and b_rows.rows is not None:
            _check_encoding(op.b, op.k, b_rows.rows, name, "b_rows.rows", "the row encoding of b")
            b_rows = Checksums(rows=self._readable(b_rows.rows))
        c = op.buffer()
        self._ledger.stale = True
        if gemm is not None or self.row_limits is not None:  # else the workspace counts it
            self.counters.launches += 1 + (op.bias is not None)
        if gemm is not None:
            gemm()
        elif self.row_limits is not None:  # the product's row prefixes
            self._be.gemm(op.a, op.b, c, None, out_triangle="lower")
        else:
            self._work.gemm(op, c, self._a_triangle)
        if fault_hook is not None:
            fault_hook(name, c.reshape(op.batch_shape + (op.m, op.n)))
        if self._rows is not None:
            self.counters.launches += self._rows.predict(
                op, None if b_rows is None else b_rows.rows)
        elif self._verify_columns:
            given = a_checksums is not None and a_checksums.cols is not None
            if given:
                self._work.set_encoding(a_checksums.cols)
            self._work.predict(op, not given and not self._constant_a)
            self._work.observe_flag(c)
        self._pending = _Pending(op, c, a_checksums, name)
        return op.restore(c) if op.out is None else op.out

    def judge(self) -> None:
        """With ``"rows by consumer"``, once the consumer filled :attr:`observed`: count the
        flagged and unverifiable rows on the device (one launch)."""
        if self._rows is None or self._pending is None:
            raise RuntimeError(f"{self.name}: judge() needs an executed plan with directions="
                               f"{CONSUMER_ROWS!r}")
        self.counters.launches += 1
        self._ledger.stale = True
        self._rows.judge()

    def observed_checksums(self) -> Checksums:
        """Column encoding ``(3, batch, n)`` of the last executed product, as its verification
        launch observed it: what :meth:`settle` hands on, available before it (to chain products
        whose settles are batched; trusted only once the settle is clean). A workspace view,
        valid until the next execute; ``directions="columns"`` plans only."""
        if self._pending is None or not self._verify_columns:
            raise RuntimeError(f"{self.name}: no executed column-verified product to read")
        return Checksums(cols=self._work.observed_cols())

    def a_encoding(self) -> Checksums | None:
        """Column encoding ``(3, batch or 1, k)`` of ``a`` as the last execute's prediction used
        it (made from ``a``, handed on, or constant), to hand on to another product of the same
        ``a`` as its ``a_checksums``: a workspace view, valid until the next execute. None where
        the backend keeps no whole encoding (the GPU, of an ``a`` its kernel encoded: it keeps
        partial sums only). ``directions="columns"`` plans only."""
        if self._pending is None or not self._verify_columns:
            raise RuntimeError(f"{self.name}: no executed column-verified product to read")
        cols = self._work.a_encoding()
        return None if cols is None else Checksums(cols=cols)

    def abandon(self) -> None:
        """Forget an execute that will not be settled (its caller failed in between)."""
        if self._pending is not None:
            self._forget()

    def _forget(self) -> None:
        """Drop the execute in flight, what it left in the workspace and the claim on the plan
        (an abandon, or an execute that failed midway)."""
        if self._work is not None and self._verify_columns:
            self._work.abandon()
        self._pending = None
        if self._claim.locked():
            self._claim.release()

    def settle(self, *, checksums: bool = False) -> Report | tuple[Report, Checksums]:
        """Read the verdict of the last execute; repair (or report) what it flagged.

        Parameters
        ----------
        checksums : bool
            Also return the encodings of the delivered product, ready to hand on (as the
            ``a_checksums`` of a next product): ``Checksums(cols=...)`` on the default path (a
            view of a workspace, valid until the next execute); rows too with
            ``directions="both"``; none with ``"rows by consumer"``.

        Returns
        -------
        Report
            What was found and done (``report.checked[name]`` counts the verified products).

        Raises
        ------
        UncorrectableError
            When ``check="correct"`` and no verified result could be delivered.
        """
        self._start_settle()
        self._ledger.fetch()
        self.counters.syncs += 1
        self._be.synchronize()
        return self._finish_settle(checksums)

    def _start_settle(self) -> None:
        """Make the copy of the verdicts to the host wait for this plan's launches."""
        if self._pending is None:
            raise RuntimeError(f"{self.name}: settle() without an execute")
        if self._rows is not None and not self._rows.verdict_made:
            raise RuntimeError(f"{self.name}: settle() before judge(): with directions="
                               f"{CONSUMER_ROWS!r} the consumer fills observed and calls judge() "
                               "first (or abandon() the execute)")
        if self._verify_columns:
            self._work.ready_verdict()

    def _finish_settle(self, checksums: bool) -> Report | tuple[Report, Checksums]:
        """With the verdict on the host: report, run the rare path if it flagged anything, and
        deliver the product into an ``out`` it was not computed in (the rare path's reads of
        the device counted in ``counters.host_reads``)."""
        pending, self._pending = self._pending, None
        try:
            return self._deliver(pending, checksums)
        finally:
            self._claim.release()

    def _deliver(self, pending: _Pending,
                 checksums: bool) -> Report | tuple[Report, Checksums]:
        """:meth:`_finish_settle`'s report, rare path and delivery."""
        with reads_counted_by(self.counters):
            op, c = pending.op, pending.c
            report, sums = Report(), None
            if self._rows is not None:
                if self._rows.flagged():
                    self.counters.rare_paths += 1
                    self._rows.rare_path(op, c, self.check, pending.name, report)
            elif self._verify_columns and not self._work.verdict_flagged():
                sums = Checksums(cols=self._work.observed_cols()) if checksums else None
            else:
                self.counters.rare_paths += 1
                sums = protect(self._be, op, c, self.check, pending.name, report,
                               pending.a_checksums)
                self.counters.copies += 2  # its encodings, out of the observed records
                if self._verify_columns:  # the fast path hands on column encodings only
                    sums = Checksums(cols=sums.cols)
            report.checked[pending.name] = op.batch
            if op.out is not None and not op.direct:
                op.deliver(c)
            return (report, sums) if checksums else report

    def reset_constant(self, a: Any, b: Any, bias: Any | None = None) -> None:
        """Recompute the encoding of the constant ``a`` (after the weight changed); ``b`` and
        ``bias``: any operands of the planned layout."""
        if not self._constant_a:
            raise ValueError(f"{self.name}: planned without constant_a")
        if self._work is not None:
            self._work.encode(self._planned(a, b, bias).a)

    def release(self) -> None:
        """Free the workspaces; the plan cannot execute afterwards."""
        self._forget()
        if self._work is not None:
            self._work.release()
        self._work = None
        self._signature = None

    def __enter__(self) -> "ProtectedMatmul":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ----------------------------------------------------------------- private

    def _readable(self, enc: Any) -> Any:
        """A handed-on encoding as the kernels read it: itself when each field vector is
        contiguous, else a contiguous copy (counted)."""
        if enc.shape[2] < 2 or enc.strides[2] == enc.itemsize:
            return enc
        self.counters.copies += 1
        return self._be.xp.ascontiguousarray(enc)

    def _planned(self, a: Any, b: Any, bias: Any | None, out: Any | None = None) -> Operands:
        if self._signature is None:
            raise RuntimeError(f"{self.name}: the plan was released")
        if self._layout is not None:
            op = self._layout.operands(a, b, bias, out)
            if op is not None:
                return op
        op = Operands.prepare(a, b, bias, out)
        if signature_of(op) != self._signature:
            raise ValueError(f"{self.name}: operands {_describe(signature_of(op))} do not match "
                             f"the plan ({_describe(self._signature)})")
        return op


@dataclass(frozen=True)
class _Layout:
    """The planned operands' array type, dtype and shapes, to accept an execute's operands
    without re-validating them when they match exactly (arrays of the planned type, dtype and
    shapes, bias C-contiguous, a writable out of the product's shape): the common case, a
    few comparisons instead of what :meth:`Operands.prepare` checks. It keeps shapes,
    not the planning arrays."""

    kind: type
    dtype: np.dtype
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    bias_shape: tuple[int, ...] | None
    xp: Any
    a3_shape: tuple[int, ...]
    b3_shape: tuple[int, ...]
    batch_shape: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, a: Any, b: Any, bias: Any | None, op: Operands) -> "_Layout | None":
        """The layout of planned arrays ``a``, ``b``, ``bias`` that ``op`` only reshapes;
        None for anything else (array-likes, promotions, 1-D operands, broadcasts)."""
        if (layout_key(a, b, bias) is None
                or any(x is not None and x.dtype != op.dtype for x in (a, b, bias))
                or a.ndim < 2 or b.ndim < 2 or a.size != op.a.size or b.size != op.b.size):
            return None
        return cls(type(a), op.dtype, a.shape, b.shape, None if bias is None else bias.shape, op.xp,
                   op.a.shape, op.b.shape, op.batch_shape, op.shape)

    def operands(self, a: Any, b: Any, bias: Any | None, out: Any | None) -> Operands | None:
        """``Operands`` of arrays of exactly this layout, else None (validate them fully)."""
        kind, dtype = self.kind, self.dtype
        if not (type(a) is kind and type(b) is kind and a.dtype == dtype and b.dtype == dtype
                and a.shape == self.a_shape and b.shape == self.b_shape):
            return None
        if (bias is None) != (self.bias_shape is None) or bias is not None and not (
                type(bias) is kind and bias.dtype == dtype and bias.shape == self.bias_shape
                and bias.flags.c_contiguous):
            return None
        if out is not None and not (type(out) is kind and out.dtype == dtype
                                    and out.shape == self.shape
                                    and (kind is not np.ndarray or out.flags.writeable)):
            return None
        return Operands(self.xp, a.reshape(self.a3_shape), b.reshape(self.b3_shape), bias,
                        self.batch_shape, self.shape, out)


def layout_key(*arrays: Any | None) -> tuple | None:
    """What identifies the layout of NumPy or CuPy ``arrays`` (None entries allowed): their array
    type and device, and each one's dtype and shape. None for anything else (array-likes, a mix
    of array types). A plan takes arrays of the layout it was made from without validating them
    (:class:`_Layout`); plan caches are keyed by this."""
    first = arrays[0]
    kind = type(first)
    if kind is np.ndarray:
        device = -1
    elif is_cupy_array(first):
        device = first.device.id
    else:
        return None
    if any(x is not None and type(x) is not kind for x in arrays):
        return None
    return (kind, device) + tuple(None if x is None else (x.dtype, x.shape) for x in arrays)


def settle_all(plans: list[ProtectedMatmul]) -> list[Report]:
    """Settle several executed plans with one host synchronization.

    The verdict copies of every plan are queued, one per distinct :class:`Ledger` among the plans
    (plans that share one are read in one transfer), the host waits once, and each plan then
    reports (running its rare path if flagged), in order. Plans of several backends (CPU and
    GPU) are waited for on each; each distinct :class:`Counters` among the plans (plans may
    share one) counts one sync per backend its plans run on.

    Returns
    -------
    list of Report
        One per plan, in order.

    Raises
    ------
    ValueError
        A plan is listed twice (nothing is settled).
    TypeError
        Something listed is not a :class:`ProtectedMatmul` (nothing is settled).
    UncorrectableError
        As :meth:`ProtectedMatmul.settle`: the first plan's that raised, once every plan is
        settled (none is left pending); its ``report`` holds every plan's findings, in order
        (the repairs of the plans that delivered among them).
    """
    plans = list(plans)
    wrong = [type(p).__name__ for p in plans if not isinstance(p, ProtectedMatmul)]
    if wrong:
        raise TypeError(f"settle_all takes ProtectedMatmul plans, got {', '.join(wrong)}")
    if len({id(p) for p in plans}) != len(plans):
        raise ValueError("settle_all: a plan is listed twice")
    for plan in plans:
        plan._start_settle()
    for ledger in {id(p._ledger): p._ledger for p in plans}.values():
        ledger.fetch()
    for counters, _ in {(id(p.counters), id(p._be)): (p.counters, p._be) for p in plans}.values():
        counters.syncs += 1
    for backend in {id(p._be): p._be for p in plans}.values():
        backend.synchronize()
    reports, failure = [], None
    for plan in plans:
        try:
            reports.append(plan._finish_settle(False))
        except UncorrectableError as exc:
            failure = failure or exc
            reports.append(exc.report)
    if failure is not None:
        failure.report = Report()
        for report in reports:
            failure.report.extend(report)
        raise failure
    return reports


@dataclass
class _Pending:
    op: Operands
    c: Any
    a_checksums: Checksums | None
    name: str  # the site of this execute


def _check_encoding(x: Any, k: int, enc: Any, name: str, what: str, of: str) -> None:
    """A handed-on encoding of operand ``x`` must be float64 ``(3, 1 or x's batch, k)`` on the
    operands' array module (the GPU kernels read it by its strides, unchecked)."""
    rows = x.shape[0]
    shape = getattr(enc, "shape", None)
    if (type(enc) is not type(x) or enc.dtype != np.float64 or len(shape) != 3
            or shape[0] != 3 or shape[2] != k or shape[1] not in (1, rows)):
        got = (f"{type(enc).__name__} {getattr(enc, 'dtype', '')} of shape {shape}"
               if shape is not None else type(enc).__name__)
        batch = "1" if rows == 1 else f"1 or {rows}"
        raise ValueError(f"{name}: {what} must be a float64 {type(x).__module__.split('.')[0]} "
                         f"array of shape (3, {batch}, {k}), {of}; got {got}")


def signature_of(op: Operands) -> tuple:
    bias = None if op.bias is None else op.bias.shape
    return (op.xp.__name__, op.dtype, op.a.shape, op.b.shape, op.shape, bias)


def _describe(sig: tuple) -> str:
    xp, dtype, a, b, _, bias = sig
    return f"{xp} {dtype} {a} @ {b}" + ("" if bias is None else f" + bias {bias}")
