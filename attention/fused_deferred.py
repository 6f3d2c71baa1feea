"""The fused CUDA core's checks, left on the device until the settle of an attention pass.

An attention pass (:mod:`attention.functional`) reads the device once: every verdict of its steps
lands in one verdict ledger page (:mod:`abftgemm.verdicts`) that its settle fetches. Called alone,
the fused CUDA core (:mod:`attention._cuda_fused`, :mod:`attention.fused_final`) reads its
kernels' records, the finiteness of its inputs and its final checks as it goes. In a pass it
adds each of them to a :class:`Deferred` instead: a count on the device (0: nothing to look at)
and a *look*, the host work that a nonzero count calls for at the settle (book the kernels'
findings, judge a failed final check, refuse a mask). A look
returns whether the pass must be replayed: the replay settles every step as it runs and calls the
fused core alone, which reads, repairs and raises as it does outside a pass.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from abftgemm.backend import array_module
from abftgemm.verdicts import Slot
from attention.context import Context

#: A look: given the context whose report takes its findings, whether the pass must be replayed.
Look = Callable[[Context], bool]


class Deferred:
    """Device counts and their looks, in the order the checks ran."""

    def __init__(self) -> None:
        self._counts: list[Any] = []
        self._looks: list[Look] = []

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, count: Any, look: Look) -> None:
        """One check: ``count``, a 0-d device array (integer or bool; 0 = nothing to look at),
        and the ``look`` that a nonzero count runs at the settle."""
        self._counts.append(count)
        self._looks.append(look)

    def commit(self, slot: Slot) -> None:
        """Write the counts into ``slot`` (``len(self)`` counts of the pass's ledger), on the
        device, before the settle's fetch."""
        xp = array_module(slot.device)
        slot.write(xp.stack([c.astype(np.uint64) for c in self._counts]))

    def look(self, slot: Slot, ctx: Context) -> bool:
        """After the fetch: run the look of each nonzero count, in order, and return whether one
        asks for the pass's replay. That one is the last: the checks after it judged what the
        replay computes again (the kernels' records of non-finite inputs, say)."""
        for n, look in zip(slot.read(), self._looks):
            if n and look(ctx):
                return True
        return False
