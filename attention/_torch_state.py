"""The explicit state of protected PyTorch calls, and how the custom operators name it.

A custom operator takes tensors and plain values only. What a protected call runs under that is
neither (checking plan, fault hook, plans and buffers per device, the report its findings go to)
lives in a :class:`Protection`, which the operators' calls name by its ``id`` (an int, a constant
for the compiler). What a forward leaves for its backward travels in a *token*: a 1-element int64
CPU tensor returned by the forward and saved for backward by autograd, whose memory belongs to a
holder object that carries the state; the state lives exactly as long as the token tensor does.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import torch

import abftgemm
from abftgemm.plan import check_option
from abftgemm.report import Report, UncorrectableError
from attention.context import Context
from attention.plan import ALL_SITES, CheckingPlan
from attention.workspace import Workspace

FaultHook = Callable[[str, Any], None]

#: How many forwards' check decisions a :class:`Protection` keeps for their recomputations.
KEPT_DECISIONS = 64
_REGISTERED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_IDS = itertools.count()
_STATES: "weakref.WeakValueDictionary[int, _Holder]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


class Protection:
    """What protected PyTorch calls run under, and where their findings go.

    One object serves any number of calls (a module holds one), from any number of threads at
    once: each thread gets its own plans and buffers. The functional entry points
    (:mod:`attention.torch_functional`) take it as their ``protection`` argument.

    Parameters
    ----------
    check : {"correct", "detect", "off"}
        As in :func:`abftgemm.matmul`, for every site.
    plan : attention.CheckingPlan, optional
        How often each site is checked (default: every call).
    fault_hook : callable ``(site, c)``, optional
        Sees every site's raw product (a NumPy or CuPy array sharing the GEMM output) before
        verification, forward and backward.

    Attributes
    ----------
    last_report : abftgemm.Report
        The findings of the last pass: those of the last forward, extended by its backward once
        autograd runs it (the backward of an earlier forward makes that forward's report the last
        one). The same meaning as :attr:`attention.MultiHeadAttention.last_report`. A step that
        calls the protection twice (a shared layer, as ALBERT's) ends with the first call's
        report here: the second call's findings are in :attr:`total_report`.
    total_report : abftgemm.Report
        Every finding of every call since it was last replaced, each once: each forward's,
        each backward's, each forward recomputed by activation checkpointing. Nothing resets
        it; set it to a new ``Report()`` where a step (or an epoch) begins, and read it after
        the step's backward to see all of that step's findings, however many calls it made. A
        call that raises :class:`abftgemm.UncorrectableError` adds the error's report (and
        leaves ``last_report`` as it was).
    last_core : str or None
        ``"fused"`` or ``"unfused"``: the implementation the last attention product ran
        (:func:`attention.torch_functional.attention_core`); None before any.
    id : int
        Names this object in the custom operators' calls.
    """

    def __init__(self, check: str = "correct", plan: CheckingPlan | None = None,
                 fault_hook: FaultHook | None = None):
        self.check, self.plan, self.fault_hook = check, plan, fault_hook
        self.last_report = Report()
        self.total_report = Report()
        self.last_core: str | None = None
        self._local = threading.local()
        self._total_lock = threading.Lock()
        self._decided: collections.OrderedDict = collections.OrderedDict()
        self._memo: tuple[Any, Any] = (None, None)
        self.id = register(self)

    @property
    def check(self) -> str:
        return self._check

    @check.setter
    def check(self, check: str) -> None:
        check_option("check", check, abftgemm.CHECK_MODES)
        self._check = check

    @property
    def plan(self) -> CheckingPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: CheckingPlan | None) -> None:
        """None: the default plan (every site on every call)."""
        if plan is not None and not isinstance(plan, CheckingPlan):
            raise TypeError(f"plan must be an attention.CheckingPlan or None, got "
                            f"{type(plan).__name__}")
        self._plan = CheckingPlan() if plan is None else plan

    def workspace(self, device: torch.device) -> Workspace:
        """The plans and buffers of the calling thread's calls on ``device`` (one workspace per
        device and thread: concurrent calls, such as a server's requests on one model, must not
        share buffers, and one thread's calls run one after another)."""
        spaces = getattr(self._local, "workspaces", None)
        if spaces is None:
            spaces = self._local.workspaces = {}
        ws = spaces.get(device)
        if ws is None:
            ws = spaces[device] = Workspace()
        return ws

    def record(self, found: Report) -> None:
        """Add one call's findings (a forward's or a backward's) to :attr:`total_report`."""
        with self._total_lock:
            self.total_report.extend(found)

    def book(self, found: Report, report: Report) -> None:
        """A forward's or backward's findings ``found``: into its call's ``report`` (which
        becomes :attr:`last_report`; ``found`` itself for a forward's own report) and
        :attr:`total_report`."""
        if report is not found:
            report.extend(found)
        self.record(found)
        self.last_report = report

    @contextlib.contextmanager
    def errors_recorded(self) -> Iterator[None]:
        """Within the block, an :class:`abftgemm.UncorrectableError` adds its report to
        :attr:`total_report` on its way out (the call that raised it records nothing else)."""
        try:
            yield
        except UncorrectableError as exc:
            self.record(exc.report)
            raise

    def context(self, report: Report, modes: dict[str, str] | None = None) -> Context:
        """The context of one call whose findings go to ``report`` (``modes``: its sites'
        check decisions, :class:`attention.context.Context`'s)."""
        return Context(self.check, self.plan, self.fault_hook, report, modes=modes)

    def decisions(self, key: Any, recomputing: bool) -> dict[str, str]:
        """The check decisions of a forward on the inputs ``key`` names (their memory, shapes,
        strides and dtypes), a dict its context fills as the plan is drawn. A forward keeps
        them under ``key`` (the last :data:`KEPT_DECISIONS` forwards'); activation
        checkpointing's recomputation of it (``recomputing``) repeats them, so it checks
        what its forward checked, and the plan's schedule advances once per forward, as for
        a replay. A recomputation whose forward's decisions are not found (inputs copied
        between the two) checks every site: its tensors feed the backward."""
        if not recomputing:
            modes: dict[str, str] = {}
            with self._total_lock:
                self._decided[key] = modes
                self._decided.move_to_end(key)
                while len(self._decided) > KEPT_DECISIONS:
                    self._decided.popitem(last=False)
            return modes
        with self._total_lock:
            kept = self._decided.get(key)
        return dict(kept) if kept is not None else {site: self.check for site in ALL_SITES}

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, kept while ``key`` stays the same (one entry, read and replaced whole, so
        concurrent calls each get the value of their own key)."""
        memo = self._memo
        if memo[0] != key:
            memo = self._memo = key, make()
        return memo[1]

    def __getstate__(self) -> dict[str, Any]:
        """Without its plans, buffers and memo, which hold array modules and memory no copy
        should share (``copy.deepcopy``, ``torch.save`` and ``pickle`` work after a call; a copy
        builds its own on first use and gets a new ``id``), and without its fault hook, a test's
        instrument (a copy made inside :func:`attention.torch.fault_hook`'s block kept calling
        it after the block, and a hook defined in a function could not be pickled)."""
        state = self.__dict__.copy()
        state["_memo"] = (None, None)
        state["fault_hook"] = None
        del state["id"], state["_local"], state["_total_lock"], state["_decided"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in ("check", "plan"):  # a state pickled before they were properties
            if name in state:
                state[f"_{name}"] = state.pop(name)
        state.setdefault("total_report", Report())  # pickled before it existed
        self.__dict__.update(state)
        self._local = threading.local()
        self._total_lock = threading.Lock()
        self._decided = collections.OrderedDict()
        self.id = register(self)


class LinearProtection(Protection):
    """A :class:`Protection` for a linear layer's products, which also keeps what they reuse
    between calls: the record of each constant-``a`` plan's encoding (what it was made from) and
    the rows of ones of the bias gradient. The layer checks every product (its ``plan`` is not
    consulted)."""

    def __init__(self, check: str = "correct"):
        super().__init__(check)
        #: What each constant-``a`` plan's encoding was made from (by ``id`` of the plan).
        self.encoded: dict[int, tuple] = {}
        #: A row of ones per (device, dtype, length).
        self.ones: dict[tuple, torch.Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["encoded"], state["ones"] = {}, {}
        return state


def inputs_key(*tensors: torch.Tensor) -> tuple:
    """What names a forward's inputs for its recomputation's check decisions
    (:meth:`Protection.decisions`): their memory, shapes, strides and dtypes (a checkpointed
    forward is recomputed on the same tensors)."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def register(owner: Any) -> int:
    """A new id naming ``owner`` (a :class:`Protection`) in the custom operators' calls; held
    weakly."""
    op_id = next(_IDS)
    _REGISTERED[op_id] = owner
    return op_id


def registered(op_id: int) -> Any:
    """The live object that ``op_id`` names."""
    owner = _REGISTERED.get(op_id)
    if owner is None:
        raise RuntimeError(f"abftgemm: no live Protection with id {op_id}")
    return owner


class _Holder(bytearray):
    """The memory of a token tensor, carrying the state of one forward call."""

    state: Any


def token_of(state: Any) -> torch.Tensor:
    """A 1-element int64 tensor whose memory keeps ``state`` alive, and that names it."""
    holder = _Holder(8)
    holder.state = state
    key = next(_KEYS)
    _STATES[key] = holder
    array = np.frombuffer(holder, dtype=np.int64)
    array[0] = key
    return torch.from_numpy(array)


def saved_state(tok: torch.Tensor) -> Any:
    """The state a forward's :func:`token` carries."""
    holder = _STATES.get(int(tok[0]))
    if holder is None:
        raise RuntimeError("abftgemm: the forward's saved state is gone (was the token tensor "
                           "copied, or backward run twice?)")
    return holder.state


class ProtectionAttribute:
    """An attribute of a module that is its ``protection``'s (``check``, ``plan``,
    ``fault_hook``, ``last_report``, ...), read and set through it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.protection, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.protection, self.name, value)

