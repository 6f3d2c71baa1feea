"""abftgemm.cuda_structs: struct arguments of CUDA kernels, as NumPy lays them out (no CuPy)."""
from __future__ import annotations

import numpy as np
import pytest

from abftgemm.cuda_structs import KernelStruct

MIXED = KernelStruct("Mixed", [("a", "int32"), ("n", "int64"), ("b", "int32"), ("x", "float64")])


def test_fields_are_padded_as_a_c_compiler_pads_them():
    assert [MIXED.dtype.fields[n][1] for n in MIXED.dtype.names] == [0, 8, 16, 24]
    assert MIXED.dtype.itemsize == 32


def test_an_argument_is_one_element_holding_the_values_and_zero_padding():
    arg = MIXED(a=-3, n=np.int64(7), b=True, x=0.5)
    assert arg.shape == (1,)
    assert arg.tobytes() == (np.int32(-3).tobytes() + bytes(4) + np.int64(7).tobytes()
                             + np.int32(1).tobytes() + bytes(4) + np.float64(0.5).tobytes())


@pytest.mark.parametrize("values, error, match", [
    (dict(a=1, n=0, b=2), TypeError, r"missing \['x'\], unknown \[\]"),
    (dict(a=1, n=0, b=2, x=0.0, y=1), TypeError, r"missing \[\], unknown \['y'\]"),
    (dict(a=1.5, n=0, b=2, x=0.0), TypeError, "Mixed.a is int32: pass an integer, got float"),
    (dict(a=1, n=0, b=2, x="0"), TypeError, "Mixed.x is float64: pass a number, got str"),
    (dict(a=2**31, n=0, b=2, x=0.0), OverflowError, "Mixed.a = 2147483648 does not fit int32"),
    (dict(a=1, n=0, b=-2**31 - 1, x=0.0), OverflowError, "Mixed.b = -2147483649 does not fit"),
])
def test_bad_values_are_refused_by_name(values, error, match):
    with pytest.raises(error, match=match):
        MIXED(**values)


@pytest.mark.parametrize("fields, match", [
    ([], "distinct names"),
    ([("a", "int32"), ("a", "int64")], "distinct names"),
    ([("a", "U4")], "Bad.a: kind must be an integer or floating type"),
    ([("a", "bool")], "Bad.a: kind must be an integer or floating type"),
])
def test_bad_declarations_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        KernelStruct("Bad", fields)
