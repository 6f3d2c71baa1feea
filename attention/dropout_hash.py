"""The counter-based keep decisions of the fused core's attention dropout
(:mod:`attention.fused`): no ``L x L`` mask is stored, each decision is regenerated where it is
needed (forward and backward, tile by tile) from ``(seed, head, query, key)``.

Element ``(b, i, j)`` of an ``(n, seq_q, seq_k)`` product has the counter ``c = (b seq_q + i)
seq_k + j + 1`` and the 64-bit hash ``h = mix64(seed + c G)`` (SplitMix64: ``G`` its odd
increment, ``mix64`` its finalizer; all arithmetic modulo ``2^64``). The entry is kept when the
top 24 bits of ``h``, a uniform integer ``u`` in ``[0, 2^24)``, reach the threshold ``t =
ceil(p 2^24)``: the keep probability is ``1 - t / 2^24``, within ``2^-24`` of ``1 - p``; ``p =
1`` keeps nothing. :func:`keep_mask` materializes the same decisions with NumPy (for tests and
for running the unfused core on the same draw); the numba kernels of :mod:`attention._cpu_fused`
make them per tile with the same constants.
"""
from __future__ import annotations

import math

import numpy as np

#: SplitMix64's increment (``2^64`` over the golden ratio, odd) and finalizer multipliers.
GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
#: The keep decision reads the hash's top :data:`BITS` bits.
BITS = 24
SHIFT = np.uint64(64 - BITS)


def threshold(p: float) -> np.uint64:
    """``ceil(p 2^24)``: an entry is kept when its 24-bit draw is at least this (``p`` in ``(0,
    1]``)."""
    p = float(p)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"dropout must be a probability in (0, 1], got {p}")
    return np.uint64(math.ceil(p * 2 ** BITS))


def check_seed(seed: int) -> np.uint64:
    """``seed`` as the hash's ``uint64``; an integer in ``[0, 2^64)``, else ``ValueError``."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"dropout_seed must be an integer, got {type(seed).__name__}")
    if not 0 <= int(seed) < 2 ** 64:
        raise ValueError(f"dropout_seed must be in [0, 2**64), got {seed}")
    return np.uint64(int(seed))


def draw_seed(rng: np.random.Generator | None) -> int:
    """A seed drawn from ``rng`` (a new unseeded generator when None)."""
    rng = np.random.default_rng() if rng is None else rng
    return int(rng.integers(0, 2 ** 63, dtype=np.int64))


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a ``uint64`` array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


def keep_mask(seed: int, p: float, shape: tuple[int, int, int]) -> np.ndarray:
    """The fused core's keep mask of a product of shape ``(n, seq_q, seq_k)`` (True = kept),
    materialized: the decisions its kernels regenerate per tile (module docstring).

    Parameters
    ----------
    seed : int
        In ``[0, 2^64)``.
    p : float
        Dropout probability, in ``(0, 1]``.
    shape : tuple of 3 ints
        ``(batch * heads, seq_q, seq_k)``.

    Returns
    -------
    ndarray of bool, C-contiguous, ``shape``.
    """
    seed_u, t = check_seed(seed), threshold(p)
    if len(shape) != 3 or min(shape) < 0:
        raise ValueError(f"shape must be (batch * heads, seq_q, seq_k), got {shape}")
    count = int(np.prod(shape))
    c = np.arange(1, count + 1, dtype=np.uint64)
    return ((mix64(seed_u + c * GAMMA) >> SHIFT) >= t).reshape(shape)
