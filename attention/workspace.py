"""The planned products and reusable buffers of an attention layer, per shape.

A :class:`Workspace` holds one planned product (:class:`abftgemm.ProtectedMatmul`) per site,
layout, check mode and verification, all counting into one :class:`abftgemm.plan.Counters`, and the
intermediate buffers a pass reuses from call to call. Every verdict of a pass (its products',
its softmax checks') lands in one verdict ledger per array module (:mod:`abftgemm.verdicts`),
read from the device in one transfer when the pass settles. Outputs and saved activations are not
kept here: they are new arrays every call.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from abftgemm.backend import array_module

from abftgemm.plan import Counters, ProtectedMatmul
from abftgemm.verdicts import Ledger, Slot


class Workspace:
    """Plans and buffers, created on first use and reused at the same shapes."""

    def __init__(self) -> None:
        self.counters = Counters()
        self._plans: dict[tuple, ProtectedMatmul] = {}
        self._buffers: dict[tuple, Any] = {}
        self._ledgers: dict[str, Ledger] = {}
        self._slots: dict[tuple, Slot] = {}

    def product(self, site: str, a: Any, b: Any, bias: Any | None, check: str,
                a_triangle: str | None = None, constant_a: bool = False, *,
                directions: str = "columns", out_triangle: str | None = None) -> ProtectedMatmul:
        """The planned product of ``site`` for these operands' layout and these options (see
        :class:`abftgemm.ProtectedMatmul`); with ``constant_a``, a plan that encodes ``a`` once
        (at planning, from this ``a``)."""
        key = (site, check, _layout(a), _layout(b), None if bias is None else bias.shape,
               a_triangle, constant_a, directions, out_triangle)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = ProtectedMatmul(
                a, b, bias=bias, check=check, directions=directions, name=site,
                constant_a=constant_a, a_triangle=a_triangle, out_triangle=out_triangle,
                counters=self.counters, verdicts=self.ledger(array_module(a)))
        return plan

    def ledger(self, xp: Any) -> Ledger:
        """The verdict ledger of this workspace's checks on array module ``xp``."""
        ledger = self._ledgers.get(xp.__name__)
        if ledger is None:
            ledger = self._ledgers[xp.__name__] = Ledger(xp, self.counters)
        return ledger

    def slot(self, name: str, xp: Any, n: int) -> Slot:
        """``n`` verdict counts in :meth:`ledger`, reserved for the check ``name`` once."""
        key = (name, xp.__name__, n)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = self.ledger(xp).reserve(n)
        return slot

    def buffer(self, name: str, xp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """A C-contiguous array reused by every call with this name, shape and dtype."""
        key = (name, xp.__name__, tuple(shape), np.dtype(dtype))
        buf = self._buffers.get(key)
        if buf is None:
            self.counters.allocations += 1
            buf = self._buffers[key] = xp.empty(shape, dtype=dtype)
        return buf

    def abandon(self) -> None:
        """Forget every pending execute (a pass that failed or is replayed)."""
        for plan in self._plans.values():
            plan.abandon()

    def clear(self) -> None:
        """Drop every plan and buffer."""
        self.abandon()
        self._plans.clear()
        self._buffers.clear()
        self._ledgers.clear()
        self._slots.clear()


def _layout(x: Any) -> tuple:
    return (type(x), x.dtype, x.shape, x.strides)
