"""Planned products whose rows are verified by the kernel that consumes them.

Reading a product only to verify it can cost a large part of its GEMM (attention scores on a
GPU). :class:`DeferredRows` plans such a product the way :class:`abftgemm.ProtectedMatmul` plans
an ordinary one: every workspace is allocated at planning, and :meth:`~DeferredRows.execute` runs
the GEMM and predicts the product's row checksums from the operands. The consumer
then fills :attr:`~DeferredRows.observed` with the row checksums of what it read (the fields of a
backend's ``row_reduce`` with default weights) and calls :meth:`~DeferredRows.judge`, one launch
that counts the flagged rows on the device. Nothing reaches the host until :meth:`~DeferredRows.settle`,
which the caller may batch with other plans' settles (one synchronization, then
:meth:`~DeferredRows.settle`). A flag runs the rare path: the full row
verification and repair of :class:`abftgemm.rare_path.DeferredCheck`.

The module knows nothing about its consumers.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from abftgemm.backend import get_backend, to_host
from abftgemm.checksums import Checksums
from abftgemm.encode import predict_rows
from abftgemm.operands import Operands
from abftgemm.plan import Counters, _Layout
from abftgemm.rare_path import DeferredCheck
from abftgemm.report import Report
from abftgemm.thresholds import safe_magnitude, threshold_coefficients

FaultHook = Callable[[str, Any], None]


class DeferredRows:
    """``a @ b`` planned for one layout, its rows verified later by the consumer's read.

    Parameters
    ----------
    a, b : array
        Operands of the planned shapes and dtype, ``(batch or 1, m, k)`` and
        ``(batch or 1, k, n)`` (3-D; no bias).
    check : {"correct", "detect"}
        What :meth:`settle` does with a finding.
    name : str
        Site name in reports and for ``fault_hook``.
    out_triangle : {None, "lower"}
        Only entries ``j <= i`` of the product are wanted (causal attention's scores and
        ``dP``). Where the backend skips the rest (the CPU, float32/float64), row ``i`` is
        computed and verified up to :attr:`row_limits` ``[i]`` only, and the consumer observes
        each row up to there; what lies beyond is never written nor read (a fault there changes
        nothing). On the rare path the product is completed first.
    counters : Counters, optional
        Launches, allocations and host syncs are added to it (shared with other plans).
    """

    def __init__(self, a: Any, b: Any, *, check: str = "correct", name: str = "matmul",
                 out_triangle: str | None = None, counters: Counters | None = None):
        if check not in ("correct", "detect"):
            raise ValueError(f"check must be 'correct' or 'detect' for a plan, got {check!r}")
        if out_triangle not in (None, "lower"):
            raise ValueError(f"out_triangle must be None or 'lower', got {out_triangle!r}")
        op = Operands.prepare(a, b)
        if a.ndim != 3 or b.ndim != 3:
            raise ValueError(f"{name}: DeferredRows plans 3-D operands, got {a.shape} @ {b.shape}")
        self.check, self.name = check, name
        self.counters = Counters() if counters is None else counters
        self.counters.plans += 1
        self._be = get_backend(op.xp)
        self._signature = (op.xp.__name__, op.dtype, op.a.shape, op.b.shape)
        self._layout = _Layout.of(a, b, None, op)
        xp = op.xp
        self._coefficients = threshold_coefficients(op.k, op.n, op.dtype, False)
        self._safe = safe_magnitude(op.k, op.dtype)
        #: How many leading columns of each row are computed, observed and verified, ``(m,)``;
        #: None: every row whole.
        self.row_limits = None if out_triangle is None else \
            self._be.row_limits(op.m, op.n, op.dtype)
        if self.row_limits is None:
            self._b_rows = self._zeros(xp, (op.b.shape[0], op.k, 5))
            # the row encoding of b, contiguous, as the reduction kernels take coefficients
            self._b_coef = self._zeros(xp, (op.b.shape[0], op.k, 3))
        else:  # the encoding of b's leading columns, grown by the prediction
            self._enc = self._zeros(xp, (3, op.k))
        self._pred = self._zeros(xp, (op.batch, op.m, 5))
        #: The consumer writes the observed row checksums of the product here, ``(batch, m, 5)``
        #: (of each row's first ``row_limits[i]`` entries when :attr:`row_limits` is set).
        self.observed = self._zeros(xp, (op.batch, op.m, 5))
        self._verdict = self._zeros(xp, (2,), np.int64)
        # The judge's per-row threshold, flag and verifiability (written, never read here).
        rows = (op.batch, op.m)
        self._judged = (self._zeros(xp, rows), self._zeros(xp, rows, bool),
                        self._zeros(xp, rows, bool))
        self._pending: tuple[Operands, Any] | None = None

    def _zeros(self, xp: Any, shape: tuple[int, ...], dtype: Any = np.float64) -> Any:
        self.counters.allocations += 1
        return xp.zeros(shape, dtype=dtype)

    def execute(self, a: Any, b: Any, out: Any, *, fault_hook: FaultHook | None = None,
                b_rows: Checksums | None = None) -> Any:
        """GEMM into ``out`` and the predicted row checksums, with no allocation: the GEMM, a
        read of ``b`` for its row encoding unless ``b_rows`` hands it on, its copy into the
        coefficients the reductions read, and the prediction (3 or 4 launches); with
        :attr:`row_limits`, the GEMM and a prediction that encodes ``b`` as it goes (2).

        Parameters
        ----------
        a, b : array
            Operands of the planned layout.
        out : array (batch, m, n)
            C-contiguous, of the planned dtype; receives the (unverified) product.
        fault_hook : callable ``(site, c)``, optional
        b_rows : Checksums, optional
            ``b_rows.rows``: row encoding of ``b``, ``(1 or b's batch, k, 3)`` (plain, location-
            weighted and absolute row sums), handed on from an earlier product; without it ``b``
            is read once more. Not used with :attr:`row_limits`, where the prediction reads
            ``b`` for the encodings of its leading columns.

        Returns
        -------
        array
            ``out``. Fill :attr:`observed`, call :meth:`judge`, then settle.
        """
        if self._pending is not None:
            raise RuntimeError(f"{self.name}: settle() the previous execute first")
        op = self._layout.operands(a, b, None, out) if self._layout is not None else None
        if op is None:
            op = Operands.prepare(a, b, None, out)
        if (op.xp.__name__, op.dtype, op.a.shape, op.b.shape) != self._signature or not op.direct:
            raise ValueError(f"{self.name}: operands {op.a.shape} @ {op.b.shape} {op.dtype} into "
                             f"out do not match the plan {self._signature}")
        c = op.buffer()
        if self.row_limits is not None:  # computing row prefixes (the CPU)
            self.counters.launches += 1
            self._be.gemm(op.a, op.b, c, None, out_triangle="lower")
            if fault_hook is not None:
                fault_hook(self.name, c)
            self.counters.launches += 1
            self._be.predict_lower_rows(op.a, op.b, self.row_limits, self._enc, self._pred)
            self._pending = (op, c)
            return out
        if b_rows is not None and b_rows.rows is not None:
            rows = b_rows.rows  # often a view of wider fields
        else:
            self.counters.launches += 1
            self._be.row_reduce(op.b, None, self._b_rows)
            rows = self._b_rows[..., :3]
        self.counters.launches += 1
        self._b_coef[...] = rows  # the reduction kernels read contiguous coefficients
        self.counters.launches += 1
        self._be.gemm(op.a, op.b, c, None)
        if fault_hook is not None:
            fault_hook(self.name, c)
        self.counters.launches += 1
        self._be.row_reduce(op.a, self._b_coef, self._pred)
        self._pending = (op, c)
        return out

    def judge(self) -> None:
        """Count the flagged and unverifiable rows of :attr:`observed` (one launch, on the
        device)."""
        self.counters.launches += 1
        self._verdict[...] = 0
        self._be.flag(self._pred, self.observed, self._coefficients, self._safe, self._verdict,
                      out=self._judged)

    def flagged(self) -> bool:
        """Whether the judged rows flagged; read it after the caller's synchronization (on the
        GPU the two counts then copy without waiting on any work)."""
        return bool(to_host(self._verdict).any())

    def settle(self, report: Report) -> list[int]:
        """Report the verdict; on a flag repair the product in place (``check="correct"``).

        Returns
        -------
        list of int
            Batch indices whose product was modified (the consumer must redo its work there).
            Raises :class:`abftgemm.UncorrectableError` as :func:`abftgemm.matmul` does.
        """
        if self._pending is None:
            raise RuntimeError(f"{self.name}: settle() without an execute")
        (op, c), self._pending = self._pending, None
        if not self.flagged():
            report.checked[self.name] = report.checked.get(self.name, 0) + op.batch
            return []
        if self.row_limits is not None:  # verify whole rows: complete and observe them
            self._be.complete_lower(op.a, op.b, c)
            self._be.row_reduce(c, None, self.observed)
        pending = DeferredCheck(self._be, op, c, predict_rows(self._be, op, None), self.check,
                                self.name)
        return pending.verify_rows(self.observed, report)

    def abandon(self) -> None:
        """Forget an execute that will not be settled."""
        self._pending = None
