"""The ``cupy``, ``cupyx`` and ``cupy_backends`` modules of CUDA on the CPU, and
:func:`installed`, which puts them in ``sys.modules`` for the length of a test, so that
abftgemm/_cuda.py, _cuda_plan.py, cuda_kernels.py and attention/_cuda_softmax.py import and run
them unchanged. The device is an H200 as far as the launch code can ask (132 SMs)."""
from __future__ import annotations

import contextlib
import gc
import itertools
import sys
import types
from typing import Any, Iterator

import numpy as np

from cuda_on_cpu import arrays, cublas, launch
from cuda_on_cpu.arrays import ndarray

SM_COUNT = 132
_ATTRIBUTES = {"MultiProcessorCount": SM_COUNT, "MaxThreadsPerBlock": 1024, "WarpSize": 32,
               "MaxSharedMemoryPerBlock": 49152, "ComputeCapabilityMajor": 9,
               "ComputeCapabilityMinor": 0}


# ---------------------------------------------------------------- cupy.cuda
class Event:
    def record(self, stream: "Stream | None" = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    done = True


class Stream:
    """A stream: work runs at once here, so only identity and the current-stream stack matter."""

    _ids = itertools.count(1)
    _stack: list["Stream"] = []

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None):
        self.ptr = 0 if null else (ptr if ptr is not None else next(Stream._ids) * 0x100)

    @classmethod
    def from_external(cls, obj: Any) -> "Stream":
        ptr = obj.__cuda_stream__()[1] if hasattr(obj, "__cuda_stream__") else int(obj)
        return cls(ptr=ptr)

    def __enter__(self) -> "Stream":
        Stream._stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        Stream._stack.pop()

    def synchronize(self) -> None:
        return None

    def record(self, event: Event | None = None) -> Event:
        return event or Event()

    def wait_event(self, event: Event) -> None:
        return None

    def use(self) -> "Stream":
        Stream._stack[:] = [self]
        return self


Stream.null = Stream(null=True)  # type: ignore[attr-defined]


def get_current_stream(device_id: int | None = None) -> Stream:
    return Stream._stack[-1] if Stream._stack else Stream.null  # type: ignore[attr-defined]


class Device:
    def __init__(self, device: int | None = None):
        self.id = 0 if device is None else int(device)
        if self.id != 0:
            raise _runtime.CUDARuntimeError(f"cudaErrorInvalidDevice: device {self.id}")
        self.attributes = dict(_ATTRIBUTES)
        self.compute_capability = "90"

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def use(self) -> None:
        return None


class _CUDARuntimeError(RuntimeError):
    pass


_runtime = types.ModuleType("cupy.cuda.runtime")
_runtime.CUDARuntimeError = _CUDARuntimeError
_runtime.getDevice = lambda: 0
_runtime.getDeviceCount = lambda: 1
_runtime.deviceSynchronize = lambda: None
_runtime.runtimeGetVersion = lambda: 13000
#: CuPy's keys for what scripts print of the device (bench.timing.device_name).
_runtime.getDeviceProperties = lambda device: {
    "name": b"cupy-on-cpu (an H200 to the launch code)", "multiProcessorCount": SM_COUNT,
    "major": _ATTRIBUTES["ComputeCapabilityMajor"], "minor": _ATTRIBUTES["ComputeCapabilityMinor"]}

_shared_handles: dict[int, int] = {}


def get_cublas_handle() -> int:
    """CuPy's per-device cuBLAS handle (shared with other code)."""
    if 0 not in _shared_handles:
        _shared_handles[0] = cublas.create()
    return _shared_handles[0]


_device_mod = types.ModuleType("cupy.cuda.device")
_device_mod.get_cublas_handle = get_cublas_handle
_device_mod.Device = Device

cuda = types.ModuleType("cupy.cuda")
cuda.Device = Device
cuda.Stream = Stream
cuda.ExternalStream = Stream.from_external
cuda.Event = Event
cuda.get_current_stream = get_current_stream
cuda.runtime = _runtime
cuda.device = _device_mod
cuda.is_available = lambda: True


# ---------------------------------------------------------------- cupy
def asarray(a: Any, dtype: Any = None, order: str | None = None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return arrays.from_host(np.asarray(a, dtype=dtype, order=order))


def array(a: Any, dtype: Any = None, copy: bool = True, order: str = "K", ndmin: int = 0) -> ndarray:
    if isinstance(a, ndarray):
        return a.astype(a.dtype if dtype is None else dtype, order=order, copy=True)
    return arrays.from_host(np.array(a, dtype=dtype, order=order, ndmin=ndmin))


def ascontiguousarray(a: ndarray, dtype: Any = None) -> ndarray:
    if not isinstance(a, ndarray):
        raise TypeError(f"cupy.ascontiguousarray takes a device array, got {type(a).__name__}")
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    out = arrays.empty(a.shape, a.dtype if dtype is None else dtype)
    out._view[...] = a._view
    out._alloc.mark_written()
    return out


def asnumpy(a: Any, stream: Any = None, order: str = "C", out: np.ndarray | None = None) -> np.ndarray:
    return a.get(out=out) if isinstance(a, ndarray) else np.asarray(a, order=order)


def empty_like(a: ndarray, dtype: Any = None, order: str = "K", shape: Any = None) -> ndarray:
    return arrays.empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def _filled(fill: Any) -> Any:
    def make(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
        return arrays.from_host(np.full(shape, fill, dtype=dtype, order=order))
    return make


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    return arrays.from_host(np.full(shape, fill_value, dtype=dtype, order=order))


def _like(fill: Any) -> Any:
    def make(a: ndarray, dtype: Any = None, order: str = "K", shape: Any = None) -> ndarray:
        return arrays.from_host(np.full(a.shape if shape is None else shape, fill,
                                        dtype=a.dtype if dtype is None else dtype))
    return make


def full_like(a: ndarray, fill_value: Any, dtype: Any = None, order: str = "K",
              shape: Any = None) -> ndarray:
    return arrays.from_host(np.full(a.shape if shape is None else shape, fill_value,
                                    dtype=a.dtype if dtype is None else dtype))


def get_array_module(*args: Any) -> types.ModuleType:
    return cupy if any(isinstance(a, ndarray) for a in args) else np


def from_dlpack(obj: Any) -> ndarray:
    raise TypeError("cupy-on-cpu has no DLPack exchange (CUDA tensors need a GPU)")


def _module_function(name: str) -> Any:
    """``cupy.<name>``: NumPy's function on device arrays (NumPy arrays refused), as CuPy's."""
    fn = getattr(np, name)
    if isinstance(fn, type) or not callable(fn):
        return fn  # dtypes, classes and constants pass as they are

    def call(*args: Any, **kwargs: Any) -> Any:
        for x in itertools.chain(args, kwargs.values()):
            for y in (x if isinstance(x, (list, tuple)) else (x,)):
                if isinstance(y, np.ndarray) and y.ndim:
                    raise TypeError(f"cupy.{name}: a NumPy array among the arguments (host "
                                    "memory); use cupy.asarray first")
        out = kwargs.get("out")
        with np.errstate(all="ignore"):  # a GPU raises no floating-point warnings
            result = fn(*arrays.unwrap(args), **arrays.unwrap(kwargs))
        if isinstance(out, ndarray):
            out._alloc.mark_written()
            return out
        return arrays.wrap(result, *arrays._arrays_in((args, kwargs)))

    call.__name__ = name
    return call


cupy = types.ModuleType("cupy")
cupy.__version__ = "14.2.0+cupy-on-cpu"
for _name, _value in {
    "ndarray": ndarray, "cuda": cuda, "RawModule": launch.RawModule, "RawKernel": launch.RawKernel,
    "asarray": asarray, "array": array, "ascontiguousarray": ascontiguousarray,
    "asnumpy": asnumpy, "empty": arrays.empty, "empty_like": empty_like,
    "zeros": _filled(0), "ones": _filled(1), "full": full, "zeros_like": _like(0),
    "ones_like": _like(1), "full_like": full_like, "get_array_module": get_array_module,
    "from_dlpack": from_dlpack,
}.items():
    setattr(cupy, _name, _value)
cupy.__getattr__ = _module_function  # type: ignore[attr-defined]


# ---------------------------------------------------------------- cupyx, cupy_backends
def _pinned(fill: Any) -> Any:
    def make(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
        return np.full(shape, fill, dtype=dtype, order=order) if fill is not None else \
            np.empty(shape, dtype=dtype, order=order)
    return make


cupyx = types.ModuleType("cupyx")
cupyx.zeros_pinned = _pinned(0)
cupyx.empty_pinned = _pinned(None)

_backends = types.ModuleType("cupy_backends")
_backends_cuda = types.ModuleType("cupy_backends.cuda")
_libs = types.ModuleType("cupy_backends.cuda.libs")
_cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")
for _name in dir(cublas):
    if not _name.startswith("_") and (_name.isupper() or callable(getattr(cublas, _name))):
        setattr(_cublas, _name, getattr(cublas, _name))
_libs.cublas = _cublas
_backends_cuda.libs = _libs
_backends.cuda = _backends_cuda

MODULES = {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": _runtime,
           "cupy.cuda.device": _device_mod, "cupyx": cupyx, "cupy_backends": _backends,
           "cupy_backends.cuda": _backends_cuda, "cupy_backends.cuda.libs": _libs,
           "cupy_backends.cuda.libs.cublas": _cublas}
_ROOTS = ("cupy", "cupyx", "cupy_backends")
_frozen = False


@contextlib.contextmanager
def installed() -> Iterator[types.ModuleType]:
    """``sys.modules`` with the stand-in in place of any real CuPy, until the block ends.

    The first time, everything alive moves to the collector's permanent generation
    (``gc.freeze``): the emulated arrays allocate many small objects, and full collections over
    the test process's import-time objects took 40% of a cupy-on-cpu test."""
    global _frozen
    if not _frozen:
        gc.collect()
        gc.freeze()
        _frozen = True
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in _ROOTS}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(MODULES)
    try:
        yield cupy
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] in _ROOTS]:
            del sys.modules[k]
        sys.modules.update(saved)
