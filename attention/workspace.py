"""The planned products and reusable buffers of an attention layer, per shape.

A :class:`Workspace` holds one planned product (:class:`abftgemm.ProtectedMatmul`) per site,
layout, check mode and verification, all counting into one :class:`abftgemm.plan.Counters`, and the
intermediate buffers a pass reuses from call to call. Every verdict of a pass (its products',
its softmax checks') lands in one verdict ledger per array module (:mod:`abftgemm.verdicts`),
read from the device in one transfer when the pass settles.

Outputs and saved activations are the caller's: new to the caller every call. On NumPy they come
from :meth:`Workspace.recycled` (the fused core's outputs, the unfused pass's results and saved
arrays), which hands out again an output array that nothing references any more instead of a
new one. A new array of a megabyte or more is fresh memory from the operating system whenever the
C allocator has returned the last one's pages, and its first write then takes a page fault per 4
KiB page (bench/NOTES.md counts them).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import numpy as np

from abftgemm.backend import array_module, reads_counted_by

from abftgemm.plan import Counters, ProtectedMatmul, layout_key
from abftgemm.verdicts import Ledger, Slot


F = TypeVar("F", bound=Callable[..., Any])


def counts_reads(fn: F) -> F:
    """``fn``, whose reads of the device (:func:`abftgemm.backend.to_host`) are counted in the
    ``counters.host_reads`` of its ``workspace`` keyword argument, when one is given."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        workspace = kwargs.get("workspace")
        with reads_counted_by(None if workspace is None else workspace.counters):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


class Workspace:
    """Plans and buffers, created on first use and reused at the same shapes."""

    def __init__(self) -> None:
        self.counters = Counters()
        self._plans: dict[tuple, ProtectedMatmul] = {}
        self._buffers: dict[tuple, Any] = {}
        self._ledgers: dict[str, Ledger] = {}
        self._slots: dict[tuple, Slot] = {}
        self._handed_out: dict[tuple, list[np.ndarray]] = {}

    def product(self, site: str, a: Any, b: Any, bias: Any | None, check: str,
                a_triangle: str | None = None, constant_a: bool = False, *,
                directions: str = "columns", out_triangle: str | None = None) -> ProtectedMatmul:
        """The planned product of ``site`` for these operands' layout and these options (see
        :class:`abftgemm.ProtectedMatmul`); with ``constant_a``, a plan that encodes ``a`` once
        (at planning, from this ``a``)."""
        key = (site, check, layout_key(a, b, bias),
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

    def constant(self, name: str, xp: Any, make: Callable[[], Any]) -> Any:
        """The array ``make()`` returned at the first call with this name and array module."""
        key = (name, xp.__name__)
        value = self._buffers.get(key)
        if value is None:
            self.counters.allocations += 1
            value = self._buffers[key] = make()
        return value

    def recycled(self, name: str, xp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """A C-contiguous array of array module ``xp`` for a new output (contents undefined).
        NumPy: one that an earlier call got here under this name, shape and dtype and that
        nothing references any more (no array, view, tensor or other object holds it: its
        memory could as well have been freed), else a new one. Up to :data:`RECYCLED_PER_KEY`
        arrays per key are remembered (as many as were alive at once, such as one per forward
        until its backward), for the :data:`RECYCLED_KEYS` keys used last; :meth:`clear`
        forgets them all. Other modules: a new array (CuPy's memory pool reuses device memory
        itself)."""
        if xp is not np:
            return xp.empty(shape, dtype=dtype)
        key = (name, tuple(shape), np.dtype(dtype))
        kept = self._handed_out.pop(key, [])
        self._handed_out[key] = kept  # the most recently used key last
        if len(self._handed_out) > RECYCLED_KEYS:
            del self._handed_out[next(iter(self._handed_out))]
        for i in range(len(kept)):
            if _unreferenced(kept, i):
                return kept[i]
        out = np.empty(shape, dtype)
        kept.append(out)
        if len(kept) > RECYCLED_PER_KEY:
            del kept[0]
        return out

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
        self._handed_out.clear()


#: Output arrays :meth:`Workspace.recycled` remembers per name, shape and dtype, and the keys it
#: remembers arrays for (a model called at many shapes keeps those of the latest ones).
RECYCLED_PER_KEY = 8
RECYCLED_KEYS = 32


def _refcount(arrays: list[np.ndarray], i: int) -> int:
    """The reference count of ``arrays[i]`` as seen from here."""
    return sys.getrefcount(arrays[i])


#: :func:`_refcount` of an array only a list holds (measured, so the count's bookkeeping of this
#: interpreter version is the one compared).
_ONLY_LISTED = _refcount([np.empty(0)], 0)


def _unreferenced(arrays: list[np.ndarray], i: int) -> bool:
    """Whether nothing but the list ``arrays`` references ``arrays[i]``."""
    return _refcount(arrays, i) == _ONLY_LISTED

