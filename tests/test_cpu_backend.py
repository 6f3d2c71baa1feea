"""CPU-backend details that the backend-generic tests do not reach."""
from __future__ import annotations

import numpy as np

from abftgemm import _cpu


def test_float16_upcast_is_bit_exact_for_every_pattern_and_layout():
    """The float16 lookup table gives exactly NumPy's conversion, NaN payloads and signed zeros
    included, for contiguous and strided inputs."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    for x in (every, every.reshape(256, 256)[:, ::3], every.reshape(16, 64, 64).transpose(0, 2, 1)):
        got = _cpu._as_float32(x)
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_array_equal(got.view(np.uint32), x.astype(np.float32).view(np.uint32))
