"""The plans behind :func:`abftgemm.matmul`: a :class:`PlanCache`, keyed by what a plan fixes
(docs/design.md, "The planned product": why the key holds no site name)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from abftgemm.operands import Operands
from abftgemm.plan import Counters, ProtectedMatmul, layout_key, signature_of

#: Plans kept by each thread's default cache (a plan's workspaces are small next to its product,
#: except a 16-bit CPU plan's float32 copies).
CAPACITY = 8

_local = threading.local()


class PlanCache:
    """Planned products of :func:`abftgemm.matmul`, made on first use and reused, by one thread
    at a time.

    Parameters
    ----------
    capacity : int, optional
        Keep at most this many plans (the least recently used is released first); None (the
        default) keeps every plan.

    Attributes
    ----------
    counters : Counters
        Shared by every plan of the cache: ``counters.plans`` is the number of plans made.
    """

    def __init__(self, capacity: int | None = None):
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool)
                                     or capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
        self.capacity = capacity
        self.counters = Counters()
        self._plans: OrderedDict[tuple, ProtectedMatmul] = OrderedDict()
        #: Layout key of the arrays -> key of their plan, for :meth:`find`.
        self._layouts: dict[tuple, tuple] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def plan(self, op: Operands, check: str, directions: str,
             arrays: tuple[Any, Any, Any]) -> ProtectedMatmul:
        """The plan for ``op`` (validated operands) and these options, made on first use;
        ``arrays``, the ``(a, b, bias)`` that ``op`` was prepared from: their layout is
        remembered for :meth:`find`."""
        device = op.xp.cuda.Device().id if op.xp.__name__ == "cupy" else -1
        key = (signature_of(op), device, check, directions)
        plan = self._plans.get(key)
        if plan is None:
            # made from the caller's arrays: the plan takes their layout without validation
            a, b, bias = arrays
            plan = ProtectedMatmul(a, b, bias=bias, check=check, directions=directions,
                                   counters=self.counters)
            self._plans[key] = plan
            while self.capacity is not None and len(self._plans) > self.capacity:
                evicted_key, evicted = self._plans.popitem(last=False)
                if not evicted.in_flight:  # one in flight (a fault hook's own products) runs on
                    evicted.release()
                self._layouts = {k: p for k, p in self._layouts.items() if p != evicted_key}
        self._plans.move_to_end(key)
        layout = layout_key(*arrays)
        if layout is not None:  # no None key: find() looks up None for array-likes
            self._layouts[layout, check, directions] = key
        return plan

    def find(self, a: Any, b: Any, bias: Any | None, check: str,
             directions: str) -> ProtectedMatmul | None:
        """The plan made or used for arrays of this layout and these options, found without
        validating them; None for anything else (validate with ``Operands.prepare``)."""
        plan_key = self._layouts.get((layout_key(a, b, bias), check, directions))
        if plan_key is None:
            return None
        self._plans.move_to_end(plan_key)
        return self._plans[plan_key]

    def clear(self) -> None:
        """Release every plan (frees their workspaces)."""
        self._layouts.clear()
        while self._plans:
            self._plans.popitem()[1].release()


def default_plans() -> PlanCache:
    """The calling thread's default cache (:data:`CAPACITY` plans)."""
    if not hasattr(_local, "plans"):
        _local.plans = PlanCache(CAPACITY)
    return _local.plans


def clear_plan_cache() -> None:
    """Release every plan of the calling thread's default cache (frees their workspaces)."""
    default_plans().clear()
