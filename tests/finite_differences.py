"""Central finite differences, the gradient oracle of the backward tests (float64)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def central_differences(f: Callable[[], float], arr: np.ndarray,
                        indices: Sequence[tuple[int, ...]], eps: float) -> np.ndarray:
    """``d f() / d arr[ix]`` for each ``ix`` in ``indices`` (``arr`` is perturbed in place and
    restored)."""
    out = np.empty(len(indices))
    for n, ix in enumerate(indices):
        old = arr[ix]
        arr[ix] = old + eps
        plus = f()
        arr[ix] = old - eps
        minus = f()
        arr[ix] = old
        out[n] = (plus - minus) / (2 * eps)
    return out
