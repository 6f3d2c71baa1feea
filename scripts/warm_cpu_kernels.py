"""Fill numba's on-disk cache with the CPU kernels that the fused core's GPU tests compare against.

The GPU tests of the fused attention core (the ``pytest_fused`` step of scripts/gpu_check.sh:
tests/test_fused_cuda*.py, tests/test_core_choice.py, ...) check the CUDA kernels against the same
calls on NumPy data: the CPU fused core (:mod:`attention._cpu_fused`), its final checks
(:mod:`attention._cpu_final`) and the unfused core (:mod:`attention._cpu_softmax` and abftgemm's
CPU kernels). Their numba kernels are cached on disk (``cache=True``), but a fresh machine compiles
them first, for minutes, within the step's time. scripts/gpu_check.sh runs this script in the
background while its first steps run, so that the step loads them from the cache instead.

Each group makes on NumPy data the calls that those tests make, at their shapes (the unfused
core's plans depend on them), so that numba compiles every signature they need: float32 and
float64 (float16 and bfloat16 data run in float32); cross attention (``seq_q != seq_k``), causal,
key padding, additive and boolean masks, dropout; check modes "correct" and "off".

Run ``PYTHONPATH=. python scripts/warm_cpu_kernels.py`` from the repository root; the kernels go
where numba caches them (``__pycache__`` beside the sources, or ``NUMBA_CACHE_DIR``). Prints one
line per group with its time; exits non-zero if a call fails.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention.context import Context  # noqa: E402
from attention.core import core_backward, core_forward  # noqa: E402
from attention.dropout_hash import keep_mask  # noqa: E402
from attention.fused import fused_backward, fused_forward  # noqa: E402

#: Dropout probability and seed of the tests' dropout calls.
P, SEED = 0.3, 1234


def _data(n: int, lq: int, lk: int, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
    """``q``, ``k``, ``v`` and the output's gradient, standard normal, of ``dtype``."""
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(shape).astype(dtype)
                 for shape in ((n, lq, d), (n, lk, d), (n, lk, d), (n, lq, d)))


def _visible(n: int, lk: int) -> np.ndarray:
    """A key padding mask ``(n, lk)``: about a fifth of the keys hidden, never the first."""
    visible = np.random.default_rng(1).random((n, lk)) < 0.8
    visible[:, 0] = True
    return visible


def _additive(n: int, lq: int, lk: int) -> np.ndarray:
    """A float mask ``(n, lq, lk)`` with a query row that sees no key (``-inf``)."""
    add = np.random.default_rng(2).standard_normal((n, lq, lk))
    add[:, lq // 2] = -np.inf
    return add


def _fused(*dtypes: Any) -> None:
    """:func:`attention.fused.fused_forward` and ``fused_backward``, as the CUDA kernels'
    tests call them for reference (tests/test_fused_cuda_dropout.py, test_fused_cuda_final.py)."""
    for dtype in dtypes:
        for causal in (False, True):
            q, k, v, do = _data(2, 70, 70 if causal else 45, 16, dtype)
            for check in ("correct", "off"):
                ctx = Context(check=check)
                _, saved = fused_forward(q, k, v, ctx, causal=causal,
                                         key_visible=_visible(2, k.shape[1]), dropout=P,
                                         dropout_seed=SEED)
                fused_backward(saved, do, ctx)
        q, k, v, do = _data(2, 40, 40, 16, dtype)
        _, saved = fused_forward(q, k, v, Context(), attn_mask=_additive(2, 40, 40))
        fused_backward(saved, do, Context())


def _final_checks(*dtypes: Any) -> None:
    """The fused core with its final checks, ``core="fused"`` (tests/test_fused_cuda_final.py):
    causal, an additive mask, causal with dropout."""
    for dtype in dtypes:
        q, k, v, do = _data(2, 40, 40, 16, dtype)
        for kw in ({"causal": True}, {"attn_mask": _additive(2, 40, 40)},
                   {"causal": True, "dropout": P, "dropout_seed": SEED}):
            ctx = Context()
            _, saved = core_forward(q, k, v, ctx, core="fused", **kw)
            core_backward(saved, do, ctx)


#: The unfused core's reference calls: ``(n, seq_q, seq_k, d)``, causal, with dropout, dtypes
#: (tests/test_fused_cuda_dropout.py, then tests/test_core_choice.py).
UNFUSED_CALLS = (((2, 70, 45, 16), False, True, (np.float32, np.float64)),
                 ((2, 70, 70, 16), True, True, (np.float32, np.float64)),
                 ((2, 20, 20, 8), True, False, (np.float32,)))


def _unfused() -> None:
    """The unfused core with the key padding as a boolean mask, with and without materialized
    dropout decisions (:data:`UNFUSED_CALLS`)."""
    for (n, lq, lk, d), causal, dropout, dtypes in UNFUSED_CALLS:
        hidden = np.broadcast_to(~_visible(n, lk)[:, None, :], (n, lq, lk)).copy()
        kw = {"dropout": P, "dropout_keep": keep_mask(SEED, P, (n, lq, lk))} if dropout else {}
        for dtype in dtypes:
            q, k, v, do = _data(n, lq, lk, d, dtype)
            ctx = Context()
            _, saved = core_forward(q, k, v, ctx, causal=causal, attn_mask=hidden,
                                    core="unfused", **kw)
            core_backward(saved, do, ctx)


#: Group name -> what warms it; the fused core's kernels first.
GROUPS: dict[str, Callable[[], None]] = {
    "fused core float32": partial(_fused, np.float32),
    "fused core float64": partial(_fused, np.float64),
    "fused core float16, bfloat16": partial(_fused, np.float16, ml_dtypes.bfloat16),
    "fused core's final checks": partial(_final_checks, np.float32, np.float64, np.float16,
                                         ml_dtypes.bfloat16),
    "unfused core": _unfused,
}


def main() -> None:
    start = time.perf_counter()
    for name, warm in GROUPS.items():
        t0 = time.perf_counter()
        warm()
        print(f"warmed {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"all warmed in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
