"""One buffer for the verdicts of several checks (an attention layer's planned products and
softmax checks), read from the device in one transfer per page instead of one per check."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Counts per page (4 KiB): the checks of an attention layer's two passes need a few dozen.
PAGE_SLOTS = 512


@dataclass(frozen=True)
class Slot:
    """``n`` consecutive counts of a ledger page: ``device`` where kernels add into them,
    ``host`` where they are read after a :meth:`Ledger.fetch` (the same array on the CPU)."""

    ledger: "Ledger"
    device: Any
    host: np.ndarray

    def clear(self) -> None:
        """Zero the counts (an asynchronous memset on the GPU); the host copy is now stale."""
        if isinstance(self.device, np.ndarray):
            self.device[...] = 0
        else:
            self.device.data.memset_async(0, self.device.nbytes)
        self.ledger.stale = True

    def write(self, counts: Any) -> None:
        """Set the counts from an array of the ledger's module (on the device: no read)."""
        self.device[...] = counts
        self.ledger.stale = True

    def read(self) -> np.ndarray:
        """The counts on the host, fetched first (and waited for) when the ledger is stale."""
        if self.ledger.stale:
            self.ledger.fetch()
            if self.ledger.xp is not np:
                self.ledger.xp.cuda.get_current_stream().synchronize()
        return self.host


class Ledger:
    """Pages of ``uint64`` verdict counts on ``xp`` (``numpy`` or ``cupy``), shared by the checks
    that reserve a :class:`Slot` in them (a new page when the last is full: one more transfer per
    fetch); ``counters`` counts page allocations (``allocations``) and fetches (``host_reads``)."""

    def __init__(self, xp: Any, counters: Any):
        self.xp, self.counters = xp, counters
        self._pages: list[tuple[Any, np.ndarray]] = []
        self._used = PAGE_SLOTS  # of the last page: none yet
        #: True when a launch may have changed a count since the last :meth:`fetch`.
        self.stale = True

    def reserve(self, n: int) -> Slot:
        """``n`` consecutive zeroed counts for one check (``n <= PAGE_SLOTS``)."""
        if not 0 < n <= PAGE_SLOTS:
            raise ValueError(f"a slot holds 1 to {PAGE_SLOTS} counts, not {n}")
        if self._used + n > PAGE_SLOTS:
            self.counters.allocations += 1
            device = host = self.xp.zeros(PAGE_SLOTS, np.uint64)
            if self.xp is not np:
                import cupyx  # only reached with CuPy arrays in play
                host = cupyx.zeros_pinned((PAGE_SLOTS,), np.uint64)
            self._pages.append((device, host))
            self._used = 0
        device, host = self._pages[-1]
        lo, self._used = self._used, self._used + n
        return Slot(self, device[lo:self._used], host[lo:self._used])

    def fetch(self) -> None:
        """Queue the copy of every page into pinned host memory on the current stream (no wait;
        one transfer per page, counted); nothing to copy on the CPU."""
        self.stale = False
        if self.xp is np:
            return
        stream = self.xp.cuda.get_current_stream()
        for device, host in self._pages:
            self.counters.host_reads += 1
            device.get(stream=stream, out=host, blocking=False)
