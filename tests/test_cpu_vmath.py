"""The integer keys the CPU softmax kernels take row maxima with (attention/_cpu_vmath.py): same
order as the floats, exact round trip, in float32 and float64."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attention._cpu_vmath import from_ordered_key, ordered_key


@numba.njit(cache=True)
def _keys(x, keys, back):  # noqa: ANN001, ANN202
    for i in range(x.shape[0]):
        keys[i] = ordered_key(x[i])
        back[i] = from_ordered_key(keys[i])


@pytest.mark.parametrize("dtype,key", [(np.float32, np.int32), (np.float64, np.int64)])
@given(data=st.data())
def test_ordered_keys_sort_like_the_floats_and_invert_exactly(dtype, key, data):
    width = 32 if dtype == np.float32 else 64
    values = data.draw(st.lists(st.floats(allow_nan=False, width=width), min_size=1, max_size=50))
    x = np.array(values + [-0.0, 0.0, -np.inf, np.inf], dtype)
    keys, back = np.empty(x.shape, key), np.empty_like(x)
    _keys(x, keys, back)
    assert back.tobytes() == x.tobytes()  # -0.0 and 0.0 included
    order = np.argsort(keys, kind="stable")
    assert (x[order][:-1] <= x[order][1:]).all()
    assert x[np.argmax(keys)] == x.max() and x[np.argmin(keys)] == x.min()
