"""The checked softmax step of a pass on its backend: :func:`forward_step`, :func:`backward_step`.

Each picks the step classes of the arrays' backend once (:mod:`attention._cpu_steps` for NumPy,
:mod:`attention._cuda_steps` for CuPy, loaded only then), runs the step and returns it; the
invariants, tolerances and the :class:`attention.softmax.Step` interface are in
:mod:`attention.softmax`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from attention.softmax import Step


def forward_step(inp: Any, scores: Any, probs: Any, ctx: Any, ws: Any,
                 plan: Any | None) -> Step:
    """The forward softmax of one pass, run: ``probs`` from the raw ``scores``, the scores' row
    checksums observed into ``plan.observed`` (when the scores are checked by ``plan``, a
    :class:`abftgemm.ProtectedMatmul` with ``directions="rows by consumer"``), the invariant
    verdict.

    ``inp`` carries ``head_dim``, ``n_heads``, ``causal``, ``key_visible`` and ``attn_add``;
    ``ctx`` the check mode and fault hook (which sees ``P`` between computing and checking);
    ``ws`` the workspace of buffers.
    """
    steps = _steps(scores)
    step_class = steps.CpuForwardStep if _on_cpu(scores) else steps.GpuForwardStep
    step = step_class(inp, scores, probs, ctx, ws, plan)
    step.run()
    return step


def backward_step(d_probs: Any, probs: Any, d_scores: Any, scale: float, ctx: Any, ws: Any,
                  plan: Any | None, causal: bool = False, dropout: Any | None = None) -> Step:
    """The backward softmax of one pass, run: ``dS`` (scaled by ``scale``, into ``d_scores``),
    dP's row checksums observed into ``plan.observed``, the invariant verdict.

    ``causal``: P's rows are zero past the diagonal, so are dS's. With attention dropout
    (``dropout``: :class:`attention.dropout.Dropout`), ``d_probs`` is the gradient of the dropped
    probabilities, whose row checksums are observed as read, and ``probs`` those before dropout;
    dS and its invariants take the gradient of the latter, ``d_probs * keep / (1 - p)``. With a
    fault hook, the hook sees the unscaled ``dS`` in the accumulation dtype.
    """
    steps = _steps(d_probs)
    step_class = steps.CpuBackwardStep if _on_cpu(d_probs) else steps.GpuBackwardStep
    step = step_class(d_probs, probs, d_scores, scale, ctx, ws, plan, causal, dropout)
    step.run()
    return step


def _on_cpu(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _steps(x: Any) -> Any:
    """The step classes of ``x``'s backend (numba for NumPy, RawKernels for CuPy)."""
    if _on_cpu(x):
        from attention import _cpu_steps

        return _cpu_steps
    from attention import _cuda_steps

    return _cuda_steps
