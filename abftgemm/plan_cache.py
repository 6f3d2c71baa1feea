"""The plans behind :func:`abftgemm.matmul`: a small cache per thread, keyed by what a plan fixes.

Repeated products of one layout (the same shapes, dtype, device, bias presence, check mode,
directions and site name) reuse one :class:`~abftgemm.plan.ProtectedMatmul` and so its
workspaces, with nothing to validate or allocate beyond the result. The cache is per thread
because a plan has one execute in flight at a time; it keeps the :data:`CAPACITY` most recently
used plans (a plan's workspaces are small next to its product, except 16-bit products on the CPU,
whose float32 copies of the operands and the product live in the plan).

:func:`planned_operands` finds the plan of arrays seen before without validating them again:
each plan remembers the exact layouts (array type, dtype, shapes) of the calls that made or
reused it, and arrays of such a layout are taken as they are. That saves ``Operands.prepare``
(tens of microseconds, a few percent of a 512^3 product on the CPU).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from abftgemm.backend import is_cupy_array
from abftgemm.operands import Operands
from abftgemm.plan import ProtectedMatmul, _Layout, signature_of

#: Plans kept per thread.
CAPACITY = 8

_local = threading.local()


def cached_plan(op: Operands, check: str, directions: str, name: str,
                arrays: tuple[Any, Any, Any] | None = None) -> ProtectedMatmul:
    """The plan for ``op`` (validated operands) and these options, made on first use.

    ``arrays``: the ``(a, b, bias)`` that ``op`` was prepared from; when ``op`` only reshapes
    them, their layout is remembered for :func:`planned_operands`.
    """
    plans, layouts = _plans(), _layouts()
    key = (signature_of(op), _device(op.xp), check, directions, name)
    plan = plans.get(key)
    if plan is None:
        plan = ProtectedMatmul(op.a, op.b, bias=op.bias, check=check, directions=directions,
                               name=name)
        plans[key] = plan
        while len(plans) > CAPACITY:
            evicted = plans.popitem(last=False)[1]
            evicted.release()
            for stale in [k for k, (_, p, _) in layouts.items() if p is evicted]:
                del layouts[stale]
    plans.move_to_end(key)
    if arrays is not None:
        layout = _Layout.of(*arrays, op)
        layout_key = _layout_key(*arrays, check, directions, name)
        if layout is not None and layout_key is not None:
            layouts[layout_key] = (layout, plan, key)
    return plan


def planned_operands(a: Any, b: Any, bias: Any | None, out: Any | None, check: str,
                     directions: str, name: str) -> tuple[ProtectedMatmul, Operands] | None:
    """The cached plan and operands for arrays of a layout a plan was made or used for, taken
    without validation; None for anything else (validate with ``Operands.prepare``)."""
    key = _layout_key(a, b, bias, check, directions, name)
    entry = None if key is None else _layouts().get(key)
    if entry is None:
        return None
    layout, plan, plan_key = entry
    op = layout.operands(a, b, bias, out)
    if op is None:
        return None
    _plans().move_to_end(plan_key)
    return plan, op


def clear_plan_cache() -> None:
    """Release every cached plan of the calling thread (frees their workspaces)."""
    plans = _plans()
    _layouts().clear()
    while plans:
        plans.popitem()[1].release()


def _layout_key(a: Any, b: Any, bias: Any | None, check: str, directions: str,
                name: str) -> tuple | None:
    """What identifies arrays' layout and the options (None for anything but arrays)."""
    kind = type(a)
    if kind is np.ndarray:
        device = -1
    elif is_cupy_array(a):
        device = a.device.id
    else:
        return None
    if type(b) is not kind or (bias is not None and type(bias) is not kind):
        return None
    return (kind, a.dtype, b.dtype, a.shape, b.shape, None if bias is None else bias.shape,
            device, check, directions, name)


def _plans() -> OrderedDict:
    if not hasattr(_local, "plans"):
        _local.plans = OrderedDict()
    return _local.plans


def _layouts() -> dict:
    """Layout key -> (``_Layout``, plan, plan key), for :func:`planned_operands`."""
    if not hasattr(_local, "layouts"):
        _local.layouts = {}
    return _local.layouts


def _device(xp: Any) -> int:
    return xp.cuda.Device().id if xp.__name__ == "cupy" else -1
