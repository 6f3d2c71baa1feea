"""The library's one CPU thread policy: how many threads its BLAS calls may use.

Every BLAS call the library makes on the CPU runs inside :func:`blas_scope`, opened once around
all of a call's work, which sets NumPy's BLAS (through threadpoolctl) to the policy's thread
count and restores the caller's setting after. The count, unless :func:`set_threads` (or
``ABFT_THREADS``) fixed one:

- the cores this process may run on (``os.sched_getaffinity``),
- minus the tasks of *other* processes running now (``/proc/loadavg`` less this process's own
  running threads, the most of the last three samples, taken at most every 0.1 s): a BLAS GEMM
  splits its work evenly, so a thread sharing a core with a busy process makes it all wait,
- minus PyTorch's intra-op threads beyond the calling one when the call comes from PyTorch
  (they spin-wait on the other cores after each of PyTorch's operations),
- at least 1, and never more than the caller's own BLAS setting.

Only the fused attention core (its final checks too) and the products beside it
(:mod:`abftgemm._cpu_gemm`) run in numba's pool, with every BLAS at one thread
(:func:`one_blas_thread`), and so does the finiteness scan of a large array
(:func:`abftgemm.cpu_kernels.all_finite`); the checking kernels of the products are serial.
PyTorch's own thread settings are only counted, never changed.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from typing import Any

__all__ = ["set_threads", "get_threads", "current_policy", "blas_scope", "one_blas_thread",
           "scope_threads", "scope_pool", "numba_pool_usable", "pool_kernels"]

#: Seconds a load sample stays valid.
SAMPLE_INTERVAL = 0.1
#: Samples whose most busy tasks decide (an intermittent load counts while it comes and goes).
SAMPLES = 3

_fixed: int | None = None
_lock = threading.Lock()
_local = threading.local()
_active = 0  # scopes open in any thread (the BLAS setting is process-wide)
_restore: list[tuple[Any, int]] = []
_scope_count = 1  # the thread count of the open blas_scope (the first one's)
_controllers: list[Any] | None = None
_with_scipy = False  # whether _controllers includes SciPy's BLAS (loaded for it)
_pinned = 0  # one_blas_thread scopes open in any thread
_pinned_restore: list[tuple[Any, int]] = []
_samples: deque[int] = deque(maxlen=SAMPLES)
_sampled_at = -1.0
_pool_forked_away = False  # this process was forked after its parent's GNU OpenMP pool ran
_pool_launched = False  # numba's pool started by numba_threads (PyTorch's thread count kept)
_launch_lock = threading.Lock()


def set_threads(n: int | None) -> None:
    """Fix the number of BLAS threads of the library's CPU products, or ``None`` for the
    automatic policy (the module docstring).

    Parameters
    ----------
    n : int >= 1 or None

    Raises
    ------
    ValueError
        For anything but a positive int or None.
    """
    global _fixed
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"threads must be a positive int or None (automatic), got {n!r}")
    _fixed = n


def get_threads() -> int | None:
    """The fixed thread count of :func:`set_threads`, or None under the automatic policy."""
    return _fixed


def _from_environment() -> None:
    value = os.environ.get("ABFT_THREADS", "").strip()
    if not value or value == "auto":
        return
    try:
        set_threads(int(value))
    except ValueError:
        raise ValueError(f"ABFT_THREADS must be a positive integer or 'auto', got {value!r}") \
            from None


def current_policy(torch_threads: int = 1) -> int:
    """The BLAS thread count the policy gives a call now.

    Parameters
    ----------
    torch_threads : int
        PyTorch's intra-op thread count when the call comes from PyTorch, else 1.
    """
    if _fixed is not None:
        return _fixed
    return max(1, _cores() - _busy_others() - max(0, torch_threads - 1))


class blas_scope:
    """``with blas_scope():`` runs its body with NumPy's BLAS at :func:`current_policy` threads
    (or fewer, when the caller's setting is lower), restoring the caller's setting after.
    Nested scopes, in this thread or another, keep the count of the first one open.

    Parameters
    ----------
    torch_threads : int
        PyTorch's intra-op thread count when the call comes from PyTorch, else 1.
    numba_pool : bool
        Run the products that the BLAS would thread in numba's pool instead
        (:mod:`abftgemm._cpu_gemm`), for work whose next steps run there (the fused attention
        core). The first scope open in the calling thread decides (:func:`scope_pool`).
    """

    __slots__ = ("torch_threads", "numba_pool")

    def __init__(self, torch_threads: int = 1, numba_pool: bool = False):
        self.torch_threads = torch_threads
        self.numba_pool = numba_pool

    def __enter__(self) -> None:
        global _active, _scope_count
        depth = getattr(_local, "depth", 0)
        if not depth:
            with _lock:
                _active += 1
                if _active == 1:
                    _scope_count = _lower(_blas(), current_policy(self.torch_threads), _restore)
            _local.pool = self.numba_pool
        _local.depth = depth + 1

    def __exit__(self, *exc: object) -> None:
        global _active
        _local.depth -= 1
        if not _local.depth:
            _local.pool = False
            with _lock:
                _active -= 1
                if not _active:
                    _put_back(_restore)


def scope_pool() -> bool:
    """Whether the :class:`blas_scope` open in this thread runs large products in numba's
    pool (False when none is open)."""
    return getattr(_local, "pool", False)


def scope_threads() -> int:
    """The thread count of the open :class:`blas_scope` (the caller's lower setting counted);
    :func:`current_policy` when none is open."""
    return _scope_count if _active else current_policy()


def _lower(libs: list[Any], n: int, restore: list[tuple[Any, int]]) -> int:
    """Each BLAS of ``libs`` that runs more than ``n`` threads to ``n``, its count before noted
    in ``restore``. Returns the lowest count now set."""
    lowest = n
    for lib in libs:
        before = lib.get_num_threads()
        if before is not None and before > n:
            _set_threads(lib, n)
            restore.append((lib, before))
        elif before is not None:
            lowest = min(lowest, before)
    return lowest


def _put_back(restore: list[tuple[Any, int]]) -> None:
    """Every count :func:`_lower` noted in ``restore`` set again, the list emptied."""
    while restore:
        lib, before = restore.pop()
        _set_threads(lib, before)


def _set_threads(lib: Any, n: int) -> None:
    """``lib.set_num_threads(n)`` from any thread: each of the library's (serialized) changes
    takes threadpoolctl's control of the pool and gives it back (docs/design.md)."""
    release = getattr(type(lib), "clear_controlling_thread", None)
    if release is not None:
        release(force=True)
    lib.set_num_threads(n)
    if release is not None:
        release()


class one_blas_thread:
    """``with one_blas_thread():`` runs its body with every BLAS library loaded in the process,
    SciPy's included (numba's ``np.dot`` calls it), at one thread, and restores each one's
    count after: for kernels that call BLAS from threads of their own (numba's pool). Nested
    scopes, in this thread or another, keep the setting until the last one closes."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _pinned
        with _lock:
            _pinned += 1
            if _pinned == 1:
                _lower(_blas(scipy=True), 1, _pinned_restore)

    def __exit__(self, *exc: object) -> None:
        global _pinned
        with _lock:
            _pinned -= 1
            if not _pinned:
                _put_back(_pinned_restore)


def _blas(scipy: bool = False) -> list[Any]:
    """threadpoolctl's controllers of the BLAS libraries loaded in this process, found again
    with SciPy's loaded the first time ``scipy`` asks (only its callers pay for the import)."""
    global _controllers, _with_scipy
    if _controllers is None or (scipy and not _with_scipy):
        import numpy  # noqa: F401  (its BLAS must be loaded to be found)
        from threadpoolctl import ThreadpoolController

        if scipy:
            import scipy.linalg.cython_blas  # noqa: F401  (the BLAS numba's np.dot calls)
            _with_scipy = True
        _controllers = list(ThreadpoolController().select(user_api="blas").lib_controllers)
    return _controllers


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _busy_others() -> int:
    """Tasks of other processes running now (0 where ``/proc`` is not there)."""
    global _sampled_at
    now = time.monotonic()
    if now - _sampled_at >= SAMPLE_INTERVAL or not _samples:
        _sampled_at = now
        _samples.append(_sample())
    return max(_samples)


def _sample() -> int:
    try:
        running = int(_read_proc("/proc/loadavg").split()[3].split(b"/")[0])
        own = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                stat = _read_proc(f"/proc/self/task/{tid}/stat")
            except OSError:  # the thread ended
                continue
            own += stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"R"
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, running - own)


def numba_threads(n: int) -> None:
    """``numba.set_num_threads(n)``, launching numba's pool first with PyTorch's thread count
    kept (numba's OpenMP layer sets the process's OpenMP thread count, which PyTorch reads)."""
    global _pool_launched
    import numba

    if not _pool_launched:  # once per process: no lock on the calls after
        with _launch_lock:
            if not _pool_launched:
                from numba.np.ufunc import parallel

                torch = sys.modules.get("torch")
                before = torch.get_num_threads() if torch is not None else None
                launch = getattr(parallel, "_launch_threads", None)  # numba's, private
                if launch is not None:
                    launch()
                _pool_launched = True
                if torch is not None and torch.get_num_threads() != before:
                    torch.set_num_threads(before)
    numba.set_num_threads(n)


def pool_kernels(parallel: Any, serial: Any) -> Any:
    """``parallel``, numba kernels over its pool, at the policy's thread count
    (:func:`current_policy`, at most numba's pool), or their serial twins ``serial`` in a process
    that cannot enter the pool (:func:`numba_pool_usable`)."""
    if not numba_pool_usable():
        return serial
    import numba

    numba_threads(min(current_policy(), numba.config.NUMBA_NUM_THREADS))
    return parallel


def numba_pool_usable() -> bool:
    """Whether the library's numba work may run in numba's thread pool: False only in a process
    forked after the pool had run on GNU OpenMP (numba terminates a child that tries)."""
    return not _pool_forked_away


def _after_fork_in_child() -> None:
    global _pool_forked_away, _launch_lock
    _launch_lock = threading.Lock()  # a fork while another thread held it leaves it held
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is None or not parallel._is_initialized or _pool_forked_away:
        return
    if parallel.threading_layer() == "omp":
        from numba.np.ufunc import omppool
        _pool_forked_away = getattr(omppool, "openmp_vendor", "GNU") == "GNU"


os.register_at_fork(after_in_child=_after_fork_in_child)


def _read_proc(path: str) -> bytes:
    """The start of a ``/proc`` file in one read (a buffered ``open`` would allocate 8 KiB per
    sample, which tests/test_plan.py counts)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1024)
    finally:
        os.close(fd)


_from_environment()
