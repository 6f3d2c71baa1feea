"""Emulated device memory: every allocation sits between guard zones and is registered with the
SIMT runtime, which checks each kernel access against it (bounds, and for ``empty`` allocations,
bytes read before anything wrote them)."""
from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from cuda_on_cpu import build

ALIGNMENT = 256  # cudaMalloc's guarantee
GUARD = 4096  # bytes of guard zone on each side: an index off by a row lands in it
GUARD_BYTE = 0xCD
UNSET_BYTE = 0xFF  # fresh memory reads as NaN (and -1), so a missed check still shows in values


class _Runtime:
    """The loaded SIMT runtime library (RTLD_GLOBAL: kernel modules resolve their hooks to it)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(str(build.runtime_library()), mode=ctypes.RTLD_GLOBAL)
        lib.simt_register.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t,
                                      ctypes.c_int]
        lib.simt_unregister.argtypes = [ctypes.c_uint64]
        lib.simt_mark_written.argtypes = [ctypes.c_uint64]
        lib.simt_is_fresh.argtypes = [ctypes.c_uint64]
        lib.simt_read_bytes.argtypes = [ctypes.c_uint64]
        lib.simt_read_bytes.restype = ctypes.c_uint64
        self.lib = lib


_RUNTIME: _Runtime | None = None

#: The SIMT runtime is single-threaded by design (one launch at a time, global scheduler state and
#: allocation table): every call into it, and every library build and load, holds this lock, so
#: launches from several Python threads are serialized. Reentrant: a finalizer that unregisters
#: an allocation may run in a thread that holds it.
LOCK = threading.RLock()


def runtime() -> ctypes.CDLL:
    global _RUNTIME
    with LOCK:
        if _RUNTIME is None:
            _RUNTIME = _Runtime()
        return _RUNTIME.lib


def _locked(call, *args):
    with LOCK:
        return call(*args)


class Allocation:
    """``nbytes`` of device memory at ``ptr`` (256-byte aligned), guarded on both sides.

    ``fresh`` (as from ``cupy.empty``): its bytes count as unwritten until a kernel writes them
    or the host writes into the allocation (:meth:`mark_written`).
    """

    def __init__(self, nbytes: int, fresh: bool):
        self.nbytes = int(nbytes)
        self._buffer = np.empty(self.nbytes + 2 * GUARD + ALIGNMENT, np.uint8)
        base = self._buffer.ctypes.data
        self.ptr = (base + GUARD + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        start = self.ptr - base
        self._buffer[:start] = GUARD_BYTE
        self._buffer[start + self.nbytes:] = GUARD_BYTE
        self.bytes = self._buffer[start:start + self.nbytes]
        if fresh:
            self.bytes.fill(UNSET_BYTE)
        lib = runtime()
        _locked(lib.simt_register, self.ptr, self.nbytes, GUARD, int(fresh))
        weakref.finalize(self, _locked, lib.simt_unregister, self.ptr)

    def mark_written(self) -> None:
        _locked(runtime().simt_mark_written, self.ptr)

    def is_fresh(self) -> bool:
        return bool(_locked(runtime().simt_is_fresh, self.ptr))

    def read_bytes(self) -> int:
        """Bytes kernels have read from this allocation so far (device memory traffic)."""
        return int(_locked(runtime().simt_read_bytes, self.ptr))

    def guards_intact(self) -> bool:
        start = self.ptr - self._buffer.ctypes.data
        return bool((self._buffer[:start] == GUARD_BYTE).all()
                    and (self._buffer[start + self.nbytes:] == GUARD_BYTE).all())

    def owns(self, array: np.ndarray) -> bool:
        """True when ``array`` is a view of this allocation's memory."""
        return array.base is self._buffer or array.base is self.bytes.base

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.ptr <= ptr and ptr + nbytes <= self.ptr + self.nbytes


_LIVE: "weakref.WeakValueDictionary[int, Allocation]" = weakref.WeakValueDictionary()
_MADE = 0


def allocate(nbytes: int, fresh: bool) -> Allocation:
    global _MADE
    alloc = Allocation(nbytes, fresh)
    _LIVE[alloc.ptr] = alloc
    _MADE += 1
    return alloc


def allocations_made() -> int:
    """Device allocations made so far in this process (every array: results, temporaries)."""
    return _MADE


def find(ptr: int) -> Allocation | None:
    """The live allocation whose data holds address ``ptr`` (None: not device memory)."""
    for alloc in list(_LIVE.values()):
        if alloc.ptr <= ptr < alloc.ptr + max(alloc.nbytes, 1):
            return alloc
    return None
