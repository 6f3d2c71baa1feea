"""Seeded fault injectors for ``fault_hook(site, c)`` (docs/design.md, Fault model), which gets the
raw product ``c``, C-contiguous ``(..., m, n)``, NumPy or CuPy. :class:`Fault` is such a hook,
:class:`Recorder` one that only records; :func:`chain` composes.

>>> fault = Fault("bitflip", "row", seed=3, sites="scores", bit=30)
>>> abftgemm.matmul(a, b, fault_hook=fault, name="scores")  # doctest: +SKIP
>>> fault.injected[0].rows, fault.injected[0].old, fault.injected[0].new  # doctest: +SKIP
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
from ml_dtypes import finfo  # NumPy's, bfloat16's included

from abftgemm.backend import array_module

__all__ = ["KINDS", "PATTERNS", "Call", "Fault", "Injection", "FaultHook", "Recorder",
           "bit_layout", "bit_name", "chain", "near_inf_value"]

KINDS: tuple[str, ...] = ("bitflip", "multibit", "inf", "-inf", "nan", "near-inf", "additive",
                          "scale")
PATTERNS: tuple[str, ...] = ("element", "row", "column", "tile", "warp")

WARP_SIZE = 32
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_CONSTANTS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}

FaultHook = Callable[[str, Any], None]


def bit_layout(dtype: Any) -> tuple[int, int]:
    """Return ``(mantissa_bits, exponent_bits)`` of a floating-point dtype.

    Parameters
    ----------
    dtype
        float16, ``ml_dtypes.bfloat16``, float32 or float64 (anything ``numpy.dtype`` accepts).

    Returns
    -------
    tuple of int
        E.g. ``(10, 5)`` for float16, ``(7, 8)`` for bfloat16, ``(23, 8)`` for float32; the sign
        is the top bit.
    """
    info = finfo(np.dtype(dtype))
    return int(info.nmant), int(info.nexp)


def bit_name(dtype: Any, bit: int) -> str:
    """Name bit position ``bit`` of ``dtype``: ``"sign"``, ``"exponent k"`` or ``"mantissa k"``.

    Bit 0 is the least significant mantissa bit; exponent bits are numbered from 0 (least
    significant) upwards, so for float32 bit 30 is ``"exponent 7"`` and bit 22 ``"mantissa 22"``.

    Raises
    ------
    ValueError
        If ``bit`` is outside ``[0, 8 * itemsize)``.
    """
    mantissa, exponent = bit_layout(dtype)
    _check_bit(dtype, bit)
    if bit < mantissa:
        return f"mantissa {bit}"
    if bit < mantissa + exponent:
        return f"exponent {bit - mantissa}"
    return "sign"


def near_inf_value(dtype: Any) -> float:
    """The magnitude ``"near-inf"`` sets: ``min(1e10, 0.5 * finfo(dtype).max)``."""
    return min(1e10, 0.5 * float(finfo(np.dtype(dtype)).max))


def _check_bit(dtype: Any, bit: int) -> None:
    width = 8 * np.dtype(dtype).itemsize
    if not 0 <= bit < width:
        raise ValueError(f"bit {bit} is outside [0, {width}) for {np.dtype(dtype).name}")


@dataclass(frozen=True)
class Injection:
    """What one :class:`Fault` call did to one matrix.

    ``rows``, ``cols``, ``old`` and ``new`` are aligned, one entry per affected element of
    ``c[batch]``; ``bits`` lists the flipped bit positions (empty for non-bit kinds).
    """

    site: str
    kind: str
    pattern: str
    batch: tuple[int, ...]
    rows: list[int]
    cols: list[int]
    old: list[float]
    new: list[float]
    bits: tuple[int, ...] = ()

    @property
    def changed(self) -> list[bool]:
        """Per element: whether the value changed numerically (NaN to NaN counts as unchanged)."""
        return [o != n and not (math.isnan(o) and math.isnan(n))
                for o, n in zip(self.old, self.new)]


@dataclass
class Fault:
    """A seeded fault injector usable as ``fault_hook``: ``fault(site, c)`` corrupts ``c`` in place.

    The change is reproducible from the seed and recorded in :attr:`injected`. Only the selected
    elements travel to the host and back, so it works unchanged on CuPy arrays.

    Parameters
    ----------
    kind
        One of :data:`KINDS`, applied to every element the pattern selects:

        - ``"bitflip"``: flip bit ``bit`` (0 is the least significant mantissa bit, the sign the
          top one; see :func:`bit_name`). High exponent bits give huge values, INF or NaN; low
          mantissa bits tiny errors. Exact in every dtype: the unsigned-integer view is flipped.
        - ``"multibit"``: flip the distinct ``bits``, or ``nbits`` drawn ones.
        - ``"inf"``, ``"-inf"``, ``"nan"``: set that value.
        - ``"near-inf"``: set :func:`near_inf_value` with the sign of the original.
        - ``"additive"``: add ``magnitude`` (rounded to the dtype: a tiny one may change nothing).
        - ``"scale"``: multiply by ``factor``.
    pattern
        One of :data:`PATTERNS`, within the matrix ``c[batch]``:

        - ``"element"``: the element ``(row, col)``.
        - ``"row"`` / ``"column"``: the whole row ``row`` / column ``col``.
        - ``"tile"``: the ``tile = (height, width)`` rectangle with top-left corner ``(row, col)``.
        - ``"warp"``: the 32 elements of row ``row`` from the multiple of 32 at or below ``col``.

        Clipped to the matrix.
    seed
        Seed of the ``numpy.random.Generator`` drawing positions and unspecified bits.
    sites
        A site name or a collection of names to inject at; None (default) means any site.
    times
        Number of calls to inject into (default 1), after which the fault stays quiet; None means
        every matching call.  Calls on empty matrices do not count.
    skip
        Matching calls to let pass untouched before the first injection (default 0).  Where a
        hook is called once per tile (the fused attention core's sites), this picks the tile.
    batch
        Batch index (flat int, or tuple over the batch dimensions); drawn when None.
    row, col, tile
        See ``pattern``; ``row`` and ``col`` are drawn when None.
    bit, bits, nbits, magnitude, factor
        See ``kind``; bits are drawn when None (``nbits`` from 2 to 4).

    Attributes
    ----------
    injected : list of Injection
        One record per call that injected, in call order.
    """

    kind: str = "bitflip"
    pattern: str = "element"
    seed: int | None = 0
    _: KW_ONLY
    sites: str | Collection[str] | None = None
    times: int | None = 1
    skip: int = 0
    batch: int | tuple[int, ...] | None = None
    row: int | None = None
    col: int | None = None
    bit: int | None = None
    bits: tuple[int, ...] | None = None
    nbits: int | None = None
    tile: tuple[int, int] = (4, 4)
    magnitude: float = 1.0
    factor: float = 2.0
    injected: list[Injection] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {KINDS}")
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown fault pattern {self.pattern!r}; expected one of {PATTERNS}")
        if self.bit is not None and self.kind != "bitflip":
            raise ValueError("'bit' applies only to kind 'bitflip'")
        if (self.bits is not None or self.nbits is not None) and self.kind != "multibit":
            raise ValueError("'bits' and 'nbits' apply only to kind 'multibit'")
        if self.bits is not None:
            self.bits = tuple(int(b) for b in self.bits)
            if not self.bits or len(set(self.bits)) != len(self.bits):
                raise ValueError(f"'bits' must be distinct and non-empty, got {self.bits}")
        if self.times is not None and self.times < 0:
            raise ValueError(f"'times' must be >= 0 or None, got {self.times}")
        if self.skip < 0:
            raise ValueError(f"'skip' must be >= 0, got {self.skip}")
        self._skipped = 0
        if min(self.tile) < 1:
            raise ValueError(f"'tile' must be positive, got {self.tile}")
        if self.sites is not None:
            self.sites = frozenset([self.sites] if isinstance(self.sites, str) else self.sites)
        self._rng = np.random.default_rng(self.seed)

    def __call__(self, site: str, c: Any) -> None:
        """Inject into ``c`` (shape ``(..., m, n)``) in place if ``site`` and ``times`` allow."""
        if (self.sites is not None and site not in self.sites or c.size == 0
                or self.times is not None and len(self.injected) >= self.times):
            return
        if self._skipped < self.skip:
            self._skipped += 1
            return
        batch, rows, cols = self._region(c.shape)
        bits = self._bits(c.dtype)
        xp = array_module(c)
        region = c.view(_UINT[c.dtype.itemsize])[batch + (rows, cols)]  # bits only: no arithmetic
        old = (region.get() if xp is not np else region.copy()).view(c.dtype)
        new = self._corrupt(old, bits)
        region[...] = xp.asarray(new.view(region.dtype))
        r, k = np.mgrid[rows, cols]
        with np.errstate(invalid="ignore"):  # NaN to float64 without a cast warning
            old, new = (x.astype(np.float64).ravel().tolist() for x in (old, new))
        self.injected.append(Injection(
            site=site, kind=self.kind, pattern=self.pattern, batch=batch,
            rows=r.ravel().tolist(), cols=k.ravel().tolist(), old=old, new=new, bits=bits))

    def _region(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], slice, slice]:
        """The batch index and the row and column slices the pattern covers."""
        *batch_shape, m, n = shape
        batch = self._batch(tuple(batch_shape))
        row = self._position(self.row, m, "row")
        col = self._position(self.col, n, "col")
        height, width = self.tile if self.pattern == "tile" else (1, 1)
        if self.pattern == "row":
            col, width = 0, n
        elif self.pattern == "column":
            row, height = 0, m
        elif self.pattern == "warp":
            col, width = col - col % WARP_SIZE, WARP_SIZE
        return batch, slice(row, min(row + height, m)), slice(col, min(col + width, n))

    def _batch(self, batch_shape: tuple[int, ...]) -> tuple[int, ...]:
        if isinstance(self.batch, tuple):
            in_range = all(0 <= i < size for i, size in zip(self.batch, batch_shape))
            if len(self.batch) != len(batch_shape) or not in_range:
                raise IndexError(f"batch index {self.batch} is out of range for {batch_shape}")
            return tuple(int(i) for i in self.batch)
        flat = self._position(self.batch, math.prod(batch_shape), "batch")
        return tuple(int(i) for i in np.unravel_index(flat, batch_shape))

    def _position(self, given: int | None, size: int, what: str) -> int:
        if given is None:
            return int(self._rng.integers(size))
        if not 0 <= given < size:
            raise IndexError(f"{what} {given} is out of range for size {size}")
        return int(given)

    def _bits(self, dtype: Any) -> tuple[int, ...]:
        """The bit positions to flip (drawn now if not configured); empty for non-bit kinds."""
        width = 8 * np.dtype(dtype).itemsize
        if self.kind == "bitflip":
            bits = (int(self._rng.integers(width)),) if self.bit is None else (self.bit,)
        elif self.kind != "multibit":
            return ()
        elif self.bits is not None:
            bits = self.bits
        else:
            count = int(self._rng.integers(2, 5)) if self.nbits is None else self.nbits
            if not 1 <= count <= width:
                raise ValueError(f"cannot flip {count} distinct bits of a {width}-bit value")
            return tuple(sorted(int(b) for b in self._rng.choice(width, count, replace=False)))
        for b in bits:
            _check_bit(dtype, b)
        return bits

    def _corrupt(self, old: np.ndarray, bits: tuple[int, ...]) -> np.ndarray:
        """New values (same dtype) for the host array ``old``."""
        if bits:
            udtype = _UINT[old.dtype.itemsize]
            return (old.view(udtype) ^ udtype(sum(1 << b for b in bits))).view(old.dtype)
        if self.kind in _CONSTANTS:
            return np.full_like(old, _CONSTANTS[self.kind])
        wide = old.astype(np.float64)
        if self.kind == "near-inf":
            return np.copysign(near_inf_value(old.dtype), wide).astype(old.dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            new = wide + self.magnitude if self.kind == "additive" else wide * self.factor
            return new.astype(old.dtype)


def chain(*hooks: FaultHook) -> FaultHook:
    """Compose fault hooks: the result calls each of ``hooks`` in order with ``(site, c)``."""

    def hook(site: str, c: Any) -> None:
        for h in hooks:
            h(site, c)

    return hook


@dataclass(frozen=True)
class Call:
    """One call seen by a :class:`Recorder`."""

    site: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class Recorder:
    """A hook that records ``(site, shape, dtype)`` of every call and changes nothing.

    Attributes
    ----------
    calls : list of Call
        Every call, in order.
    """

    calls: list[Call] = field(default_factory=list)

    def __call__(self, site: str, c: Any) -> None:
        self.calls.append(Call(site, tuple(c.shape), np.dtype(c.dtype)))

    @property
    def sites(self) -> set[str]:
        """The distinct site names seen."""
        return {call.site for call in self.calls}
