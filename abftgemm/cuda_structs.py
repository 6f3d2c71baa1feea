"""C structs that CUDA kernels take by value, built on the host as NumPy lays them out.

A kernel that groups its scalar arguments into structs (``struct Rows { long long n; int len;
}``) is launched with one-element NumPy arrays of an aligned structured dtype: CuPy passes such an
array's bytes by value (a larger NumPy array is refused as host memory). :class:`KernelStruct`
declares a struct's fields in the kernel's order and builds its arguments; NumPy's ``align=True``
pads the fields as a C compiler does, and the tests compare the layouts with the compilers' own.

Numbers only: pointers stay kernel parameters of their own, each ``__restrict__``. NVCC compiles
the loads of a kernel into read-only ``ld.global.nc`` only when every pointer it takes is such a
parameter; one pointer inside a struct parameter loses them all. No CuPy import.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy


class KernelStruct:
    """One C struct a CUDA kernel takes by value.

    Parameters
    ----------
    c_name : str
        Its name in the kernel source (``"softmax::Rows"``), for the layout checks.
    fields : sequence of (str, str)
        ``(name, kind)`` in declaration order; ``kind`` is a NumPy integer or floating type name
        (``"int32"``, ``"int64"``, ``"float64"``, ...).

    Raises
    ------
    ValueError
        On no fields, a repeated name, or a kind that is not an integer or floating type.
    """

    def __init__(self, c_name: str, fields: Sequence[tuple[str, str]]):
        names = [name for name, _ in fields]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"{c_name}: fields need distinct names, got {names}")
        for name, kind in fields:
            if numpy.dtype(kind).kind not in "iuf":
                raise ValueError(f"{c_name}.{name}: kind must be an integer or floating type, "
                                 f"got {kind!r}")
        self.c_name = c_name
        self.dtype = numpy.dtype({"names": names, "formats": [kind for _, kind in fields]},
                                 align=True)

    def __call__(self, **values: Any) -> numpy.ndarray:
        """The kernel argument: a one-element array of :attr:`dtype` holding ``values``.

        Every field must be given: an integer field as an integer or bool, a floating field as a
        number. Padding bytes are zero.

        Raises
        ------
        TypeError
            On a missing or unknown field, or a value of the wrong kind.
        OverflowError
            On an integer outside its field's type.
        """
        names = self.dtype.names
        if set(values) != set(names):
            raise TypeError(f"{self.c_name} takes the fields {names}; missing "
                            f"{sorted(set(names) - set(values))}, unknown "
                            f"{sorted(set(values) - set(names))}")
        out = numpy.zeros(1, self.dtype)
        for name in names:
            out[name] = self._field(name, values[name])
        return out

    def _field(self, name: str, value: Any) -> Any:
        dtype = self.dtype.fields[name][0]
        integer = dtype.kind in "iu"
        kinds = (bool, int, numpy.bool_, numpy.integer)
        if not isinstance(value, kinds if integer else kinds + (float, numpy.floating)):
            raise TypeError(f"{self.c_name}.{name} is {dtype.name}: pass "
                            f"{'an integer' if integer else 'a number'}, got "
                            f"{type(value).__name__}")
        if integer and not numpy.iinfo(dtype).min <= int(value) <= numpy.iinfo(dtype).max:
            raise OverflowError(f"{self.c_name}.{name} = {int(value)} does not fit {dtype.name}")
        return value
