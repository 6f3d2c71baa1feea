"""Training under faults: unprotected vs. ABFT-protected vs. checkpoint/restore, side by side.

One character-level :class:`attention.experiments.model.GPT` (or, with ``model`` one of
:data:`attention.experiments.hf_models.FAMILIES`, a small Hugging Face transformers model of that
family: :class:`attention.experiments.hf_models.HFTrainer`) is trained four times from the same
seed on the same batches:

``fault_free``
    ``check="off"``, no faults: the reference loss curve and the baseline time.
``unprotected``
    ``check="off"`` with faults: stops at the first non-finite loss ("non-trainable").
``protected``
    ``check="correct"`` with the same faults: its loss curve should match ``fault_free``.
``checkpoint``
    ``check="off"`` with the same faults; parameters and Adam state are saved to disk every
    ``checkpoint_every`` steps; when a step's loss or gradients are non-finite the last checkpoint
    is reloaded and the steps since are replayed (faults are transient: they do not recur).

Faults: before each step, with probability ``fault_rate``, one fault of an extreme kind (INF,
-INF, NaN, near-INF, or a flip of the top exponent bit) is scheduled at one element of a random
GEMM site (attention or MLP, forward or backward) of a random block (a transformers model: a random
protected product of any layer).  The schedule is drawn once from the seed and shared by the three
faulty runs.

Recovery overhead of checkpointing against protection (ATTNChecker reports up to 49x)::

    ratio = (T_checkpoint - T_fault_free) / (T_protected - T_fault_free)

with every ``T`` the wall time (``time.perf_counter``) of a run's own steps, JIT warm-up excluded;
the pieces are reported alongside.  The four runs take turns, one step each, so that other load
on the machine reaches them alike.  Every step synchronizes with the device when it reads the loss.
Other load on the machine adds noise to these times.  On the CPU every run's products use one
BLAS thread count, the library's thread policy's at the start (``blas_threads`` in train.json):
the protected products run at the policy's count, and ``check="off"`` ones at NumPy's own
setting, which on a loaded machine made the unprotected runs slower and the protection overhead
smaller than it is (even negative).
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from tqdm import tqdm

from abftgemm import UncorrectableError, threads
from abftgemm.backend import to_host
from abftgemm.faults import Fault, bit_layout
from attention import SITES
from attention.experiments.flags import option
from attention.experiments.hf_models import FAMILIES, HFTrainer, model_problem
from attention.experiments.model import GPT, MLP_SITES, GPTConfig
from attention.experiments.provenance import provenance, provenance_line

FAULT_KINDS: tuple[str, ...] = ("inf", "-inf", "nan", "near-inf", "bitflip")
FAULT_SITES: tuple[str, ...] = SITES + MLP_SITES
#: ``--model``: the built-in NumPy GPT or a transformers family.
MODELS: tuple[str, ...] = ("gpt",) + FAMILIES

_SUBJECTS = {"one": ["the cat", "a dog", "my friend", "the old man", "a small bird"],
             "many": ["the cats", "two dogs", "my friends", "the children", "some birds"]}
_VERBS = {"one": ["sees", "likes", "finds", "follows"], "many": ["see", "like", "find", "follow"]}
_OBJECTS = ["the red ball", "a green tree", "the river", "her house", "a big box"]


def synthetic_corpus(n_chars: int, seed: int) -> str:
    """Deterministic text from a small grammar with subject-verb agreement.

    Sentences are ``<subject> <verb> <object>.``; plural subjects take plural verbs, so a model
    must carry the subject's number across the words in between to predict the verb's ending.

    Parameters
    ----------
    n_chars : int
        Length of the text (it is cut at this many characters).
    seed : int
        Seed of the sentence choices.
    """
    rng = np.random.default_rng([seed, 2])
    parts: list[str] = []
    total = 0
    while total < n_chars:
        number = "one" if rng.random() < 0.5 else "many"
        words = (_SUBJECTS[number][rng.integers(5)], _VERBS[number][rng.integers(4)],
                 _OBJECTS[rng.integers(5)])
        sentence = " ".join(words) + ". "
        parts.append(sentence)
        total += len(sentence)
    return "".join(parts)[:n_chars]


@dataclass(frozen=True)
class TrainConfig:
    """Sizes and knobs of :func:`train` (each field is also an ``abft train`` flag).

    Attributes
    ----------
    steps, batch, seq : int
        Optimizer steps per run, sequences per batch, characters per sequence (``seq >= 2``).
    d_model, n_heads, n_layers, d_ff : int
        Model sizes (see :class:`attention.experiments.model.GPTConfig`); ``n_heads`` divides
        ``d_model`` (into heads of an even width for Llama).
    lr : float
        Adam learning rate (positive).
    fault_rate : float
        Probability that a step gets one fault, in [0, 1].
    checkpoint_every : int
        Steps between checkpoints of the checkpoint/restore run (at least 1).
    corpus_chars : int
        Length of the synthetic training text (more than ``seq`` characters).
    dtype : str
        Model dtype.
    seed : int
        Seed of the model, the batches and the fault schedule (below 2**64 for a transformers
        model).

    Raises
    ------
    ValueError
        On any value outside those ranges, naming the flag.
    """

    steps: int = option(300, "optimizer steps per run")
    batch: int = option(8, "sequences per batch")
    seq: int = option(32, "characters per sequence")
    d_model: int = option(32, "model width")
    n_heads: int = option(4, "attention heads (must divide --d-model)", flag="--heads")
    n_layers: int = option(2, "transformer blocks", flag="--layers")
    d_ff: int = option(64, "MLP hidden width")
    lr: float = option(3e-3, "Adam learning rate")
    fault_rate: float = option(0.05, "probability that a step gets one extreme fault")
    checkpoint_every: int = option(20, "steps between checkpoints of the checkpoint/restore run")
    corpus_chars: int = option(20000, "length of the synthetic training text")
    dtype: str = option("float32", "model dtype", choices=("float32", "float64"))
    seed: int = option(0, "seed of the model, the batches and the fault schedule")
    model: str = option("gpt", "the model: the built-in NumPy GPT, or a small Hugging Face "
                        "transformers model of that family (needs the [hf] extra; float32 only)",
                        choices=MODELS)

    def __post_init__(self) -> None:
        at_least = {"--steps": (self.steps, 1), "--batch": (self.batch, 1),
                    "--seq": (self.seq, 2), "--d-model": (self.d_model, 1),
                    "--heads": (self.n_heads, 1), "--layers": (self.n_layers, 1),
                    "--d-ff": (self.d_ff, 1), "--checkpoint-every": (self.checkpoint_every, 1),
                    "--corpus-chars": (self.corpus_chars, self.seq + 2), "--seed": (self.seed, 0)}
        for flag, (value, low) in at_least.items():
            if value < low:
                raise ValueError(f"{flag} must be at least {low}, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(f"--heads ({self.n_heads}) must divide --d-model ({self.d_model})")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.fault_rate <= 1:
            raise ValueError(f"--fault-rate must be in [0, 1], got {self.fault_rate}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"--dtype must be float32 or float64, got {self.dtype}")
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model}")
        if self.model != "gpt" and self.dtype != "float32":
            raise ValueError(f"--model {self.model} trains in float32 only, got --dtype "
                             f"{self.dtype}")
        problem = model_problem(self.model, self.d_model, self.n_heads, self.seed)
        if problem:
            raise ValueError(problem)


@dataclass(frozen=True)
class ScheduledFault:
    """One fault of the schedule: ``kind`` at ``site`` of block ``layer`` (one element)."""

    step: int
    kind: str
    site: str
    layer: int
    seed: int
    bit: int | None = None

    def hook(self) -> Fault:
        """A fresh injector for this fault (fires once)."""
        return Fault(self.kind, "element", seed=self.seed, sites=self.site, bit=self.bit)


def fault_schedule(config: TrainConfig, sites: tuple[str, ...] = FAULT_SITES,
                   layers: int | None = None) -> dict[int, ScheduledFault]:
    """Draw the faults of every step from ``config.seed`` (step -> fault; most steps have none),
    at ``sites`` of one of ``layers`` blocks (default ``config.n_layers``; 1 where the site
    names the block, as a transformers model's do)."""
    rng = np.random.default_rng([config.seed, 3])
    mantissa, exponent = bit_layout(np.dtype(config.dtype))
    layers = config.n_layers if layers is None else layers
    schedule = {}
    for step in range(config.steps):
        if rng.random() >= config.fault_rate:
            continue
        kind = FAULT_KINDS[rng.integers(len(FAULT_KINDS))]
        schedule[step] = ScheduledFault(
            step=step, kind=kind, site=sites[rng.integers(len(sites))],
            layer=int(rng.integers(layers)), seed=int(rng.integers(2**31)),
            bit=mantissa + exponent - 1 if kind == "bitflip" else None)
    return schedule


class Adam:
    """Adam on a dict of arrays, updated in place; its state can be saved and restored.

    Parameters
    ----------
    params : dict
        The live parameter arrays (updated in place by :meth:`step`).
    lr, beta1, beta2, eps : float
    """

    def __init__(self, params: dict[str, Any], lr: float, beta1: float = 0.9,
                 beta2: float = 0.99, eps: float = 1e-8):
        self.params, self.lr, self.beta1, self.beta2, self.eps = params, lr, beta1, beta2, eps
        self.m = {k: v * 0 for k, v in params.items()}
        self.v = {k: v * 0 for k, v in params.items()}
        self.t = 0

    def step(self, grads: dict[str, Any]) -> None:
        """Apply one update from ``grads`` (same keys as the parameters)."""
        self.t += 1
        c1, c2 = 1 - self.beta1 ** self.t, 1 - self.beta2 ** self.t
        for k, p in self.params.items():
            g = grads[k]
            self.m[k] *= self.beta1
            self.m[k] += (1 - self.beta1) * g
            self.v[k] *= self.beta2
            self.v[k] += (1 - self.beta2) * g * g
            p -= (self.lr / c1 * self.m[k] / ((self.v[k] / c2) ** 0.5 + self.eps)).astype(p.dtype)

    def save(self, path: Path, xp: Any) -> None:
        """Write parameters, moments and step count to ``path`` (``.npz``)."""
        host = {"t": np.array(self.t)}
        for prefix, group in (("p", self.params), ("m", self.m), ("v", self.v)):
            host.update({f"{prefix}/{k}": to_host(a) for k, a in group.items()})
        np.savez(path, **host)

    def load(self, path: Path, xp: Any) -> None:
        """Restore (in place) what :meth:`save` wrote."""
        with np.load(path) as saved:
            self.t = int(saved["t"])
            for prefix, group in (("p", self.params), ("m", self.m), ("v", self.v)):
                for k, a in group.items():
                    a[...] = xp.asarray(saved[f"{prefix}/{k}"])


@dataclass
class RunResult:
    """What one training run did.

    Attributes
    ----------
    name, check : str
    losses : list of float or None
        Accepted loss of every step (None after an unprotected run stopped).
    seconds : float
        Wall time of the run's own steps (the runs' steps are interleaved).
    faults_injected : int
        Faults that actually fired.
    detected, corrected, recomputed : int
        Steps in which protection found a fault; elements repaired; recompute operations.
    uncorrectable_retries : int
        Steps re-run after :class:`abftgemm.UncorrectableError`.
    non_trainable_at : int or None
        First step whose loss was non-finite (the unprotected run stops there, the fault-free and
        protected runs go on; the checkpoint run's: a step non-finite again on replay), or the
        number of steps when only the last update left a weight non-finite.
    restores : list of dict
        Checkpoint run: ``{"at": failed step, "from": checkpoint step}`` per reload.
    replayed_steps : int
        Checkpoint run: steps executed again after reloads.
    save_seconds, load_seconds, replay_seconds : float
        Checkpoint run: time writing checkpoints, reading them, re-executing steps.
    """

    name: str
    check: str
    losses: list[float | None]
    seconds: float = 0.0
    faults_injected: int = 0
    detected: int = 0
    corrected: int = 0
    recomputed: int = 0
    uncorrectable_retries: int = 0
    non_trainable_at: int | None = None
    restores: list[dict[str, int]] = field(default_factory=list)
    replayed_steps: int = 0
    save_seconds: float = 0.0
    load_seconds: float = 0.0
    replay_seconds: float = 0.0


class _Trainer:
    """Model, optimizer, batches and faults of one run."""

    def __init__(self, config: TrainConfig, data: np.ndarray, vocab: int, xp: Any):
        self.config, self.data, self.xp = config, data, xp
        self.model = GPT(GPTConfig(vocab=vocab, seq_len=config.seq, d_model=config.d_model,
                                   n_heads=config.n_heads, n_layers=config.n_layers,
                                   d_ff=config.d_ff, dtype=config.dtype), xp, seed=config.seed)
        self.params = self.model.parameters()
        self.opt = Adam(self.params, config.lr)
        self.checkpoint_name = "checkpoint.npz"

    def batch(self, step: int) -> tuple[Any, Any]:
        """Inputs and targets of ``step`` (the same in every run and on replay)."""
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 4, step])
        starts = rng.integers(len(self.data) - cfg.seq - 1, size=cfg.batch)
        window = self.data[starts[:, None] + np.arange(cfg.seq + 1)]
        return self.xp.asarray(window[:, :-1]), self.xp.asarray(window[:, 1:])

    def grads(self, step: int, check: str, fault: ScheduledFault | None, result: RunResult
              ) -> tuple[float, dict[str, Any]]:
        """Loss and gradients of ``step``, recording what protection and the fault did."""
        hook = fault.hook() if fault else None
        tokens, targets = self.batch(step)
        loss, grads, report = self.model.loss_and_grads(
            tokens, targets, check=check, fault_hook=hook,
            fault_layer=fault.layer if fault else None)
        result.faults_injected += bool(hook and hook.injected)
        result.detected += report.detected
        result.corrected += report.corrected
        result.recomputed += report.recomputed
        return loss, grads

    def finite(self, loss: float, grads: dict[str, Any]) -> bool:
        """Whether the loss and every gradient are finite (one device sync)."""
        total = sum(self.xp.abs(g).sum(dtype=np.float64) for g in grads.values())
        return math.isfinite(loss) and math.isfinite(float(total))

    def weights_finite(self) -> bool:
        """Whether every weight is finite (one device sync)."""
        return math.isfinite(float(sum(self.xp.abs(p).sum(dtype=np.float64)
                                       for p in self.params.values())))


def _plain_steps(trainer: _Trainer, result: RunResult, schedule: dict[int, ScheduledFault],
                 stop_on_nonfinite: bool) -> Iterator[bool]:
    """A run without checkpoints (fault-free, unprotected or protected), one step per ``next``;
    yields True for each new step. Its first non-finite loss is its ``non_trainable_at``; with
    ``stop_on_nonfinite`` the run ends there, else it goes on. A run whose losses stayed finite
    but whose last update left a weight non-finite (a fault in the last step's backward, which
    no loss shows) is non-trainable at ``steps``, the step it cannot take."""
    for step in range(trainer.config.steps):
        try:
            loss, grads = trainer.grads(step, result.check, schedule.get(step), result)
        except UncorrectableError:
            result.uncorrectable_retries += 1
            loss, grads = trainer.grads(step, result.check, None, result)
        result.losses[step] = loss
        if not math.isfinite(loss):
            if result.non_trainable_at is None:
                result.non_trainable_at = step
            if stop_on_nonfinite:
                return
        trainer.opt.step(grads)
        yield True
    if result.non_trainable_at is None and not trainer.weights_finite():
        result.non_trainable_at = trainer.config.steps  # the last update broke the weights


def _checkpointed_steps(trainer: _Trainer, result: RunResult,
                        schedule: dict[int, ScheduledFault], directory: Path) -> Iterator[bool]:
    """The checkpoint/restore run (unprotected GEMMs, reload on a non-finite step), one step
    per ``next``; yields True for a new step, False for a replayed or abandoned one."""
    cfg = trainer.config
    path = directory / trainer.checkpoint_name
    directory.mkdir(parents=True, exist_ok=True)
    fired: set[int] = set()
    saved_at, replay_until, step = 0, -1, 0
    result.save_seconds += _timed(trainer.opt.save, path, trainer.xp)
    while step < cfg.steps:
        t0 = time.perf_counter()
        fault = schedule.get(step) if step not in fired else None
        fired.add(step)
        loss, grads = trainer.grads(step, "off", fault, result)
        if not trainer.finite(loss, grads):
            if fault is None and step <= replay_until:  # the same step without a fault: again
                result.non_trainable_at = step  # non-finite on replay, which cannot end
                return
            result.restores.append({"at": step, "from": saved_at})
            result.load_seconds += _timed(trainer.opt.load, path, trainer.xp)
            replay_until, step = step, saved_at
            yield False
            continue
        trainer.opt.step(grads)
        result.losses[step] = loss
        replayed = step <= replay_until
        if replayed:
            result.replayed_steps += 1
            result.replay_seconds += time.perf_counter() - t0
        step += 1
        if step % cfg.checkpoint_every == 0:
            result.save_seconds += _timed(trainer.opt.save, path, trainer.xp)
            saved_at = step
        yield not replayed


def _interleaved(runs: dict[str, tuple[RunResult, Iterator[bool]]], total: int,
                 progress: bool) -> dict[str, RunResult]:
    """The runs' steps in turn, one step of each run at a time, so that other load on the
    machine reaches every run alike (run one after another, a few seconds each, the protection
    overhead came out anywhere between -7% and +16% on a 2-core machine); each run's
    ``seconds`` is the sum of its own steps' wall times."""
    active = dict(runs)
    bar = tqdm(total=total, desc="steps", leave=False, disable=None if progress else True)
    while active:
        for name, (result, steps) in list(active.items()):
            t0 = time.perf_counter()
            new = next(steps, None)
            result.seconds += time.perf_counter() - t0
            if new is None:
                del active[name]
            elif new:
                bar.update()
    bar.close()
    return {name: result for name, (result, _) in runs.items()}


def _timed(fn: Callable[..., None], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def train(config: TrainConfig, xp: Any, out: Path, progress: bool = True) -> dict[str, Any]:
    """Run the four trainings of the module docstring and write ``train.json`` under ``out``.

    Parameters
    ----------
    config : TrainConfig
    xp : module
        numpy or cupy.
    out : Path
        Output directory (created); checkpoints go to ``out/checkpoints``.
    progress : bool
        Show progress bars.

    Returns
    -------
    dict
        ``config``, ``backend``, ``schedule``, ``runs`` (per run: :class:`RunResult` fields and
        ``max_abs_loss_diff`` against the fault-free run) and ``overhead``.  In the JSON file
        non-finite losses are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``.
    """
    text = synthetic_corpus(config.corpus_chars, config.seed)
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], dtype=np.int64)
    if config.model == "gpt":
        schedule = fault_schedule(config)
    else:
        schedule = fault_schedule(config, tuple(_trainer(config, data, len(chars), xp).sites()),
                                  layers=1)
    with _one_thread_count(xp) as blas_threads:
        _warm_up(config, data, len(chars), xp, schedule)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # faults overflow
            runs = _all_runs(config, data, len(chars), xp, schedule, out, progress)
    reference = runs["fault_free"].losses
    summary = {
        "config": asdict(config),
        "backend": xp.__name__,
        "blas_threads": blas_threads,
        "provenance": provenance(),
        "vocab": "".join(chars),
        "schedule": [asdict(f) for f in schedule.values()],
        "runs": {name: {**asdict(r), "max_abs_loss_diff": _max_diff(r.losses, reference),
                        "final_loss": _last(r.losses)} for name, r in runs.items()},
        "overhead": overhead(runs),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(jsonable(summary), indent=2))
    return summary


@contextlib.contextmanager
def _one_thread_count(xp: Any) -> Iterator[int | None]:
    """NumPy's BLAS and the library's thread policy fixed at one count for what runs inside
    (None on a GPU): the policy's count now, never more than NumPy's BLAS is set to."""
    if xp is not np:
        yield None
        return
    from threadpoolctl import ThreadpoolController, threadpool_limits

    before = threads.get_threads()
    n = threads.current_policy()
    caller = [lib.num_threads for lib in ThreadpoolController().select(user_api="blas")
              .lib_controllers if lib.num_threads]
    n = min([n, *caller])
    threads.set_threads(n)
    try:
        with threadpool_limits(n, user_api="blas"):
            yield n
    finally:
        threads.set_threads(before)


def describe(summary: dict[str, Any]) -> str:
    """One line of train.md: the settings, backend and :func:`provenance` of ``summary``."""
    settings = " ".join(f"{k}={v}" for k, v in summary["config"].items())
    return (f"Settings: {settings}; backend {summary['backend']}. "
            f"{provenance_line(summary['provenance'])}")


def _all_runs(config: TrainConfig, data: np.ndarray, vocab: int, xp: Any,
              schedule: dict[int, ScheduledFault], out: Path, progress: bool
              ) -> dict[str, RunResult]:
    """The four runs of the module docstring, each on a fresh model from the same seed, their
    steps interleaved (:func:`_interleaved`)."""
    def plain(name: str, check: str, faults: dict[int, ScheduledFault], stop: bool
              ) -> tuple[RunResult, Iterator[bool]]:
        result = RunResult(name, check, [None] * config.steps)
        return result, _plain_steps(_trainer(config, data, vocab, xp), result, faults, stop)

    checkpoint = RunResult("checkpoint", "off", [None] * config.steps)
    runs = {
        "fault_free": plain("fault_free", "off", {}, False),
        "unprotected": plain("unprotected", "off", schedule, True),
        "protected": plain("protected", "correct", schedule, False),
        "checkpoint": (checkpoint, _checkpointed_steps(_trainer(config, data, vocab, xp),
                                                       checkpoint, schedule,
                                                       out / "checkpoints")),
    }
    return _interleaved(runs, len(runs) * config.steps, progress)


def _trainer(config: TrainConfig, data: np.ndarray, vocab: int, xp: Any) -> Any:
    """A fresh :class:`_Trainer`, or :class:`attention.experiments.hf_models.HFTrainer` for a
    transformers model (on the GPU when ``xp`` is CuPy)."""
    if config.model == "gpt":
        return _Trainer(config, data, vocab, xp)
    return HFTrainer(config, data, vocab, "cpu" if xp is np else "cuda")


def _warm_up(config: TrainConfig, data: np.ndarray, vocab: int, xp: Any,
             schedule: dict[int, ScheduledFault]) -> None:
    """One step in each check mode, clean and with each kind of the schedule's faults at each
    of its sites, so that JIT compilation is not timed: the paths a fault takes (the repair,
    the non-finite model, a replay) compile on their first fault, which a cold cache (a fresh
    clone) timed inside the runs (CHANGELOG.md, 2026-12-05, has the figures)."""
    trainer = _trainer(config, data, vocab, xp)
    kinds = {(f.kind, f.site, f.bit): f for f in schedule.values()}
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for check in ("off", "correct"):
            for fault in (None, *kinds.values()):
                try:
                    trainer.grads(0, check, fault, RunResult("warm-up", check, []))
                except UncorrectableError:  # as the runs take it (_plain_steps)
                    pass


def overhead(runs: dict[str, RunResult]) -> dict[str, Any]:
    """Recovery overhead of checkpoint/restore relative to protection, with its pieces.

    ``ratio = (T_checkpoint - T_fault_free) / (T_protected - T_fault_free)``; None when the
    protected run was not measurably slower than the fault-free one.
    """
    base, prot, ckpt = (runs[k].seconds for k in ("fault_free", "protected", "checkpoint"))
    c = runs["checkpoint"]
    return {
        "formula": "(T_checkpoint - T_fault_free) / (T_protected - T_fault_free)",
        "t_fault_free": base, "t_protected": prot, "t_checkpoint": ckpt,
        "protection_seconds": prot - base, "checkpoint_seconds": ckpt - base,
        "save_seconds": c.save_seconds, "load_seconds": c.load_seconds,
        "replay_seconds": c.replay_seconds, "replayed_steps": c.replayed_steps,
        "restores": len(c.restores),
        "protection_overhead_pct": 100 * (prot - base) / base if base > 0 else None,
        "ratio": (ckpt - base) / (prot - base) if prot > base else None,
    }


def _max_diff(losses: list[float | None], reference: list[float | None]) -> float | None:
    """max |loss - reference| over the steps both have (NaN if any of those is non-finite)."""
    pairs = [(a, b) for a, b in zip(losses, reference) if a is not None and b is not None]
    if not pairs:
        return None
    diffs = [abs(a - b) for a, b in pairs]
    return max(diffs) if all(math.isfinite(x) for x in diffs) else math.nan


def _last(losses: list[float | None]) -> float | None:
    done = [x for x in losses if x is not None]
    return done[-1] if done else None


def jsonable(obj: Any) -> Any:
    """``obj`` with non-finite floats as the strings "nan", "inf", "-inf" (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def format_table(summary: dict[str, Any]) -> str:
    """The runs and the overhead as a markdown table for the console and reports."""
    head = ("| run | check | faults fired | steps w/ detection | corrected | recomputed | "
            "restores | final loss | max abs dloss vs fault-free | time s | status |")
    lines = [head, "|" + "---|" * 11]
    for name, r in summary["runs"].items():
        status = (f"non-trainable at step {r['non_trainable_at']}"
                  if r["non_trainable_at"] is not None else "trained")
        lines.append(
            f"| {name} | {r['check']} | {r['faults_injected']} | {r['detected']} | "
            f"{r['corrected']} | {r['recomputed']} | {len(r['restores'])} | "
            f"{_fmt(r['final_loss'])} | {_fmt(r['max_abs_loss_diff'])} | {r['seconds']:.2f} | "
            f"{status} |")
    o = summary["overhead"]
    ratio = "n/a (protection not slower)" if o["ratio"] is None else f"{o['ratio']:.2f}x"
    lines += [
        "",
        *([f"BLAS threads (every run): {summary['blas_threads']}"]
          if summary.get("blas_threads") else []),
        f"protection overhead: {o['protection_seconds']:.2f} s "
        f"({_fmt(o['protection_overhead_pct'])}% of the fault-free run)",
        f"checkpoint/restore overhead: {o['checkpoint_seconds']:.2f} s "
        f"(save {o['save_seconds']:.2f} s, load {o['load_seconds']:.2f} s, replay "
        f"{o['replay_seconds']:.2f} s over {o['replayed_steps']} steps, {o['restores']} restores)",
        f"recovery overhead ratio {o['formula']} = {ratio}",
    ]
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"
