"""The vectorizable helpers of the CPU softmax kernels (attention/_cpu_vmath.py): integer keys
with the order of the floats (exact round trip, float32 and float64), and float32 exp and log."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attention._cpu_vmath import EXP_FLUSH, exp_like, from_ordered_key, log_like, ordered_key


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


@numba.njit(cache=True)
def _exp_log(x, e, lg):  # noqa: ANN001, ANN202
    for i in range(x.shape[0]):  # vectorized loops, as in the kernels
        e[i] = exp_like(x[i])
    for i in range(x.shape[0]):
        lg[i] = log_like(abs(x[i]))


def _ulps(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - ref) / np.spacing(np.abs(ref).astype(np.float32))


@given(st.lists(st.floats(-87.0, 88.0, width=32), min_size=1, max_size=300))
def test_float32_exp_and_log_are_within_two_ulps_of_float64(values):
    """exp within 2 ulps; log within 2 ulps, or 1e-7 absolute where log is near 0 and its ulp
    vanishes (the log identity's tolerance is absolute, at least 8 float32 roundoffs, 4.8e-7)."""
    x = np.array(values + [0.0, -87.0, 88.0, 1e-30, -1e-30], np.float32)
    e, lg = np.empty_like(x), np.empty_like(x)
    _exp_log(x, e, lg)
    assert _ulps(e, np.exp(x.astype(np.float64))).max() <= 2
    pos = np.abs(x) >= np.finfo(np.float32).tiny  # log_like takes positive normal numbers
    ref = np.log(np.abs(x[pos]).astype(np.float64))
    assert np.all((_ulps(lg[pos], ref) <= 2) | (np.abs(lg[pos] - ref) <= 1e-7))


def test_float32_exp_flushes_below_its_floor_and_takes_minus_infinity():
    x = np.array([-np.inf, EXP_FLUSH - 1, -1000.0, EXP_FLUSH + 0.5], np.float32)
    e, lg = np.empty_like(x), np.empty_like(x)
    _exp_log(x, e, lg)
    assert e[:3].tolist() == [0.0, 0.0, 0.0]
    assert e[3] == pytest.approx(np.exp(np.float64(x[3])), rel=3e-7)


def test_wide_vectors_marks_its_caller_for_512_bit_vectors_and_changes_no_result():
    """A kernel that calls ``wide_vectors`` carries LLVM's ``"prefer-vector-width"="512"`` (one
    that does not, none), and on a CPU with AVX-512 its loop runs in 512-bit registers; its
    results are those of the same loop without it, to the bit."""
    from llvmlite import binding

    from abftgemm.cpu_kernels import wide_vectors

    def exp_of(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_like(x[i] - np.float32(1.0))

    def exp_of_wide(x, out):
        wide_vectors()
        for i in range(x.shape[0]):
            out[i] = exp_like(x[i] - np.float32(1.0))

    plain, wide = numba.njit(exp_of), numba.njit(exp_of_wide)
    x = np.linspace(-90, 80, 4099, dtype=np.float32)
    got, want = np.empty_like(x), np.empty_like(x)
    wide(x, got)
    plain(x, want)
    assert np.array_equal(got, want)
    attribute = '"prefer-vector-width"="512"'
    assert attribute in next(iter(wide.inspect_llvm().values()))
    assert attribute not in next(iter(plain.inspect_llvm().values()))
    if "+avx512f" in binding.get_host_cpu_features().flatten().split(","):
        assert "zmm" in next(iter(wide.inspect_asm().values()))
