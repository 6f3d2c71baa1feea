"""The checked softmax steps of one pass on the GPU (RawKernels of :mod:`attention._cuda_softmax`).

:class:`GpuForwardStep` and :class:`GpuBackwardStep` implement
:class:`attention.softmax.ForwardStep` and :class:`attention.softmax.BackwardStep` for CuPy
arrays; :mod:`attention.softmax_steps` chooses them. Without a fault hook one launch computes,
observes the product's row checksums and judges the invariants; with a hook a first launch
computes, the hook sees the output, and a second launch judges it. Verdicts stay on the device
(:class:`attention._cuda_softmax.DeviceVerdict`) until the pass settles. The GPU kernels make no
encodings of what they write.

Imports CuPy at the top: imported only once CuPy arrays are in play.
"""
from __future__ import annotations

import math
from typing import Any

import cupy
import numpy as np

from abftgemm.checksums import accumulation_dtype, smallest_normal
from attention import _cuda_softmax
from attention.softmax import (LOG_CHECK_FLOOR, BackwardStep, ForwardStep, Verdict,
                               backward_tolerance, forward_tolerances)


def _device_verdict(ws: Any, name: str, rows: int) -> _cuda_softmax.DeviceVerdict:
    """The reusable device verdict of one check."""
    return _cuda_softmax.DeviceVerdict(ws.slot(name + "_worst", cupy, 1),
                                       ws.buffer(name + "_details", cupy, (rows, 2), np.float64))


class GpuForwardStep(ForwardStep):
    """The forward softmax of one pass on the GPU; see
    :func:`attention.softmax_steps.forward_step`."""

    def run(self) -> None:
        check, hook = self.ctx.check != "off", self.ctx.fault_hook
        self._launch(compute=True, check=check and hook is None)
        if hook is not None:
            hook("softmax", self.probs)
            if check:
                self._launch(compute=False, check=True)
        self.verdict = self._device.read if check else None

    def recompute(self) -> Verdict:
        self._launch(compute=True, check=True)
        self.verdict = self._device.read
        return self.verdict

    def _launch(self, compute: bool, check: bool) -> None:
        inp, scores = self.inp, self.scores
        keys = inp.key_visible
        self._device = _device_verdict(self.ws, "softmax", scores.shape[0] * scores.shape[1])
        _cuda_softmax.forward(
            scores, self.probs, scale=1 / math.sqrt(inp.head_dim), heads=inp.n_heads,
            key_visible=None if keys is None else cupy.ascontiguousarray(keys),
            attn_add=inp.attn_add, causal=inp.causal, compute=compute, check=check,
            floor=LOG_CHECK_FLOOR, p_min=smallest_normal(self.probs.dtype),
            tolerances=forward_tolerances(self.probs.dtype, scores.shape[-1]),
            stats=self.plan.observed if compute and self.plan is not None else None,
            verdict=self._device)


class GpuBackwardStep(BackwardStep):
    """The backward softmax of one pass on the GPU; see
    :func:`attention.softmax_steps.backward_step`.
    With a fault hook, the hook sees the unscaled ``dS`` in the accumulation dtype."""

    def run(self) -> None:
        """The fused kernel; with a hook, compute the unscaled dS, let the hook see it, then
        check and scale it (a second launch)."""
        check, hook = self.ctx.check != "off", self.ctx.fault_hook
        if hook is None:
            self._launch(compute=True, check=check, ds=self.ds, ds_acc=None)
        else:
            acc = accumulation_dtype(self.dp.dtype)
            ds_acc = self.ws.buffer("ds_unscaled", cupy, self.dp.shape, acc)
            self._launch(compute=True, check=False, ds=None, ds_acc=ds_acc)
            hook("softmax_backward", ds_acc)
            self._launch(compute=False, check=check, ds=self.ds, ds_acc=ds_acc)
        self.verdict = self._device.read if check else None

    def recompute(self) -> Verdict:
        self._launch(compute=True, check=True, ds=self.ds, ds_acc=None)
        self.verdict = self._device.read
        return self.verdict

    def _launch(self, compute: bool, check: bool, ds: Any | None, ds_acc: Any | None) -> None:
        dp = self.dp
        u, tiny = backward_tolerance(accumulation_dtype(dp.dtype), dp.shape[-1])
        self._device = _device_verdict(self.ws, "softmax_backward", dp.shape[0] * dp.shape[1])
        _cuda_softmax.backward(
            dp, self.p, scale=self.scale, compute=compute, check=check, u=u, tiny=tiny, ds=ds,
            ds_acc=ds_acc, stats=self.plan.observed if compute and self.plan is not None else None,
            verdict=self._device, causal=self.causal, keep=self.keep, keep_scale=self.keep_scale)
