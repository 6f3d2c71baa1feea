"""CPU (numba) kernel composing a column encoding from the encodings of its blocks.

:func:`stack` is the CPU's :func:`attention.functional._stacked_encoding` (the array-module
version the GPU runs), one call instead of a dozen small NumPy operations, whose call overheads
count in a small layer's step.
"""
from __future__ import annotations

from typing import Any

import numba


@numba.njit(cache=True)
def stack(parts: Any, batch: int, out: Any) -> None:
    """Column encoding ``out`` ``(1, width, 3)`` of a ``(batch * seq, width)`` matrix from the
    column encodings of its head blocks over each batch item's ``seq`` rows: ``parts``, a tuple
    of ``(batch * heads, head_dim, >= 3)`` float64 arrays side by side. Plain and absolute sums
    add up over the items; the location weight of row ``s`` of item ``b``, ``(b * seq + s + 1)
    / (batch * seq)``, is ``b / batch`` plus the item's own ``(s + 1) / seq`` over ``batch``
    (item 0 adds no ``0 * inf``)."""
    col = 0
    for x in parts:
        heads, width = x.shape[0] // batch, x.shape[1]
        for h in range(heads):
            for c in range(width):
                plain = weighted = absolute = 0.0
                for b in range(batch):
                    e = x[b * heads + h, c]
                    plain += e[0]
                    weighted += e[1] / batch
                    if b:
                        weighted += b / batch * e[0]
                    absolute += e[2]
                out[0, col, 0], out[0, col, 1], out[0, col, 2] = plain, weighted, absolute
                col += 1
