"""abftgemm.matmul against the semantics of np.matmul (NumPy arrays) and cupy.matmul (CuPy arrays).

The float cases of NumPy's own matmul tests (numpy/_core/tests/test_multiarray.py, MatmulCommon
and TestMatmul) are ported here with ``abftgemm.matmul`` in place of ``np.matmul``; the expected
values come from ``np.matmul`` on the host. Operands are small integers, so every product is exact
in every dtype and results compare with ``==``.
"""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

import abftgemm
from abftgemm.backend import to_host
from abftgemm.faults import Fault
from conftest import BACKENDS

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BF16]
FLOAT_IDS = [d.name for d in FLOATS]


def expected_dtype(*dtypes):
    """np.matmul's result dtype, except bfloat16 @ bfloat16, which abftgemm keeps in bfloat16."""
    if all(d == BF16 for d in dtypes):
        return BF16
    return np.matmul(*(np.ones((1, 1), d) for d in dtypes)).dtype


def check_equal(xp, got, *host_operands):
    """``got`` has np.matmul's values and shape for the host operands, and the expected dtype."""
    want = np.matmul(*host_operands)
    got_h = np.asarray(to_host(got))
    assert got_h.shape == np.shape(want)
    assert got_h.dtype == expected_dtype(*(x.dtype for x in host_operands))
    np.testing.assert_array_equal(got_h.astype(np.float64), np.asarray(want, np.float64))


# ---------------------------------------------------------------- MatmulCommon (float types)
@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("dims", [((1,), (2,)), ((2, 1), (2,)), ((2,), (1, 2)), ((1, 2), (3, 1)),
                                  ((1,), ()), ((), (1,)), ((1, 1), ()), ((), (1, 1)),
                                  ((2, 2, 1), (3, 1, 2))])
def test_exceptions(xp, dtype, dims):
    a, b = (xp.asarray(np.ones(d, dtype)) for d in dims)
    with pytest.raises(ValueError):
        abftgemm.matmul(a, b)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_shapes_and_result_types(xp, dtype):
    for dims in [((1, 1), (2, 1, 1)), ((2, 1, 1), (1, 1)), ((2, 1, 1), (2, 1, 1))]:
        a, b = (np.ones(d, dtype) for d in dims)
        assert abftgemm.matmul(xp.asarray(a), xp.asarray(b)).shape == (2, 1, 1)
    m, v = np.ones((1, 1), dtype), np.ones((1,), dtype)
    for pair in [(m, v), (v, m), (m, m)]:
        assert abftgemm.matmul(*(xp.asarray(x) for x in pair)).dtype == dtype
    vv = abftgemm.matmul(xp.asarray(v), xp.asarray(v))
    if xp is np:  # vector @ vector is a NumPy scalar of the dtype
        assert type(vv) is dtype.type
    else:  # CuPy has no scalars: cupy.matmul gives a 0-d array
        assert vv.shape == () and vv.dtype == dtype


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_values(xp, dtype):
    """test_scalar_output, test_vector_vector_values, test_vector_matrix_values,
    test_matrix_vector_values and test_matrix_matrix_values, float types."""
    vec = np.array([1, 2], dtype)
    mat1 = np.array([[1, 2], [3, 4]], dtype)
    mat2 = np.array([[1, 0], [1, 1]], dtype)
    m12, m21 = np.stack([mat1, mat2]), np.stack([mat2, mat1])
    cases = [(np.array([2], dtype), np.array([[3, 4]], dtype)),
             (np.array([[3, 4]], dtype).T, np.array([2], dtype)),
             (vec, vec[:, None]), (vec[:, None], vec[None, :]), (vec, vec),
             (vec, mat1), (vec, m12), (mat1, vec), (m12, vec),
             (mat1, mat2), (mat2, mat1), (m12, mat1), (mat1, m12), (m12, m21)]
    for a, b in cases:
        check_equal(xp, abftgemm.matmul(xp.asarray(a), xp.asarray(b)), a, b)


# ---------------------------------------------------------------- TestMatmul
M1 = np.arange(15.).reshape(5, 3)
M2 = np.arange(21.).reshape(3, 7)
M3 = np.arange(30.).reshape(5, 6)[:, ::2]  # non-contiguous
VC, VR, M0 = np.arange(10.), np.arange(6.), np.zeros((3, 0))
DOT_ARGS = [(M1, M2), (M2.T, M1.T), (M2.T.copy(), M1.T), (M2.T, M1.T.copy()),
            (M1, M1.T), (M1.T, M1), (M1, M3.T), (M3, M1.T), (M3, M3.T), (M3.T, M3),
            (M3, M2), (M2.T, M3.T), (M2.T.copy(), M3.T),
            (M1, VR[:3]), (VC[:5], M1), (M1.T, VC[:5]), (VR[:3], M1.T),
            (M1, VR[::2]), (VC[::2], M1), (M1.T, VC[::2]), (VR[::2], M1.T),
            (M3, VR[:3]), (VC[:5], M3), (M3.T, VC[:5]), (VR[:3], M3.T),
            (M3, VR[::2]), (VC[::2], M3), (M3.T, VC[::2]), (VR[::2], M3.T),
            (M0, M0.T), (M0.T, M0), (M1, M0), (M0.T, M1.T)]


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("args", DOT_ARGS)
def test_dot_equivalent(xp, args):
    got = abftgemm.matmul(*(xp.asarray(x) for x in args))
    np.testing.assert_array_equal(to_host(got), np.dot(*args))


@pytest.mark.parametrize("xp", BACKENDS)
def test_out_arg(xp):
    a, b = np.ones((5, 2)), np.array([[1, 3], [5, 7]], dtype=float)
    target = a @ b
    out = xp.zeros((5, 2))
    assert abftgemm.matmul(xp.asarray(a), xp.asarray(b), out) is out  # positional
    np.testing.assert_array_equal(to_host(out), target)
    out = xp.zeros((5, 2))
    assert abftgemm.matmul(xp.asarray(a), xp.asarray(b), out=out) is out
    np.testing.assert_array_equal(to_host(out), target)
    out = xp.zeros((5, 2), dtype=np.int32)  # float -> int is not a same_kind cast
    with pytest.raises(TypeError, match="same_kind"):
        abftgemm.matmul(xp.asarray(a), xp.asarray(b), out=out)
    assert not to_host(out).any()  # nothing was written
    out = xp.zeros((5, 2), dtype=np.complex128)
    assert abftgemm.matmul(xp.asarray(a), xp.asarray(b), out=out) is out
    np.testing.assert_array_equal(to_host(out), target.astype(np.complex128))


@pytest.mark.parametrize("xp", BACKENDS)
def test_empty_out_cannot_be_broadcast(xp):
    arr = xp.ones((0, 1, 1))
    assert abftgemm.matmul(arr, arr).shape == (0, 1, 1)
    with pytest.raises(ValueError, match="shape"):
        abftgemm.matmul(arr, arr, out=xp.ones((1, 1, 1)))


@pytest.mark.parametrize("xp", BACKENDS)
def test_out_contiguous(xp):
    a, b = np.ones((5, 2)), np.array([[1, 3], [5, 7]], dtype=float)
    v = np.array([1, 3], dtype=float)
    ad, bd, vd = xp.asarray(a), xp.asarray(b), xp.asarray(v)
    out = xp.ones((5, 2, 2))
    c = abftgemm.matmul(ad, bd, out=out[..., 0])
    assert c.base is out
    np.testing.assert_array_equal(to_host(c), a @ b)
    np.testing.assert_array_equal(to_host(abftgemm.matmul(ad, vd, out=out[:, 0, 0])), a @ v)
    np.testing.assert_array_equal(to_host(abftgemm.matmul(vd, ad.T, out=out[:, 0, 0])), a @ v)
    out = xp.ones((10, 2))
    np.testing.assert_array_equal(to_host(abftgemm.matmul(ad, bd, out=out[::2, :])), a @ b)
    out = xp.ones((5, 2))
    abftgemm.matmul(bd.T, ad.T, out=out.T)
    np.testing.assert_array_equal(to_host(out), a @ b)


def _layout(m, order, contiguous, xp):
    if contiguous:
        return xp.asarray(m.copy() if order == "C" else np.asfortranarray(m))
    strided = xp.zeros((m.shape[0] * 2, m.shape[1] * 2), dtype=m.dtype, order=order)[::2, ::2]
    strided[...] = xp.asarray(m)
    return strided


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dot_equivalent_matrix_matrix_every_layout(xp, dtype):
    """NumPy issue 29164: every C/F, contiguous/strided combination of a, b and out."""
    m1, m2 = M1.astype(dtype), M2.astype(dtype)
    target = np.dot(m1, m2)
    modes = list(itertools.product(["C", "F"], [True, False]))
    for mode in itertools.product(modes, repeat=3):
        a, b, out = (_layout(m, *md, xp) for m, md in zip((m1, m2, np.zeros_like(target)), mode))
        assert abftgemm.matmul(a, b, out=out) is out
        np.testing.assert_array_equal(to_host(out), target)


# ---------------------------------------------------------------- the cases
@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("shapes", [((2, 0, 64), (64, 64)), ((2, 3, 0), (0, 4)), ((5, 3, 0), (0,)),
                                    ((0,), (0,)), ((3, 0), (0,)), ((1, 2, 3), (0, 3, 4)),
                                    ((2, 1, 3, 0), (1, 4, 0, 5))])
@pytest.mark.parametrize("check", abftgemm.CHECK_MODES)
def test_zero_size_batches(xp, shapes, check):
    a, b = (np.ones(s, np.float32) for s in shapes)
    got = abftgemm.matmul(xp.asarray(a), xp.asarray(b), check=check)
    assert np.shape(got) == np.matmul(a, b).shape
    np.testing.assert_array_equal(to_host(got), np.matmul(a, b))


@pytest.mark.parametrize("xp", BACKENDS)
def test_fault_in_a_product_with_empty_inner_dimension_is_corrected(xp):
    a, b = xp.ones((2, 3, 0), np.float32), xp.ones((0, 4), np.float32)
    c, report = abftgemm.matmul(a, b, fault_hook=Fault("nan", "element", seed=0),
                                return_report=True)
    assert report.detected
    np.testing.assert_array_equal(to_host(c), np.zeros((2, 3, 4)))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("da,db", list(itertools.product(FLOATS, FLOATS)),
                         ids=[f"{x.name}-{y.name}" for x, y in itertools.product(FLOATS, FLOATS)])
def test_mixed_float_dtypes_promote_as_numpy(xp, da, db):
    rng = np.random.default_rng(0)
    a = rng.integers(-2, 3, (2, 3, 4)).astype(da)
    b = rng.integers(-2, 3, (4, 5)).astype(db)
    check_equal(xp, abftgemm.matmul(xp.asarray(a), xp.asarray(b)), a, b)


@pytest.mark.parametrize("xp", BACKENDS)
def test_bias_promotes_with_the_operands(xp):
    a, b = np.ones((3, 4), np.float16), np.ones((4, 2), np.float16)
    bias = np.array([0.5, 1e-4], np.float32)  # 1e-4 is not a float16 value: kept in float32
    c = abftgemm.matmul(xp.asarray(a), xp.asarray(b), bias=xp.asarray(bias))
    assert c.dtype == np.float32
    np.testing.assert_array_equal(to_host(c), np.broadcast_to(np.float32(4) + bias, (3, 2)))


def test_array_likes_are_converted():
    class Wrapped:
        def __array__(self, dtype=None, copy=None):
            return np.array([[1.0, 2.0], [3.0, 4.0]], dtype=dtype)
    np.testing.assert_array_equal(abftgemm.matmul([[1.0, 2.0]], [[3.0], [4.0]]), [[11.0]])
    np.testing.assert_array_equal(abftgemm.matmul(Wrapped(), Wrapped()), [[7, 10], [15, 22]])
    np.testing.assert_array_equal(abftgemm.matmul(np.eye(2), (1.0, 2.0)), [1.0, 2.0])


def test_non_native_byte_order_is_accepted():
    a = np.arange(6, dtype=">f4").reshape(2, 3)
    b = np.arange(12, dtype=">f8").reshape(3, 4)
    c = abftgemm.matmul(a, b)
    assert c.dtype == np.float64 and c.dtype.isnative
    np.testing.assert_array_equal(c, np.matmul(a, b))
    out = np.zeros((2, 4), dtype=">f4")  # same_kind: float64 -> float32 is allowed
    assert abftgemm.matmul(a, b, out=out) is out
    np.testing.assert_array_equal(out, np.matmul(a, b).astype(np.float32))


@pytest.mark.parametrize("xp", BACKENDS)
def test_scalar_and_0d_operands_raise_value_error(xp):
    m, zero_d = xp.ones((2, 2), np.float32), xp.ones((), np.float32)
    pairs = [(m, zero_d), (zero_d, m)]
    if xp is np:  # Python and NumPy scalars are array-likes for NumPy (not for CuPy)
        pairs += [(m, 2.0), (2.0, m), (m, np.float32(2))]
    for a, b in pairs:
        with pytest.raises(ValueError, match="0-d"):
            abftgemm.matmul(a, b)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64, np.complex128])
def test_non_float_dtypes_raise_type_error_naming_the_dtype(xp, dtype):
    a = xp.ones((3, 3), dtype=dtype)
    f = xp.ones((3, 3), dtype=np.float32)
    for pair in [(a, a), (a, f), (f, a)]:  # not promoted to float64 as np.matmul would
        with pytest.raises(TypeError, match=np.dtype(dtype).name):
            abftgemm.matmul(*pair)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.bool_,
                                   np.complex64])
def test_checksums_of_refuses_non_float_dtypes(xp, dtype):
    """``checksums_of`` read any 1-, 2-, 4- or 8-byte array as 16-bit floats: wrong encodings
    without a word, then writes past its buffer (the process crashed)."""
    x = xp.arange(120).reshape(10, 12).astype(dtype)
    before = x.copy()
    with pytest.raises(TypeError, match=np.dtype(dtype).name):
        abftgemm.checksums_of(x)
    assert (x == before).all()


def test_as_float32_refuses_what_is_not_16_bit_floats():
    from abftgemm.cpu_kernels import as_float32

    with pytest.raises(TypeError, match="int32"):
        as_float32(np.ones(4, np.int32))
    with pytest.raises(ValueError, match="out"):
        as_float32(np.ones(8, np.float16), out=np.empty(4, np.float32))
    np.testing.assert_array_equal(as_float32(np.arange(5, dtype=np.float16)), np.arange(5))


def test_object_arrays_raise_type_error_naming_the_dtype():
    a = np.ones((2, 2), dtype=object)
    with pytest.raises(TypeError, match="object"):
        abftgemm.matmul(a, a)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix itself warns
@pytest.mark.parametrize("make", [np.matrix, lambda x: np.ma.array(x, mask=x > 1)],
                         ids=["matrix", "masked"])
def test_matrix_and_masked_arrays_raise_type_error(make):
    x = make(np.arange(4.0).reshape(2, 2))
    for pair in [(x, x), (x, np.ones((2, 2))), (np.ones((2, 2)), x)]:
        with pytest.raises(TypeError, match="plain array"):
            abftgemm.matmul(*pair)
    out = np.zeros((2, 2))
    with pytest.raises(TypeError, match="plain array"):
        abftgemm.matmul(np.ones((2, 2)), np.ones((2, 2)), out=np.matrix(out))


@pytest.mark.skipif(BACKENDS[1].marks[0].args[0], reason="no GPU")
def test_cupy_operand_with_array_like_raises_type_error_as_cupy_does():
    import cupy

    with pytest.raises(TypeError, match="NumPy or CuPy array"):
        abftgemm.matmul(cupy.ones((2, 2), np.float32), [[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(TypeError, match="cupy array"):
        abftgemm.matmul(cupy.ones((2, 2)), cupy.ones((2, 2)), out=np.zeros((2, 2)))


@pytest.mark.parametrize("xp", BACKENDS)
def test_bad_out_raises_and_modifies_nothing(xp):
    a, b = xp.ones((2, 3, 4), np.float32), xp.ones((4, 5), np.float32)
    bad = [(xp.full((2, 3, 6), 7, np.float32), ValueError), (xp.full((3, 5), 7, np.float32),
                                                             ValueError),
           (xp.full((2, 3, 5), 7, np.int16), TypeError), (xp.full((2, 3, 5), 7, bool), TypeError)]
    for out, error in bad:
        before = to_host(out).copy()
        with pytest.raises(error):
            abftgemm.matmul(a, b, out=out)
        np.testing.assert_array_equal(to_host(out), before)
    with pytest.raises(TypeError, match="array"):
        abftgemm.matmul(a, b, out=[[0.0] * 5] * 3)
    if xp is np:
        out = np.full((2, 3, 5), 7, np.float32)
        out.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            abftgemm.matmul(a, b, out=out)


@pytest.mark.parametrize("xp", BACKENDS)
def test_out_leading_dimensions(xp):
    """NumPy broadcasts the result into out's extra leading dimensions; CuPy wants the exact
    shape."""
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    out = xp.zeros((3, 2, 4))
    if xp is np:
        assert abftgemm.matmul(a, b, out=out) is out
        np.testing.assert_array_equal(out, np.broadcast_to(a @ b, (3, 2, 4)))
    else:
        with pytest.raises(ValueError, match="shape"):
            abftgemm.matmul(xp.asarray(a), xp.asarray(b), out=out)


@pytest.mark.parametrize("xp", BACKENDS)
def test_out_may_alias_an_operand(xp):
    x = np.arange(4.0).reshape(2, 2)
    xd = xp.asarray(x.copy())
    assert abftgemm.matmul(xd, xd, out=xd) is xd
    np.testing.assert_array_equal(to_host(xd), x @ x)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "float64"])
def test_faults_are_corrected_in_out(xp, layout):
    """The product is checked and repaired before it reaches out, whatever out's layout."""
    rng = np.random.default_rng(3)
    a = rng.integers(-3, 4, (2, 12, 8)).astype(np.float32)
    b = rng.integers(-3, 4, (8, 10)).astype(np.float32)
    out = {"contiguous": xp.zeros((2, 12, 10), np.float32),
           "strided": xp.zeros((2, 12, 20), np.float32)[..., ::2],
           "float64": xp.zeros((2, 12, 10), np.float64)}[layout]
    c, report = abftgemm.matmul(xp.asarray(a), xp.asarray(b), out, return_report=True,
                                fault_hook=Fault("inf", "row", seed=1))
    assert c is out and report.corrected == 10
    np.testing.assert_array_equal(to_host(out), a @ b)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_with_an_empty_sequence(xp, dtype):
    from attention import MultiHeadAttention

    mha = MultiHeadAttention(16, 4, causal=True, dtype=dtype, xp=xp)
    x = xp.zeros((2, 0, 16), dtype=mha.dtype)
    y, cache = mha.forward(x, mask=xp.zeros((2, 0), dtype=bool))
    dx, grads = mha.backward(x, cache)
    assert y.shape == dx.shape == (2, 0, 16) and not mha.last_report.detected
    for key, g in grads.items():  # nothing to sum over: every gradient is exactly zero
        assert g.shape == mha.params[key].shape and not to_host(g).astype(np.float64).any()
