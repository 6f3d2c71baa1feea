"""The checked softmax steps of one pass on the CPU (the numba kernels of
:mod:`attention._cpu_softmax`).

:class:`CpuForwardStep` and :class:`CpuBackwardStep` implement
:class:`attention.softmax.ForwardStep` and :class:`attention.softmax.BackwardStep` for NumPy
arrays; :mod:`attention.softmax_steps` chooses them. Without a fault hook one fused kernel
computes, observes the product's row checksums, judges the invariants and (float32/float64) makes
the encodings of what it writes; with a hook the kernel runs unchecked, the hook sees the output,
and the invariants are judged afterwards. 16-bit layers compute in float32 and store in their
dtype.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from abftgemm.checksums import accumulation_dtype, smallest_normal
from attention import _cpu_softmax
from attention._cpu_softmax import BackwardCheck, Dropout, ForwardCheck, Masks, Observe
from attention.softmax import (LOG_CHECK_FLOOR, BackwardStep, ForwardStep, Verdict,
                               backward_tolerance, check_backward, forward_verdict)


def _known(outcome: tuple[bool, float, float]) -> Verdict:
    """A verdict already on the host."""
    return lambda: outcome


class CpuForwardStep(ForwardStep):
    """The forward softmax of one pass on the CPU; see
    :func:`attention.softmax_steps.forward_step`."""

    def run(self) -> None:
        check, hook = self.ctx.check != "off", self.ctx.fault_hook
        errors = self._compute(check and hook is None)
        if hook is not None:
            hook("softmax", self.probs)
        if check:
            self.verdict = _known(self._verdict(errors if hook is None else None))

    def recompute(self) -> Verdict:
        self.verdict = _known(self._verdict(self._compute(fused=True)))
        return self.verdict

    def _compute(self, fused: bool) -> Any | None:
        """Fill ``probs`` and the stats; the invariant errors when ``fused`` (float32/float64)."""
        inp, scores = self.inp, self.scores
        scale = 1 / math.sqrt(inp.head_dim)
        wide = scores.dtype.itemsize == 2
        s = scores.astype(np.float32) if wide else scores
        out = self.ws.buffer("probs32", np, scores.shape, np.float32) if wide else self.probs
        fused = fused and not wide
        check = None
        if fused:
            check = ForwardCheck(LOG_CHECK_FLOOR, smallest_normal(self.probs.dtype), np.zeros(3),
                                 *_encoding_buffers(self.ws, "probs", scores.shape))
        _cpu_softmax.forward(s, s.dtype.type(scale), out, self._masks(), _observe(self.plan),
                             check)
        if wide:
            self.probs[...] = out
        if check is None:
            self.encodings = None
            return None
        self.encodings = check.cols, check.rows
        return check.errors

    def _masks(self) -> Masks:
        inp = self.inp
        return Masks(inp.key_visible, inp.attn_add, inp.causal, inp.n_heads)

    def _verdict(self, errors: Any | None) -> tuple[bool, float, float]:
        probs, scores = self.probs, self.scores
        acc = accumulation_dtype(probs.dtype)
        if errors is None:
            errors = np.zeros(3)
            _cpu_softmax.check_forward(probs.astype(acc), scores.astype(acc),
                                       acc.type(1 / math.sqrt(self.inp.head_dim)),
                                       self._masks(), LOG_CHECK_FLOOR,
                                       smallest_normal(probs.dtype), errors)
        return forward_verdict(tuple(float(e) for e in errors), probs.dtype, scores.shape[-1])


class CpuBackwardStep(BackwardStep):
    """The backward softmax of one pass on the CPU; see
    :func:`attention.softmax_steps.backward_step`."""

    def run(self) -> None:
        check, hook = self.ctx.check != "off", self.ctx.fault_hook
        wide = self.dp.dtype.itemsize == 2
        if not (check or wide or hook is not None):  # straight into d_scores, scaled
            _cpu_softmax.backward(self.dp, self.p, self.dp.dtype.type(self.scale), self.causal,
                                  self.ds, _observe(self.plan), None, self._dropout())
            return
        if wide or hook is not None:
            ds = self._unscaled()
            if hook is not None:
                hook("softmax_backward", ds)
            if check:
                self.verdict = self._checked(ds)
            self.ds[...] = ds * ds.dtype.type(self.scale)
            return
        u, tiny = backward_tolerance(self.ds.dtype, self.ds.shape[-1])
        check = BackwardCheck(u, tiny, np.array([-1.0, 0.0, 0.0]),
                              *_encoding_buffers(self.ws, "d_scores", self.ds.shape))
        _cpu_softmax.backward(self.dp, self.p, self.dp.dtype.type(self.scale), self.causal,
                              self.ds, _observe(self.plan), check, self._dropout())
        self.encodings = check.cols, check.rows
        result = check.result
        self.verdict = _known((result[0] <= 1, float(result[1]), float(result[2]) or tiny))

    def recompute(self) -> Verdict:
        self.encodings = None  # they described the dS being replaced
        ds = self._unscaled()
        self.verdict = self._checked(ds)
        self.ds[...] = ds * ds.dtype.type(self.scale)
        return self.verdict

    def _acc(self, x: Any) -> Any:
        acc = accumulation_dtype(x.dtype)
        return x if x.dtype == acc else x.astype(acc)

    def _dropout(self) -> Dropout | None:
        """The backward kernel's dropout group (None for none)."""
        return None if self.keep is None else Dropout(self.keep, self.keep_scale)

    def _checked(self, ds: Any) -> Verdict:
        """The invariant verdict of the unscaled ``ds`` (a hook may have changed it)."""
        dp = self._acc(self.dp)
        if self.keep is not None:  # the gradient of the probabilities before dropout
            dp = np.where(self.keep, dp * dp.dtype.type(self.keep_scale), dp.dtype.type(0))
        return _known(check_backward(ds, dp, self._acc(self.p), self.causal))

    def _unscaled(self) -> Any:
        """Unscaled ``dS`` in the accumulation dtype, and dP's row checksums."""
        dp, p = self._acc(self.dp), self._acc(self.p)
        ds = self.ws.buffer("ds_unscaled", np, dp.shape, dp.dtype)
        _cpu_softmax.backward(dp, p, dp.dtype.type(1), self.causal, ds, _observe(self.plan),
                              None, self._dropout())
        return ds


def _observe(plan: Any | None) -> Observe | None:
    """The row checksums a kernel observes: into the buffer of the deferred plan that reads
    them, as far as it computed each row; None without such a plan."""
    return None if plan is None else Observe(plan.observed, plan.row_limits)


def _encoding_buffers(ws: Any, name: str, shape: tuple[int, int, int]) -> tuple[Any, Any]:
    """Workspace buffers for the column encodings of a ``(n, rows, cols)`` matrix, ``(3, n,
    cols)``, and of its transpose, ``(3, n, rows)`` (:mod:`abftgemm.checksums`)."""
    n, rows, cols = shape
    return (ws.buffer(name + "_cols", np, (3, n, cols), np.float64),
            ws.buffer(name + "_rows", np, (3, n, rows), np.float64))
