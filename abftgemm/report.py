"""What a protected product found and did: :class:`Event`, :class:`Report`,
:class:`UncorrectableError`, and :class:`FaultDetectedWarning` for findings left in place."""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Literal

Pattern = Literal["0D", "1R", "1C", "2D", "checksum", "input-nonfinite", "overflow", "rounding"]
#: Findings that are not faults (see :attr:`Event.pattern`): the output is delivered as it is.
PASSED_THROUGH = ("input-nonfinite", "overflow", "rounding")
Action = Literal["corrected", "recomputed", "checksum-recomputed", "reported", "passed-through"]


@dataclass(frozen=True)
class Event:
    """One finding at one site and batch index.

    Attributes
    ----------
    site : str
        Name of the product (the ``name`` given to :func:`abftgemm.matmul`, or an attention site).
    batch : int
        Flat index into the product's batch dimensions (0 for a 2-D product).
    pattern : str
        ``"0D"`` one element, ``"1R"`` one row, ``"1C"`` one column, ``"2D"`` anything wider,
        ``"checksum"`` the predicted checksum itself was wrong (the data verifies against fresh
        ones), ``"input-nonfinite"`` the inputs hold INF/NaN so the affected outputs were not
        checked, ``"overflow"`` the exact product exceeds the dtype's range (INF is right),
        ``"rounding"`` every flagged element lies within its rigorous rounding bound, computed
        again bit for bit (one-sided rounding beyond the threshold's statistical term,
        docs/thresholds.md).
    rows, cols : tuple of int
        Output rows and columns involved (for ``input-nonfinite``: the unverifiable vectors).
    magnitude : float
        Largest ``|predicted - recomputed|`` checksum difference among the flagged vectors
        (``inf`` or ``nan`` when the output held non-finite values).
    threshold : float
        The rounding-error threshold that difference was compared against (for the same vector).
    action : str
        ``"corrected"`` (the located elements were recomputed from the inputs and the product
        then verified), ``"recomputed"`` (rows, columns, the whole product or a softmax step
        recomputed from the inputs), ``"checksum-recomputed"`` (the data verified against fresh
        checksums and was left alone), ``"reported"`` (left in place: check="detect", or nothing
        could be made to verify) or ``"passed-through"``.
    verified : str
        In words, which values were recomputed and the re-verification that followed, with the
        tolerance it was judged against. Nothing beyond that is vouched for: an element no check
        looked at again is known only to the bound of the check that covers it
        (docs/detection.md).
    """

    site: str
    batch: int
    pattern: Pattern
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    magnitude: float
    threshold: float
    action: Action
    verified: str

    def __str__(self) -> str:
        where = f"rows {_brief(self.rows)} cols {_brief(self.cols)}"
        return (f"{self.site}[{self.batch}] {self.pattern} at {where}: |d|={self.magnitude:.3g} "
                f"vs threshold {self.threshold:.3g} -> {self.action}: {self.verified}")


def _brief(ix: tuple[int, ...]) -> str:
    return str(list(ix)) if len(ix) <= 6 else f"[{ix[0]}, {ix[1]}, ... {ix[-1]}] ({len(ix)})"


@dataclass
class Report:
    """Everything a protected call found, across all of its sites.

    Attributes
    ----------
    events : list of Event
    checked : dict
        Site name -> number of verified products (a site called with check="off" is absent).
    """

    events: list[Event] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def detected(self) -> bool:
        """True when any fault was found: a finding not in :data:`PASSED_THROUGH`."""
        return bool(self.sites)

    @property
    def corrected(self) -> int:
        """Number of output elements recomputed with action ``"corrected"``."""
        return sum(len(e.rows if e.pattern == "1C" else e.cols) for e in self.events
                   if e.action == "corrected")

    @property
    def recomputed(self) -> int:
        """Number of recompute operations (rows, columns or whole matrices) performed."""
        return sum(1 for e in self.events if e.action == "recomputed")

    @property
    def sites(self) -> set[str]:
        """Names of the sites with a fault: a finding not in :data:`PASSED_THROUGH`."""
        return {e.site for e in self.events if e.pattern not in PASSED_THROUGH}

    def extend(self, other: "Report") -> None:
        """Merge ``other`` into this report."""
        self.events.extend(other.events)
        for site, n in other.checked.items():
            self.checked[site] = self.checked.get(site, 0) + n

    def summary(self) -> str:
        """A human-readable multi-line summary."""
        head = (f"detected={self.detected} corrected={self.corrected} "
                f"recomputed={self.recomputed} checked={sum(self.checked.values())}")
        return "\n".join([head, *(f"  {e}" for e in self.events)])


class UncorrectableError(RuntimeError):
    """No correct result could be delivered; ``.report`` says what was found."""

    def __init__(self, message: str, report: Report):
        super().__init__(f"{message}\n{report.summary()}")
        self.report = report


class FaultDetectedWarning(UserWarning):
    """A check with ``check="detect"`` found a fault and left the output as it was computed.

    One warning per :class:`Event` with action ``"reported"`` (never for clean calls, non-finite
    inputs or overflow), attributed to the line that called the library. Filter it like any
    warning: ``warnings.simplefilter("error", abftgemm.FaultDetectedWarning)`` stops at the first
    fault; ``"ignore"`` when you read the :class:`Report` yourself.
    """


#: Top-level packages whose frames a warning skips to reach the user's line.
_LIBRARY_PACKAGES = {"abftgemm"}


def register_library_package(package: str) -> None:
    """Attribute :class:`FaultDetectedWarning` to the callers of ``package`` rather than to
    ``package`` itself: for libraries built on abftgemm (the attention layer registers itself)."""
    _LIBRARY_PACKAGES.add(package)


def announce(event: Event) -> None:
    """Warn (:class:`FaultDetectedWarning`) about a fault that a detect-mode check left in place,
    attributed to the first frame outside the library."""
    frame, level = sys._getframe(1), 2  # stacklevel 1: announce; 2: its caller
    while frame is not None and \
            frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARY_PACKAGES:
        frame, level = frame.f_back, level + 1
    warnings.warn(f"fault detected and left in place (check='detect'): {event}",
                  FaultDetectedWarning, stacklevel=level)
