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
    """Column encoding ``out`` ``(3, 1, width)`` of a ``(batch * seq, width)`` matrix from the
    column encodings of its head blocks over each batch item's ``seq`` rows: ``parts``, a tuple
    of ``(3, batch * heads, head_dim)`` float64 encodings side by side. Plain and absolute sums
    add up over the items; the location weight of row ``s`` of item ``b``, ``(b * seq + s + 1)
    / (batch * seq)``, is ``b / batch`` plus the item's own ``(s + 1) / seq`` over ``batch``
    (item 0 adds no ``0 * inf``)."""
    col = 0
    for x in parts:
        heads, width = x.shape[1] // batch, x.shape[2]
        for h in range(heads):
            for c in range(width):
                plain = weighted = absolute = 0.0
                for b in range(batch):
                    t = b * heads + h
                    plain += x[0, t, c]
                    weighted += x[1, t, c] / batch
                    if b:
                        weighted += b / batch * x[0, t, c]
                    absolute += x[2, t, c]
                out[0, 0, col], out[1, 0, col], out[2, 0, col] = plain, weighted, absolute
                col += 1
