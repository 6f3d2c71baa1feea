"""Checksum encodings carried between products, and the dtype policy.

A batched matrix ``X`` ``(batch, r, c)`` has a column encoding ``cols``, ``(3, batch, c)``: per
column ``[sum_i X_ic, sum_i w_i X_ic, sum_i |X_ic|]`` with location weights ``w_i = (i+1)/r``, and
a row encoding ``rows``, ``(3, batch, r)``, the same over each row; field-major, each field's
vector contiguous (docs/design.md, "Checksums and location weights" and "The attention core").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from ml_dtypes import bfloat16, finfo  # finfo: NumPy's, bfloat16's included

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t) for t in (np.float16, np.float32, np.float64, bfloat16))


def location_weights(length: int, xp: Any = np) -> Any:
    """Location weights ``(l+1)/length``, ``l = 0..length-1``, float64; within ``(0, 1]`` so that
    the weighted sum of a near-INF error does not overflow where the plain one does not."""
    return xp.arange(1, length + 1, dtype=np.float64) / length


def check_checksums(value: Any, name: str) -> None:
    """A clear ``TypeError`` unless ``value`` (argument ``name``) is None or a Checksums."""
    if value is not None and not isinstance(value, Checksums):
        raise TypeError(f"{name} must be the Checksums that return_checksums=True gave, got "
                        f"{type(value).__name__}")


@dataclass(frozen=True)
class Checksums:
    """Column and/or row encodings of a batched matrix (see the module docstring).

    Attributes
    ----------
    cols : array or None
        ``(3, batch or 1, c)`` float64 column encoding, same array module as the matrix.
    rows : array or None
        ``(3, batch or 1, r)`` float64 row encoding.
    """

    cols: Any | None = None
    rows: Any | None = None

    @property
    def T(self) -> "Checksums":
        """Encodings of the transposed matrix (columns and rows swap)."""
        return Checksums(cols=self.rows, rows=self.cols)


def encoding_of(records: Any) -> Any:
    """The encoding ``(3, batch, L)`` in the first three fields of a reduction's records
    ``(batch, L, 5)`` (:mod:`abftgemm.backend`), as a new C-contiguous array."""
    return records[..., :3].transpose(2, 0, 1).copy()


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """Precision the GEMM accumulates in: float64 for float64 data, float32 otherwise."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def unit_roundoff(dtype: np.dtype) -> float:
    """Half the machine epsilon of ``dtype`` (round-to-nearest relative error bound)."""
    return float(finfo(np.dtype(dtype)).eps) / 2


def smallest_normal(dtype: np.dtype) -> float:
    """Smallest positive normal number of ``dtype``."""
    return float(finfo(np.dtype(dtype)).tiny)


def check_dtype(dtype: np.dtype) -> np.dtype:
    """Return ``dtype`` if it is a supported float type, else raise TypeError."""
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"abftgemm supports {', '.join(map(str, SUPPORTED_DTYPES))}; got {dtype}")
    return dtype
