"""A ``cupy.ndarray`` stand-in over emulated device memory (:mod:`.memory`).

Like CuPy: arithmetic, indexing, NumPy ufuncs and functions give device arrays (reductions give
0-d arrays); ``np.asarray`` of one raises TypeError (use ``.get()``); mixing in a NumPy array
raises TypeError. Every array is a NumPy view of one :class:`~.memory.Allocation`; a result that
NumPy computed into its own memory is copied into a new allocation.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from cuda_on_cpu import memory


class MemoryPointer:
    """``x.data``: the device address of an array's first element."""

    def __init__(self, array: "ndarray"):
        self._array = array
        self.ptr = array._view.ctypes.data if array._view.size else array._alloc.ptr

    def memset_async(self, value: int, size: int, stream: Any = None) -> None:
        if size > self._array._alloc.nbytes - (self.ptr - self._array._alloc.ptr):
            raise ValueError("memset past the end of the allocation")
        start = self.ptr - self._array._alloc.ptr
        self._array._alloc.bytes[start:start + size] = value & 0xFF
        self._array._alloc.mark_written()

    memset = memset_async


class _Device:
    """``x.device``: device 0."""

    id = 0

    def __eq__(self, other: object) -> bool:
        return getattr(other, "id", None) == 0

    def __hash__(self) -> int:
        return 0

    def __enter__(self) -> "_Device":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


DEVICE = _Device()


class ndarray(NDArrayOperatorsMixin):  # noqa: N801 (CuPy's name)
    """A device array: ``_view`` is the NumPy view of ``_alloc``'s memory it stands for."""

    __slots__ = ("_view", "_alloc", "_base", "__weakref__")

    def __init__(self, view: np.ndarray, alloc: memory.Allocation, base: "ndarray | None" = None):
        self._view, self._alloc, self._base = view, alloc, base

    # ---- attributes
    shape = property(lambda self: self._view.shape)
    dtype = property(lambda self: self._view.dtype)
    strides = property(lambda self: self._view.strides)
    ndim = property(lambda self: self._view.ndim)
    size = property(lambda self: self._view.size)
    itemsize = property(lambda self: self._view.itemsize)
    nbytes = property(lambda self: self._view.nbytes)
    flags = property(lambda self: self._view.flags)
    data = property(lambda self: MemoryPointer(self))
    device = property(lambda self: DEVICE)
    T = property(lambda self: wrap(self._view.T, self))
    mT = property(lambda self: wrap(np.swapaxes(self._view, -1, -2), self))
    real = property(lambda self: wrap(self._view.real, self))
    base = property(lambda self: self._base)  # the array this one is a view of, as CuPy's

    # ---- host transfers
    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None,
            blocking: bool = True) -> np.ndarray:
        if out is None:
            return np.array(self._view, order=order)
        if not isinstance(out, np.ndarray) or out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError("get: out must be a NumPy array of the same shape and dtype")
        out[...] = self._view
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        self._view[...] = arr
        self._alloc.mark_written()

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` "
                        "to construct a NumPy array explicitly.")

    # ---- views and copies
    def view(self, dtype: Any = None) -> "ndarray":
        return wrap(self._view.view(dtype), self)

    def reshape(self, *shape: Any, order: str = "C") -> "ndarray":
        return wrap(self._view.reshape(*shape, order=order), self)

    def copy(self, order: str = "C") -> "ndarray":
        return wrap(self._view.copy(order=order), self)

    def astype(self, dtype: Any, order: str = "K", copy: bool = True, **kw: Any) -> "ndarray":
        return wrap(self._view.astype(dtype, order=order, copy=copy, **kw), self)

    def fill(self, value: Any) -> None:
        self._view.fill(value)
        self._alloc.mark_written()

    def __getitem__(self, key: Any) -> "ndarray":
        return wrap(self._view[unwrap(key)], self)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._view[unwrap(key)] = _device_operand(value)
        self._alloc.mark_written()

    def __len__(self) -> int:
        return len(self._view)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __bool__(self) -> bool:
        return bool(self._view)

    def __int__(self) -> int:
        return int(self._view)

    def __float__(self) -> float:
        return float(self._view)

    def __index__(self) -> int:
        return self._view.__index__()

    def item(self, *args: Any) -> Any:
        return self._view.item(*args)

    def tolist(self) -> Any:
        return self._view.tolist()

    def __repr__(self) -> str:
        return "cupy-on-cpu " + repr(self._view)

    __hash__ = None  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        # The rest of the ndarray API (sum, max, transpose, ravel, ...), on the view; not what
        # only host arrays have.
        if name in _HOST_ATTRIBUTES:
            raise AttributeError(f"a device array has no {name!r} (it is a host-array attribute)")
        attr = getattr(self._view, name)
        if not callable(attr):
            return attr

        def method(*args: Any, **kwargs: Any) -> Any:
            out = kwargs.get("out")
            with np.errstate(all="ignore"):  # a GPU raises no floating-point warnings
                result = attr(*unwrap(args), **unwrap(kwargs))
            if out is not None:
                out._alloc.mark_written()
                return out
            return wrap(result, self)

        return method

    # ---- NumPy protocols, as CuPy implements them
    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        for x in inputs:
            if isinstance(x, np.ndarray) and x.ndim:
                raise TypeError(f"Unsupported type {type(x)} in {ufunc.__name__}: a NumPy array "
                                "mixed with device arrays")
        out = kwargs.get("out")
        with np.errstate(all="ignore"):
            result = getattr(ufunc, method)(*unwrap(inputs), **unwrap(kwargs))
        if out is not None:
            for o in out:
                o._alloc.mark_written()
            return out[0] if len(out) == 1 else out
        return wrap(result, *[x for x in inputs if isinstance(x, ndarray)])

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func in _HOST_FUNCTIONS:
            raise TypeError(f"numpy.{func.__name__} of a device array (use .get() first)")
        with np.errstate(all="ignore"):
            result = func(*unwrap(args), **unwrap(kwargs))
        out = kwargs.get("out")
        if isinstance(out, ndarray):
            out._alloc.mark_written()
            return out
        return wrap(result, *_arrays_in((args, kwargs)))


_HOST_FUNCTIONS = {np.save, np.savez, np.savetxt}
_HOST_ATTRIBUTES = {"ctypes", "__array_interface__", "tofile", "dump", "dumps", "tobytes"}


def _arrays_in(obj: Any) -> list[ndarray]:
    if isinstance(obj, ndarray):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for x in obj for a in _arrays_in(x)]
    if isinstance(obj, dict):
        return [a for x in obj.values() for a in _arrays_in(x)]
    return []


def _device_operand(value: Any) -> Any:
    """A value assigned into a device array: device arrays and scalars (NumPy arrays refused)."""
    if isinstance(value, np.ndarray) and value.ndim > 0:
        raise TypeError("assigning a NumPy array into a device array: use cupy.asarray first")
    return unwrap(value)


def unwrap(obj: Any) -> Any:
    """``obj`` with every device array replaced by its NumPy view (recursively)."""
    if isinstance(obj, ndarray):
        return obj._view
    if isinstance(obj, tuple):
        return tuple(unwrap(x) for x in obj)
    if isinstance(obj, list):
        return [unwrap(x) for x in obj]
    if isinstance(obj, dict):
        return {k: unwrap(v) for k, v in obj.items()}
    return obj


def wrap(result: Any, *sources: ndarray) -> Any:
    """NumPy results as device arrays: views of a source's allocation stay views; anything else
    (a new NumPy array, a NumPy scalar) is copied into a new allocation; other objects pass."""
    if isinstance(result, tuple):
        return tuple(wrap(r, *sources) for r in result)
    if isinstance(result, list) and result and isinstance(result[0], np.ndarray):
        return [wrap(r, *sources) for r in result]
    if isinstance(result, np.generic):
        result = np.asarray(result)
    if not isinstance(result, np.ndarray):
        return result
    for src in sources:
        if src._alloc.owns(result):
            return ndarray(result, src._alloc, src._base if src._base is not None else src)
    return from_host(result)


def from_host(host: np.ndarray, fresh: bool = False) -> ndarray:
    """A new device array with ``host``'s shape, dtype and (unless ``fresh``) contents, C order."""
    host = np.asarray(host)
    alloc = memory.allocate(host.nbytes, fresh)
    view = alloc.bytes.view(host.dtype).reshape(host.shape) if host.ndim else \
        alloc.bytes.view(host.dtype).reshape(())
    if not fresh:
        view[...] = host
    return ndarray(view, alloc)


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    dtype = np.dtype(dtype)
    shape = (shape,) if np.ndim(shape) == 0 else tuple(shape)
    alloc = memory.allocate(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, fresh=True)
    view = alloc.bytes.view(dtype).reshape(shape, order=order)
    return ndarray(view, alloc)
