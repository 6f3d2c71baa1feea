"""The plans behind :func:`abftgemm.matmul`: a small cache per thread, keyed by what a plan fixes.

Repeated products of one layout (the same shapes, dtype, device, bias presence, check mode,
directions and site name) reuse one :class:`~abftgemm.plan.ProtectedMatmul` and so its
workspaces, with nothing to validate or allocate beyond the result. The cache is per thread
because a plan has one execute in flight at a time; it keeps the :data:`CAPACITY` most recently
used plans (a plan's workspaces are small next to its product, except 16-bit products on the CPU,
whose float32 copies of the operands and the product live in the plan).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from abftgemm.operands import Operands
from abftgemm.plan import ProtectedMatmul, signature_of

#: Plans kept per thread.
CAPACITY = 8

_local = threading.local()


def cached_plan(op: Operands, check: str, directions: str, name: str) -> ProtectedMatmul:
    """The plan for ``op`` (validated operands) and these options, made on first use."""
    plans = _plans()
    key = (signature_of(op), _device(op.xp), check, directions, name)
    plan = plans.get(key)
    if plan is None:
        plan = ProtectedMatmul(op.a, op.b, bias=op.bias, check=check, directions=directions,
                               name=name)
        plans[key] = plan
        while len(plans) > CAPACITY:
            plans.popitem(last=False)[1].release()
    plans.move_to_end(key)
    return plan


def clear_plan_cache() -> None:
    """Release every cached plan of the calling thread (frees their workspaces)."""
    plans = _plans()
    while plans:
        plans.popitem()[1].release()


def _plans() -> OrderedDict:
    if not hasattr(_local, "plans"):
        _local.plans = OrderedDict()
    return _local.plans


def _device(xp: Any) -> int:
    return xp.cuda.Device().id if xp.__name__ == "cupy" else -1
