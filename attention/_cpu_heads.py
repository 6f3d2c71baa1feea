"""The attention layer's head split and merge on the CPU: the copies between the rows of a
``(batch * seq, width)`` matrix, whose columns ``[col0, col0 + heads * head_dim)`` hold the
heads side by side, and the heads' ``(batch, heads, seq, head_dim)`` array, in numba's pool
where the pass runs its products there (:func:`abftgemm.threads.scope_pool`: a pass with the
fused core), else by the array module. The arrays come cold out of the cache (written a product
earlier), and one thread's copy waits on their memory; two wait less (bench/NOTES.md)."""
from __future__ import annotations

from typing import Any

import numba
import numpy as np

from abftgemm.cpu_kernels import twins
from abftgemm.threads import numba_pool_usable, pool_kernels, scope_pool

#: Elements from which the copy runs in the pool (below, starting its threads costs more than
#: they save).
POOL_MIN_ELEMENTS = 1 << 16


def _copy(heads: Any, rows: Any, col0: int, into_rows: bool) -> None:  # pragma: no cover
    """``rows[b * seq + i, col0 + j * d : col0 + (j + 1) * d]`` from ``heads[b, j, i]``
    (``into_rows``), or the other way, rows in parallel."""
    n, h, seq, d = heads.shape
    for task in numba.prange(n * seq):
        b, i = task // seq, task % seq
        row = rows[task]
        for j in range(h):
            head, part = heads[b, j, i], row[col0 + j * d:col0 + (j + 1) * d]
            src, dst = (head, part) if into_rows else (part, head)
            for c in range(d):
                dst[c] = src[c]


_COPY = twins(_copy, cache=True, nogil=True)
#: Unsigned integers of each item size: the copies move bits (float16 and bfloat16 too).
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def split_heads(rows: Any, col0: int, heads: Any) -> None:
    """Heads ``(batch, heads, seq, head_dim)`` from columns ``col0 ..`` of ``rows`` ``(batch *
    seq, width)``."""
    _copy_heads(heads, rows, col0, False)


def merge_heads(heads: Any, rows: Any, col0: int) -> None:
    """Heads ``(batch, heads, seq, head_dim)`` into columns ``col0 ..`` of ``rows`` ``(batch *
    seq, width)``."""
    _copy_heads(heads, rows, col0, True)


def _copy_heads(heads: Any, rows: Any, col0: int, into_rows: bool) -> None:
    if _pooled(rows, heads):
        bits = _BITS[rows.dtype.itemsize]
        pool_kernels(*_COPY)(heads.view(bits), rows.view(bits), col0, into_rows)
        return
    n, h, seq, d = heads.shape  # (the reshape only splits axes: a view, written through)
    block = rows[:, col0:col0 + h * d].reshape(n, seq, h, d).transpose(0, 2, 1, 3)
    if into_rows:
        block[...] = heads
    else:
        heads[...] = block


def _pooled(rows: Any, heads: Any) -> bool:
    """Whether the copy runs in numba's pool: NumPy arrays, C-contiguous, of one dtype, large
    enough, in a scope whose products run there."""
    return (isinstance(rows, np.ndarray) and isinstance(heads, np.ndarray) and scope_pool()
            and numba_pool_usable() and heads.size >= POOL_MIN_ELEMENTS
            and rows.dtype == heads.dtype and rows.dtype.itemsize in _BITS
            and rows.flags.c_contiguous and heads.flags.c_contiguous)
