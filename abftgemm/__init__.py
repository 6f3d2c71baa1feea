"""abftgemm: checksum-protected (ABFT) matrix products for NumPy and CuPy arrays.

``abftgemm.matmul(a, b)`` is a drop-in for ``xp.matmul`` that detects, locates and corrects silent
errors in the product down to the rounding noise, recomputes what checksums cannot repair, and
raises :class:`UncorrectableError` rather than return wrong data; with ``check="detect"`` it
announces every finding as a :class:`FaultDetectedWarning` and leaves the data alone.
"""
from abftgemm.checksums import SUPPORTED_DTYPES, Checksums
from abftgemm.encode import checksums_of
from abftgemm.gemm import matmul
from abftgemm.plan import CHECK_MODES, Counters, ProtectedMatmul, settle_all
from abftgemm.plan_cache import PlanCache, clear_plan_cache
from abftgemm.report import Event, FaultDetectedWarning, Report, UncorrectableError
from abftgemm.threads import get_threads, set_threads
from abftgemm.verify import Verification, verify

__all__ = ["matmul", "ProtectedMatmul", "Counters", "settle_all", "PlanCache", "clear_plan_cache",
           "verify", "Verification", "checksums_of", "Checksums", "Report",
           "Event", "UncorrectableError", "FaultDetectedWarning", "CHECK_MODES", "SUPPORTED_DTYPES",
           "set_threads", "get_threads"]
__version__ = "0.1.0"
