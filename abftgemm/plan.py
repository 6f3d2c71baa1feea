"""Planned protected products: plan once, then execute many times with nothing but the work
(docs/design.md, "The planned product")."""
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


def check_option(name: str, value: Any, allowed: tuple) -> None:
    """The one validation of the library's string options (``check``, ``directions``, ...): a
    ``ValueError`` naming the option, what it allows and what it got."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass
class Counters:
    """What a plan has done since it was created.

    Attributes
    ----------
    launches : int
        Kernel launches: the GEMM (with the float32 copies of a 16-bit CPU product), adding a
        bias, and each verification kernel.
    allocations : int
        Arrays allocated: workspaces at planning; per execute an output when ``out`` is not a
        C-contiguous array the plan can write, and a copy of an operand the product cannot read
        in place (a batch broadcast in part; on the GPU negative strides).
    syncs : int
        Host synchronizations (one per clean settle).
    rare_paths : int
        Settles that ran the full two-direction path (its launches not in ``launches``): every
        settle of ``directions="both"``, and of a column plan only when its fast path flagged.
    plans : int
        Plans made with these counters (none in a reused cache's steady state).
    copies : int
        Checksum encodings copied (:mod:`abftgemm.checksums`): a handed-on one with non-contiguous
        field vectors, one made out of a reduction's records or kept beyond its workspace.
    host_reads : int
        Device-to-host transfers of verdicts: one per ledger page fetched
        (:mod:`abftgemm.verdicts`), and the details of a failed check that others read.
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
        Operands (NumPy or CuPy) of the shapes, dtype and array module the plan is made for, as
        :func:`abftgemm.matmul` takes them.
    bias : array (n,), optional
        Planned with a bias: every execute adds one inside the protection.
    check : {"correct", "detect"}
        What :meth:`settle` does with a finding: repair (or raise), or report only.
    directions : {"columns", "both", "rows by consumer"}
        ``"columns"`` (default): the fast path verifies column checksums only. ``"both"``: rows
        and columns on every call. ``"rows by consumer"``: the execute predicts the row
        checksums; the kernel that consumes the product observes them into :attr:`observed` and
        calls :meth:`judge` (no bias; :mod:`abftgemm.consumer_rows`).
    name : str
        Site name in reports and for ``fault_hook``.
    constant_a : bool
        ``a`` does not change between executes (a weight): its column encoding is computed once
        here, and again only after :meth:`reset_constant`.
    a_triangle : {None, "lower", "upper"}
        A promise that every ``a`` is zero outside this triangle of its last two axes
        (``"lower"``: ``a[..., i, j] == 0`` for ``j > i``, as causal attention probabilities;
        ``"upper"``: for ``j < i``). The CPU's GEMM then multiplies only the blocks the triangle
        can hold; the verification reads ``a`` whole, so it still sees a broken promise.
    out_triangle : {None, "lower"}
        With ``"rows by consumer"``: only entries ``j <= i`` of the product are read (causal
        attention's scores and ``dP``). Where the backend skips the rest (the CPU,
        float32/float64), row ``i`` is computed, observed and verified up to
        :attr:`row_limits` ``[i]`` only. The rare path completes the product first.
    counters : Counters, optional
        Counters to add to (several plans may share one); default a new one, :attr:`counters`.
    verdicts : Ledger, optional
        Where the plan's verdict counts live (:mod:`abftgemm.verdicts`): plans that share one
        are read from the device in one transfer at :func:`settle_all`; default its own.

    Attributes
    ----------
    observed : array (batch, m, 5) or None
        With ``"rows by consumer"``: where the consumer writes the row checksums it observed
        (as a backend's ``row_reduce`` with default weights).
    row_limits : array (m,) or None
        With ``out_triangle``: how many leading columns of each row are verified; None: all.

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
        check_option("directions", directions, DIRECTIONS + (CONSUMER_ROWS,))
        check_option("a_triangle", a_triangle, (None, "lower", "upper"))
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
        self._constant_a, self._a_triangle = constant_a, a_triangle
        self._verify_columns = directions == "columns"
        thresholds = (threshold_coefficients(op.k, op.m, op.dtype, op.bias is not None),
                      safe_magnitude(op.k, op.dtype)) if self._verify_columns else None
        self._work: Workspace = self._be.plan_workspace(op, self.counters, thresholds, self._ledger)
        if self._verify_columns and constant_a:
            self._work.encode(op.a)
        self._rows = ConsumerRows(self._be, op, out_triangle, self.counters,
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
            As :func:`abftgemm.matmul`'s. A C-contiguous array of the product's shape and dtype
            that overlaps no operand receives the product directly; any other at :meth:`settle`.
        fault_hook : callable ``(site, c)``, optional
            Sees the raw product before verification (fault injection).
        a_checksums : Checksums, optional
            ``a_checksums.cols``, the column encoding of ``a`` ``(3, 1 or a's batch, k)`` handed
            on from an earlier product, read in place of ``a`` (copied, and counted in
            :attr:`Counters.copies`, when its last axis is not contiguous).
        b_rows : Checksums, optional
            With ``"rows by consumer"``: ``b_rows.rows``, the row encoding of ``b``
            ``(3, 1 or b's batch, k)``, taken as ``a_checksums`` is; without it ``b`` is read
            once more (not used with :attr:`row_limits`).
        gemm : callable, optional
            Writes ``a @ b (+ bias)`` into ``out`` (then required, written directly) in place of
            the plan's GEMM (say the framework's, on the tensors behind the arrays), verified.
        name : str, optional
            The site of this execute, for ``fault_hook`` and the report (default: the plan's).

        Returns
        -------
        array
            The product (``out`` when given). Do not trust it before :meth:`settle` returns.

        Raises
        ------
        RuntimeError
            While an execute of this plan is in flight (in any thread), or after :meth:`release`.
        TypeError
            When ``fault_hook`` or ``gemm`` is not callable (before anything is written).
        ValueError
            When the operands, ``out`` or a handed-on encoding do not fit the plan.
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
            if used is not given and used.base is not given and used.size:  # else a view of it
                self.counters.allocations += not op.xp.may_share_memory(given, used)
        if not op.direct:
            if gemm is not None or self._rows is not None and out is not None:
                raise ValueError(f"{name}: a gemm or a consumer needs out, a C-contiguous "
                                 f"{op.dtype} array of shape {op.shape} that overlaps no operand")
            self.counters.allocations += 1
        if a_checksums is not None and self._constant_a:
            raise ValueError(f"{name}: a_checksums given to a plan with a constant a")
        a_cols = self._handed_on(op.a, op.k, None if a_checksums is None else a_checksums.cols,
                                 f"{name}: a_checksums.cols", "the column encoding of a")
        b_enc = self._handed_on(op.b, op.k, None if b_rows is None else b_rows.rows,
                                f"{name}: b_rows.rows", "the row encoding of b")
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
            self._rows.predict(op, b_enc)
        elif self._verify_columns:
            if a_cols is not None:
                self._work.set_encoding(a_cols)
            self._work.predict(op, a_cols is None and not self._constant_a)
            self._work.observe_flag(c)
        self._pending = _Pending(op, c, None if a_cols is None else Checksums(cols=a_cols), name)
        return c.reshape(op.shape) if op.out is None else op.out

    def judge(self) -> None:
        """With ``"rows by consumer"``, once the consumer filled :attr:`observed`: count the
        flagged and unverifiable rows on the device (one launch)."""
        if self._rows is None or self._pending is None:
            raise RuntimeError(f"{self.name}: judge() needs an executed plan with directions="
                               f"{CONSUMER_ROWS!r}")
        self._rows.judge()

    def observed_checksums(self) -> Checksums:
        """Column encoding ``(3, batch, n)`` of the last executed product as observed: what
        :meth:`settle` hands on, available before it (trusted only once the settle is clean).
        A workspace view, valid until the next execute; ``directions="columns"`` plans only."""
        return Checksums(cols=self._executed_columns().observed_cols())

    def a_encoding(self) -> Checksums | None:
        """Column encoding ``(3, batch or 1, k)`` of ``a`` as the last execute's prediction used
        it, to hand on to another product of the same ``a``: a workspace view, valid until the
        next execute; None where the backend kept partial sums only (the GPU, of an ``a`` its
        kernel encoded). ``directions="columns"`` plans only."""
        cols = self._executed_columns().a_encoding()
        return None if cols is None else Checksums(cols=cols)

    def abandon(self) -> None:
        """Forget an execute that will not be settled (its caller failed in between)."""
        if self._pending is not None:
            self._forget()

    def _forget(self) -> None:
        """Drop the execute in flight, what it left in the workspace and the claim on the plan."""
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
            Also return the encodings of the delivered product, to hand on as the next product's
            ``a_checksums``: columns (on the default path a workspace view, valid until the next
            execute), rows too with ``directions="both"``, none with ``"rows by consumer"``.

        Returns
        -------
        Report
            What was found and done (``report.checked[name]`` counts the verified products).
        Checksums
            With ``checksums=True`` only, the second of a pair ``(report, checksums)``.

        Raises
        ------
        UncorrectableError
            When ``check="correct"`` and no verified result could be delivered.
        RuntimeError
            Without an execute to settle, or (``"rows by consumer"``) before :meth:`judge`.
        """
        _fetch_verdicts([self])
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
        """With the verdict on the host: report, repair what it flagged, deliver into ``out``."""
        pending, self._pending = self._pending, None
        report, sums = Report(), None
        try:
            with reads_counted_by(self.counters):
                op, c, name = pending.op, pending.c, pending.name
                if self._rows is not None:
                    if self._rows.flagged():
                        self.counters.rare_paths += 1
                        self._rows.rare_path(op, c, self.check, name, report)
                elif self._verify_columns and not self._work.verdict_flagged():
                    sums = Checksums(cols=self._work.observed_cols()) if checksums else None
                else:
                    self.counters.rare_paths += 1
                    sums = protect(self._be, op, c, self.check, name, report, pending.a_checksums)
                    self.counters.copies += 2  # its encodings, out of the observed records
                    if self._verify_columns:  # the fast path hands on column encodings only
                        sums = Checksums(cols=sums.cols)
                report.checked[name] = op.batch
                if op.out is not None and not op.direct:
                    op.deliver(c)
        finally:
            self._claim.release()
        return (report, sums) if checksums else report

    def reset_constant(self, a: Any, b: Any, bias: Any | None = None) -> None:
        """Recompute the encoding of the constant ``a`` (after the weight changed); ``b`` and
        ``bias``: any operands of the planned layout."""
        if not self._constant_a:
            raise ValueError(f"{self.name}: planned without constant_a")
        op = self._planned(a, b, bias)  # first: raises on a released plan
        self._work.encode(op.a)

    def release(self) -> None:
        """Free the workspaces; the plan cannot execute afterwards."""
        self._forget()
        if self._work is not None:
            self._work.release()
        self._work = self._signature = None

    def __enter__(self) -> "ProtectedMatmul":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _executed_columns(self) -> Workspace:
        """The workspace of an executed ``directions="columns"`` plan."""
        if self._pending is None or not self._verify_columns:
            raise RuntimeError(f"{self.name}: no executed column-verified product to read")
        return self._work

    def _handed_on(self, x: Any, k: int, enc: Any | None, what: str, of: str) -> Any | None:
        """Handed-on encoding ``enc`` of operand ``x``, checked (the GPU kernels read it by its
        strides, unchecked) and with contiguous field vectors (else a counted copy)."""
        if enc is None:
            return None
        rows = x.shape[0]
        shape = getattr(enc, "shape", None)
        if (type(enc) is not type(x) or enc.dtype != np.float64 or len(shape) != 3
                or shape[0] != 3 or shape[2] != k or shape[1] not in (1, rows)):
            got = (f"{type(enc).__name__} {getattr(enc, 'dtype', '')} of shape {shape}"
                   if shape is not None else type(enc).__name__)
            batch = "1" if rows == 1 else f"1 or {rows}"
            raise ValueError(f"{what} must be a float64 {type(x).__module__.split('.')[0]} "
                             f"array of shape (3, {batch}, {k}), {of}; got {got}")
        if enc.shape[2] < 2 or enc.strides[2] == enc.itemsize:
            return enc
        self.counters.copies += 1
        return self._be.xp.ascontiguousarray(enc)

    def _planned(self, a: Any, b: Any, bias: Any | None, out: Any | None = None) -> Operands:
        if self._signature is None:
            raise RuntimeError(f"{self.name}: the plan was released")
        op = None if self._layout is None else self._layout.operands(a, b, bias, out)
        if op is None:
            op = Operands.prepare(a, b, bias, out)
            if signature_of(op) != self._signature:
                raise ValueError(f"{self.name}: operands {signature_of(op)} do not match the "
                                 f"plan ({self._signature})")
        return op


@dataclass(frozen=True)
class _Layout:
    """The planned arrays' :func:`layout_key` and the shapes ``Operands.prepare`` made of them:
    arrays of exactly that layout, the common case, are taken without a full validation."""

    key: tuple
    xp: Any
    a3_shape: tuple[int, ...]
    b3_shape: tuple[int, ...]
    batch_shape: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, a: Any, b: Any, bias: Any | None, op: Operands) -> "_Layout | None":
        """The layout of arrays that ``op`` only reshapes (not array-likes, promotions, 1-D
        operands, broadcasts: None)."""
        key = layout_key(a, b, bias)
        if (key is None or any(x is not None and x.dtype != op.dtype for x in (a, b, bias))
                or a.ndim < 2 or b.ndim < 2 or a.size != op.a.size or b.size != op.b.size):
            return None
        return cls(key, op.xp, op.a.shape, op.b.shape, op.batch_shape, op.shape)

    def operands(self, a: Any, b: Any, bias: Any | None, out: Any | None) -> Operands | None:
        """``Operands`` of arrays of exactly this layout, else None (validate them fully)."""
        if layout_key(a, b, bias) != self.key or bias is not None and not bias.flags.c_contiguous:
            return None
        if out is not None and not (type(out) is type(a) and out.dtype == a.dtype
                                    and out.shape == self.shape
                                    and (self.xp is not np or out.flags.writeable)):
            return None
        return Operands(self.xp, a.reshape(self.a3_shape), b.reshape(self.b3_shape), bias,
                        self.batch_shape, self.shape, out)


def layout_key(*arrays: Any | None) -> tuple | None:
    """What identifies the layout of NumPy or CuPy ``arrays`` (None entries allowed): their array
    type and device, and each one's dtype and shape. None for anything else (array-likes, a mix
    of array types). Plan caches are keyed by this."""
    first = arrays[0]
    kind = type(first)
    if kind is not np.ndarray and not is_cupy_array(first):
        return None
    key = [kind, -1 if kind is np.ndarray else first.device.id]
    for x in arrays:  # a loop: faster than generators, on every call of a small product
        if x is not None and type(x) is not kind:
            return None
        key.append(None if x is None else (x.dtype, x.shape))
    return tuple(key)


def settle_all(plans: list[ProtectedMatmul]) -> list[Report]:
    """Settle several executed plans with one host synchronization.

    The verdict copies are queued, one per distinct :class:`Ledger` among the plans, the host
    waits once per backend (each distinct :class:`Counters` counts one sync per backend), and
    each plan then reports (running its rare path if flagged), in order.

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
        settled (none is left pending); its ``report`` holds every plan's findings, in order.
    """
    plans = list(plans)
    wrong = [type(p).__name__ for p in plans if not isinstance(p, ProtectedMatmul)]
    if wrong:
        raise TypeError(f"settle_all takes ProtectedMatmul plans, got {', '.join(wrong)}")
    if len({id(p) for p in plans}) != len(plans):
        raise ValueError("settle_all: a plan is listed twice")
    _fetch_verdicts(plans)
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


def _fetch_verdicts(plans: list[ProtectedMatmul]) -> None:
    """Copy the plans' verdicts to the host: one fetch per ledger, one wait per backend."""
    for plan in plans:
        plan._start_settle()
    if len(plans) == 1:  # matmul's every call: no sets to build
        plan = plans[0]
        plan._ledger.fetch()
        plan.counters.syncs += 1
        plan._be.synchronize()
        return
    for ledger in {id(p._ledger): p._ledger for p in plans}.values():
        ledger.fetch()
    for counters, _ in {(id(p.counters), id(p._be)): (p.counters, p._be) for p in plans}.values():
        counters.syncs += 1
    for backend in {id(p._be): p._be for p in plans}.values():
        backend.synchronize()


@dataclass
class _Pending:
    op: Operands
    c: Any
    a_checksums: Checksums | None
    name: str  # the site of this execute


def signature_of(op: Operands) -> str:
    """What a plan fixes of its operands, as its error messages name it."""
    bias = "" if op.bias is None else f" + bias {op.bias.shape}"
    return f"{op.xp.__name__} {op.dtype} {op.a.shape} @ {op.b.shape} -> {op.shape}{bias}"
