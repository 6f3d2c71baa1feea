"""What one call of the functional attention core runs under: check mode, checking frequencies,
fault hook, and the report it fills. The core keeps no other state between calls."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from abftgemm.plan import CHECK_MODES, check_option
from abftgemm.report import Report
from attention.plan import CheckingPlan

FaultHook = Callable[[str, Any], None]


@dataclass
class Context:
    """Explicit state of one forward or backward call.

    Attributes
    ----------
    check : {"correct", "detect", "off"}
        As in :func:`abftgemm.matmul`, for every site.
    plan : CheckingPlan
        How often each site is checked (its call counters advance with every call).
    fault_hook : callable ``(site, c)``, optional
        Sees every site's raw output before verification (fault injection).
    report : Report
        Receives the findings of the call.
    trace : list, optional
        Receives ``(step, taken)`` for every step a pass ran, in order (the pass that delivered:
        a replay's): :class:`attention.passes.Step` and what it took or made of the encodings,
        as :func:`attention.passes.checksums` says of the table.
    modes : dict, optional
        Site -> check mode already decided for this call: a site found here takes it without
        drawing from the plan, a site drawn is recorded here (activation checkpointing's
        recomputation of a forward repeats that forward's decisions:
        :meth:`attention.torch_functional.Protection.decisions`).
    """

    check: str = "correct"
    plan: CheckingPlan = field(default_factory=CheckingPlan)
    fault_hook: FaultHook | None = None
    report: Report = field(default_factory=Report)
    trace: list | None = None
    modes: dict[str, str] | None = None

    def __post_init__(self) -> None:
        check_option("check", self.check, CHECK_MODES)
        if self.fault_hook is not None and not callable(self.fault_hook):
            raise TypeError(f"fault_hook must be callable (site, c), got "
                            f"{type(self.fault_hook).__name__}")
        if not isinstance(self.plan, CheckingPlan):
            raise TypeError(f"plan must be an attention.CheckingPlan, got "
                            f"{type(self.plan).__name__}")

    def mode(self, site: str) -> str:
        """The check mode of this call of ``site`` (advances the plan's counter, unless
        ``modes`` holds the site's decision)."""
        if self.check == "off":
            return "off"
        if self.modes is not None and site in self.modes:
            return self.modes[site]
        mode = self.check if self.plan.should_check(site) else "off"
        if self.modes is not None:
            self.modes[site] = mode
        return mode
