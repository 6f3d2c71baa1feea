"""False positives of the fused protected attention core: clean fwd+bwd calls on adversarial data.

Every call runs :func:`attention.fused.fused_forward` and :func:`attention.fused.fused_backward`
(``check="correct"``; NumPy data on the numba kernels, or with ``--backend cupy`` CuPy data on
the CUDA kernels) on fault-free data drawn to stress the thresholds,
and counts the calls whose report holds any event (a false positive), the calls that raised, and
the calls whose output or gradients hold INF/NaN. Cases cycle through (:func:`adversarial_case`):

- logits near float32's exponential overflow (``|scale q k|`` up to ~88) and far beyond it (up to
  ~1e15), where the online softmax's rescaling underflows whole tiles;
- identical keys (every row of scores flat: ``P = 1/L`` everywhere);
- key padding that leaves some keys visible, one whole head (batch item) with no visible key
  (fully masked rows: output and gradients 0), and causal masks (the first query sees one key);
- additive masks: a position bias (ALiBi's ``-slope |i - j|``, slopes up to ~3) with entries
  "not allowed" as ``-inf`` or as float32's lowest number (eager masks), whole rows of them
  among them, and large positive biases on a few entries;
- attention dropout at probabilities up to 0.9, on data scaled up to near overflow;
- lengths that are not multiples of the 64-row tiles, head dims 16, 64 and 128.

The issue's reliability target is 0 false positives in 10^4 clean calls at L = 4096; on a small
CPU the script runs what fits (``--calls`` at ``--max-len``, ``--long-calls`` more at
``--long-len``) and prints exactly what it ran:

    PYTHONPATH=. python scripts/fused_clean_calls.py --calls 2000 --max-len 512 \
        --long-calls 4 --long-len 4096 [--seed 0] [--minutes 10] [--backend cupy|cupy-on-cpu]

``--minutes`` stops the calls (both kinds) after that long and reports what ran.

Exit status 1 when any call had a false positive, raised, or produced INF/NaN.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from abftgemm import UncorrectableError  # noqa: E402
from abftgemm.backend import to_host  # noqa: E402
from attention.context import Context  # noqa: E402
from attention.fused import fused_backward, fused_forward  # noqa: E402
from bench.timing import device_name  # noqa: E402

#: Largest logit of the "near overflow" cases: float32's exp overflows above ~88.72.
NEAR_OVERFLOW = 88.0
#: The kinds of case :func:`adversarial_case` cycles through.
CASES = ("near-overflow", "far-beyond", "flat-rows", "padded", "one-head-masked", "additive-mask",
         "dropout", "plain")


@dataclass
class Case:
    """One clean call's inputs."""

    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    causal: bool
    visible: np.ndarray | None
    attn_mask: np.ndarray | None = None
    dropout: float = 0.0
    dropout_seed: int | None = None


def adversarial_case(rng: np.random.Generator, call: int, max_len: int, dtype: Any,
                     length: int | None = None) -> Case:
    """The ``call``-th case (kind ``CASES[call % len(CASES)]``), sizes drawn from ``rng``: ``n``
    heads of 1 to 3, a sequence of ``length`` (or drawn up to ``max_len``), head dim 16, 64 or
    128, every other call causal."""
    name = CASES[call % len(CASES)]
    n = int(rng.integers(1, 4))
    d = int(rng.choice([16, 64, 128]))
    lq = length or int(rng.integers(1, max_len + 1))
    causal = bool(call // len(CASES) % 2)
    lk = lq if causal else (length or int(rng.integers(1, max_len + 1)))
    q = rng.standard_normal((n, lq, d))
    k = rng.standard_normal((n, lk, d))
    v = rng.standard_normal((n, lk, d))
    do = rng.standard_normal((n, lq, d))
    visible = attn_mask = None
    dropout, dropout_seed = 0.0, None
    if name in ("near-overflow", "far-beyond"):
        # Scores of ~N(0, s^2) with the largest near the target: s from the target over ~4 sigma.
        target = NEAR_OVERFLOW if name == "near-overflow" else 10.0 ** rng.uniform(3, 15)
        # q and k stay finite in the data's dtype (float16: scores up to ~6.7e7, not 1e15)
        limit = float(ml_dtypes.finfo(dtype).max) / 8
        target = min(target, limit * limit)
        spread = np.sqrt(target / 4.0)
        q *= spread
        k *= spread
    elif name == "flat-rows":
        k[:] = k[:, :1]
        q *= 10.0
    elif name in ("padded", "one-head-masked"):
        visible = rng.random((n, lk)) < rng.uniform(0.05, 0.9)
        if name == "one-head-masked":
            visible[int(rng.integers(n))] = False
    elif name == "additive-mask":
        attn_mask = _additive_mask(rng, n, lq, lk)
    elif name == "dropout":
        dropout = float(rng.choice([rng.uniform(0.01, 0.5), 0.9]))
        dropout_seed = int(rng.integers(2**63))
        q *= np.sqrt(NEAR_OVERFLOW / 4.0) if rng.random() < 0.5 else 1.0
    q, k, v, do = (np.ascontiguousarray(x.astype(dtype)) for x in (q, k, v, do))
    return Case(name, q, k, v, do, causal, visible, attn_mask, dropout, dropout_seed)


def _additive_mask(rng: np.random.Generator, n: int, lq: int, lk: int) -> np.ndarray:
    """A float32 ``(n or 1, lq, lk)`` mask: ALiBi's position bias ``-slope |i - j|``, entries
    "not allowed" (``-inf`` or float32's lowest number, as eager masks write it) at a random
    rate, sometimes a whole row of them, and sometimes large positive biases on a few entries."""
    heads = n if rng.random() < 0.5 else 1
    slope = 10.0 ** rng.uniform(-2, 0.5, (heads, 1, 1))
    distance = np.abs(np.arange(lq)[:, None] - np.arange(lk)[None, :])
    mask = -slope * distance
    hidden = -np.inf if rng.random() < 0.5 else float(np.finfo(np.float32).min)
    mask[rng.random(mask.shape) < rng.uniform(0.0, 0.6)] = hidden
    if rng.random() < 0.5:
        mask[:, int(rng.integers(lq))] = hidden
    if rng.random() < 0.3:
        mask[rng.random(mask.shape) < 0.01] = 1e4
    return mask.astype(np.float32)


@dataclass
class Tally:
    """Counts over the calls run."""

    calls: int = 0
    flagged: int = 0
    raised: int = 0
    nonfinite: int = 0
    by_case: dict[str, int] = field(default_factory=dict)
    first_flags: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def run(self, case: Case, label: str, xp: Any = np) -> None:
        """One clean fwd+bwd of ``case`` on array module ``xp``, counted."""
        q, k, v, do = (xp.asarray(x) for x in (case.q, case.k, case.v, case.do))
        visible = None if case.visible is None else xp.asarray(case.visible)
        mask = None if case.attn_mask is None else xp.asarray(case.attn_mask)
        started = time.perf_counter()
        ctx = Context()
        try:
            out, saved = fused_forward(q, k, v, ctx, causal=case.causal, key_visible=visible,
                                       attn_mask=mask, dropout=case.dropout,
                                       dropout_seed=case.dropout_seed)
            grads = fused_backward(saved, do, ctx)
            out, grads = to_host(out), [to_host(g) for g in grads]
        except UncorrectableError as exc:
            self.raised += 1
            self.first_flags.append(f"{label}: raised {exc}")
            grads, out = (), None
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.by_case[case.name] = self.by_case.get(case.name, 0) + 1
        if ctx.report.events:
            self.flagged += 1
            if len(self.first_flags) < 10:
                self.first_flags.append(f"{label}: {ctx.report.summary()}")
        if out is not None and not all(np.isfinite(x.astype(np.float32)).all()
                                       for x in (out, *grads)):
            self.nonfinite += 1
            self.first_flags.append(f"{label}: INF/NaN in the results")


def _shape(case: Case) -> str:
    n, lq, d = case.q.shape
    extra = " causal" if case.causal else ""
    if case.dropout:
        extra += f" dropout={case.dropout:.3f}"
    return f"n={n} Lq={lq} Lk={case.k.shape[1]} d={d}{extra}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls at random lengths")
    parser.add_argument("--max-len", type=int, default=512, help="their longest sequence")
    parser.add_argument("--long-calls", type=int, default=2, help="calls at --long-len")
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--dtype", default="float32",
                        choices=("float16", "bfloat16", "float32", "float64"))
    parser.add_argument("--backend", default="numpy", choices=("numpy", "cupy", "cupy-on-cpu"),
                        help="numpy: the numba kernels; cupy: the CUDA kernels; cupy-on-cpu: the "
                             "CUDA kernels run on the CPU (tests/cuda_on_cpu, needs g++)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=0.0,
                        help="stop calling after this long, random-length and long calls alike "
                             "(0: no limit); what ran is reported")
    args = parser.parse_args(argv)
    if min(args.calls, args.long_calls) < 0 or min(args.max_len, args.long_len) < 1:
        parser.error("calls must be >= 0 and lengths >= 1")
    if args.backend == "numpy":
        return _campaign(args, np)
    if args.backend == "cupy":
        import cupy

        return _campaign(args, cupy)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from cuda_on_cpu import standin

    with standin.installed():  # the stand-in is "cupy" while it is installed
        import cupy

        return _campaign(args, cupy)


def _campaign(args: argparse.Namespace, xp: Any) -> int:
    """The calls :func:`main` was asked for, on array module ``xp``; 1 when any flagged, raised
    or returned INF/NaN."""
    rng = np.random.default_rng(args.seed)
    dtype = np.dtype(ml_dtypes.bfloat16 if args.dtype == "bfloat16" else args.dtype)
    fused_forward(*(xp.ones((1, 8, 16), dtype) for _ in range(3)), Context())  # compile
    short, long = Tally(), Tally()
    deadline = time.monotonic() + 60 * args.minutes if args.minutes > 0 else None
    for call in range(args.calls):
        if deadline is not None and time.monotonic() > deadline:
            break
        case = adversarial_case(rng, call, args.max_len, dtype)
        short.run(case, f"call {call} ({case.name}, {_shape(case)})", xp)
    for call in range(args.long_calls):
        if deadline is not None and time.monotonic() > deadline:
            break
        case = adversarial_case(rng, call, args.long_len, dtype, length=args.long_len)
        long.run(case, f"long call {call} ({case.name}, {_shape(case)})", xp)
        print(f"long call {call}: {case.name}, {_shape(case)}, {long.seconds:.0f} s so far, "
              f"{long.flagged} flagged, {long.raised} raised, {long.nonfinite} with INF/NaN",
              flush=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{datetime.date.today()}, {device_name(xp)}, load average {load}; "
          f"backend {args.backend}, dtype {dtype.name}, seed {args.seed}")
    for label, t, size in (("random lengths", short, f"1..{args.max_len}"),
                           ("long", long, str(args.long_len))):
        cases = ", ".join(f"{k} {v}" for k, v in sorted(t.by_case.items()))
        print(f"{label} (L {size}): {t.calls} clean fwd+bwd calls in {t.seconds:.0f} s: "
              f"{t.flagged} flagged (false positives), {t.raised} raised, {t.nonfinite} with "
              f"INF/NaN [{cases}]")
    for line in short.first_flags + long.first_flags:
        print("  " + line)
    bad = sum(t.flagged + t.raised + t.nonfinite for t in (short, long))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
