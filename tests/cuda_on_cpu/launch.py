"""``cupy.RawModule`` and ``cupy.RawKernel`` on the CPU, with CuPy's conventions: kernels by name
expression, launched as ``kernel(grid, block, args)`` with device arrays passed as pointers,
``None`` as a null pointer, NumPy scalars and one-element NumPy arrays (a struct's bytes) by
value (Python ``int``/``float``/``bool`` as int64/double/bool). The entry point checks every
argument against the kernel's parameter types (a GPU would read the wrong bytes) and the launch
configuration against CUDA's limits."""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from cuda_on_cpu import build, memory
from cuda_on_cpu.arrays import ndarray

MAX_THREADS = 1024
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)


class SimtError(RuntimeError):
    """A kernel launch failed: a sanitizer finding, a bad argument or a bad configuration."""


class _Launch(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("grid", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("ftz", ctypes.c_int), ("nargs", ctypes.c_int),
                ("values", ctypes.POINTER(ctypes.c_void_p)),
                ("sizes", ctypes.POINTER(ctypes.c_int)), ("pointers", ctypes.POINTER(ctypes.c_int)),
                ("error", ctypes.c_char_p), ("error_size", ctypes.c_int)]


class RawModule:
    """CUDA source compiled for the host on first use (see :mod:`.build`)."""

    def __init__(self, code: str | None = None, path: str | None = None,
                 options: tuple[str, ...] = (), backend: str = "nvrtc", translate_cucomplex: bool = False,
                 *, name_expressions: tuple[str, ...] | None = None, jitify: bool = False):
        if code is None:
            raise NotImplementedError("cupy-on-cpu RawModule takes source code")
        if not isinstance(options, tuple) or not all(isinstance(o, str) for o in options):
            raise TypeError(f"options must be a tuple of str, got {options!r}")
        self.code, self.options = code, options
        self.name_expressions = tuple(name_expressions or ())
        # CuPy passes -ftz=true to NVRTC unless the options say otherwise: subnormal float
        # inputs and results are flushed to zero (DAZ and FTZ while its kernels run).
        self.ftz = "-ftz=false" not in options and "--ftz=false" not in options
        defines = tuple(o[2:] for o in options if o.startswith("-D"))
        self._defines = defines
        self._lib: ctypes.CDLL | None = None

    def _library(self) -> ctypes.CDLL:
        with memory.LOCK:  # one build and load per module, even when threads ask at once
            if self._lib is None:
                memory.runtime()  # the hooks, before the module that calls them
                path = build.kernel_library(self.code, self.name_expressions,
                                            defines=self._defines)
                self._lib = ctypes.CDLL(str(path))
            return self._lib

    def get_function(self, name: str) -> "RawKernel":
        if name not in self.name_expressions:
            raise KeyError(f"{name!r} is not among the module's name expressions "
                           f"{self.name_expressions}")
        index = self.name_expressions.index(name)
        entry = getattr(self._library(), f"simt_launch_{index}")
        entry.argtypes = [ctypes.POINTER(_Launch)]
        entry.restype = ctypes.c_int
        return RawKernel(name, entry, self.ftz)


def _dims(value: Any, what: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) for d in dims):
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
    for d, lim, axis in zip(dims, limits, "xyz"):
        if not 1 <= d <= lim:
            raise SimtError(f"invalid configuration argument: {what}.{axis} = {d} (1 to {lim})")
    return dims  # type: ignore[return-value]


def _marshal(arg: Any, i: int, name: str) -> tuple[Any, int, int]:
    """(ctypes storage, size in bytes, is_pointer) of one kernel argument, as CuPy passes it."""
    if isinstance(arg, ndarray):
        return ctypes.c_uint64(arg.data.ptr), 8, 1
    if arg is None:
        return ctypes.c_uint64(0), 8, 1
    if isinstance(arg, np.generic):
        raw = np.array(arg)
        return ctypes.create_string_buffer(raw.tobytes(), raw.itemsize), raw.itemsize, 0
    if isinstance(arg, np.ndarray):  # CuPy passes a one-element array's bytes by value (a struct)
        if arg.size != 1:
            raise TypeError(f"argument {i} of {name}: a NumPy array is host memory (shape "
                            f"{arg.shape}); pass a device array (a one-element NumPy array passes "
                            "by value)")
        return ctypes.create_string_buffer(arg.tobytes(), arg.itemsize), arg.itemsize, 0
    if isinstance(arg, bool):
        return ctypes.c_bool(arg), 1, 0
    if isinstance(arg, int):
        return ctypes.c_int64(arg), 8, 0
    if isinstance(arg, float):
        return ctypes.c_double(arg), 8, 0
    raise TypeError(f"argument {i} of {name}: unsupported type {type(arg).__name__}")


class RawKernel:
    """One kernel of a :class:`RawModule`."""

    def __init__(self, name: str, entry: Any, ftz: bool):
        self.name, self._entry, self._ftz = name, entry, ftz
        self.launches = 0

    def __call__(self, grid: Any, block: Any, args: tuple, *, shared_mem: int = 0,
                 stream: Any = None, enable_cooperative_groups: bool = False) -> None:
        g = _dims(grid, "grid", MAX_GRID)
        b = _dims(block, "block", MAX_BLOCK)
        if b[0] * b[1] * b[2] > MAX_THREADS:
            raise SimtError(f"invalid configuration argument: {b} is more than {MAX_THREADS} "
                            "threads per block")
        if shared_mem:
            raise SimtError("dynamic shared memory is not emulated (no kernel here uses it)")
        if not isinstance(args, tuple):
            raise TypeError("kernel arguments must be a tuple")
        stored = [_marshal(a, i, self.name) for i, a in enumerate(args)]
        n = len(stored)
        values = (ctypes.c_void_p * max(n, 1))(*[ctypes.addressof(s[0]) for s in stored])
        sizes = (ctypes.c_int * max(n, 1))(*[s[1] for s in stored])
        pointers = (ctypes.c_int * max(n, 1))(*[s[2] for s in stored])
        error = ctypes.create_string_buffer(4096)
        launch = _Launch(self.name.encode(), (ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b),
                         int(self._ftz), n, values, sizes, pointers,
                         ctypes.cast(error, ctypes.c_char_p), len(error))
        with memory.LOCK:  # the runtime runs one launch at a time
            self.launches += 1
            failed = self._entry(ctypes.byref(launch)) != 0
        if failed:
            raise SimtError(error.value.decode(errors="replace"))
        for a in args:
            if isinstance(a, ndarray) and not a._alloc.guards_intact():
                raise SimtError(f"{self.name}: a guard zone of an argument was overwritten")
