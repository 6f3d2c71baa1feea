"""Masked softmax, forward and backward, each checked by an invariant that does not share its work.

Softmax is not linear, so GEMM checksums cannot pass through it. Instead:

- forward: every row with a visible key sums to 1 (hidden rows to 0), and the log-domain identity
  ``log P_ij - z_ij = -(max_j z_ij) - log(sum_j exp(z_ij - max_j z_ij))``, the same for every
  visible entry of row ``i`` that is not negligible, holds: the check measures its spread,
  ``max_j - min_j`` of ``log P_ij - z_ij``.
  The forward pass computes ``exp(z - max) / sum``; the check takes logarithms of what was
  delivered, so a fault in the exponential, the sum or the division cannot cancel out;
- backward: ``dS = P * (dP - r)``, ``r = rowsum(dP * P)``, has rows summing to 0 (exactly
  ``r (1 - sum P)`` for a P whose rows sum to 1 only up to rounding) and rows whose dP-weighted
  sum is the variance ``sum P dP**2 - r**2``, whatever ``dP``.

Arithmetic runs in float32 for 16- and 32-bit layers (float64 for float64) and the result is
stored in the layer's dtype. A check that fails triggers one recomputation; if that fails too, the
layer raises :class:`abftgemm.UncorrectableError`.

Each step is one kernel per backend with the same boundaries: numba on the CPU
(:mod:`attention._cpu_softmax`), a CUDA RawKernel on the GPU (:mod:`attention._cuda_softmax`),
each reading its rows once, observing the row checksums the deferred check of the product before
it needs, and judging its invariants on what it stored. Both use the tolerances defined here; the
GPU kernel judges each row with that row's own largest ``|z| + |log P|`` (the CPU's verdict
uses the largest of the pass), and keeps its verdict on the device until the pass settles.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from abftgemm.checksums import accumulation_dtype, smallest_normal, unit_roundoff

#: P entries below this fraction of their row's maximum are skipped by the log identity: their
#: logarithms are dominated by the rounding of tiny numbers, and they carry almost no weight.
#: So are subnormal entries (below :func:`abftgemm.checksums.smallest_normal` of P's dtype, such
#: as float16's from 6.1e-5 down): they keep only an absolute precision, and the identity's
#: tolerance assumes a relative one.
LOG_CHECK_FLOOR = 1e-3


Verdict = Callable[[], tuple[bool, float, float]]
"""An invariant check's outcome, read when called: ``(ok, worst error, its tolerance)``. On the GPU
it stays on the device until the pass settles (:class:`attention._cuda_softmax.DeviceVerdict`)."""


def forward_tolerances(p_dtype: np.dtype, length: int) -> tuple[float, float, float]:
    """``(row_tol, log_base, log_slope)`` for probabilities stored in ``p_dtype``, rows of
    ``length``: a row sum may miss its target by ``row_tol``; the log identity's spread (the
    largest minus the smallest ``log P_ij - z_ij`` of a row, over the entries it uses) may reach
    ``log_base + log_slope * size``, ``size`` the largest ``|z_ij| + |log P_ij|`` it used."""
    acc = accumulation_dtype(p_dtype)
    u = unit_roundoff(p_dtype) + length * unit_roundoff(acc)
    # relative error of P entries >= floor*top is ~u each; logs turn that into absolute ~2u.
    # The check's own arithmetic in the accumulation dtype (a 2-ulp log, one subtraction) errs by
    # at most ~5 units of roundoff of size per entry, twice in a spread.
    return 4 * u, 8 * u, 12 * unit_roundoff(acc)


def _forward_verdict(errors: tuple[float, float, float], p_dtype: np.dtype,
                     length: int) -> tuple[bool, float, float]:
    """(ok, worst error, its tolerance) from ``(worst row-sum error, worst log-identity spread,
    largest size the identity used)`` of probabilities stored in ``p_dtype``, rows of
    ``length`` (see :func:`forward_tolerances`)."""
    worst_row, worst_log, size = errors
    row_tol, log_base, log_slope = forward_tolerances(p_dtype, length)
    log_tol = log_base + log_slope * size
    ok = math.isfinite(worst_row) and math.isfinite(worst_log) and worst_row <= row_tol \
        and worst_log <= log_tol
    worst, tol = (worst_row, row_tol) if worst_row / row_tol >= worst_log / log_tol else \
        (worst_log, log_tol)
    return ok, worst, tol


def backward_tolerance(dtype: np.dtype, length: int) -> tuple[float, float]:
    """``(u, tiny)`` for dS in ``dtype`` (the accumulation dtype), rows of ``length``: a row's
    tolerance is ``u * (sum of its magnitudes) + tiny``."""
    return 8 * length * unit_roundoff(dtype), float(np.finfo(dtype).tiny)


def check_backward(ds: np.ndarray, dp: np.ndarray, p: np.ndarray,
                   causal: bool = False) -> tuple[bool, float, float]:
    """Two checksums of each row of ``dS`` (NumPy, ``(..., seq_q, seq_k)``), against closed forms
    computed from P and dP.

    With ``r = rowsum(dP * P)`` (recomputed here, not taken from the backward pass):

    - plain: ``sum_j dS_ij = r (1 - sum_j P_ij)`` (0 when P's rows sum to 1; the factor accounts
      for P stored in a low-precision dtype);
    - weighted by dP: ``sum_j dS_ij dP_ij = sum_j P_ij dP_ij**2 - r**2`` (a variance), which also
      catches faults that keep the plain sum, such as a scaled row.

    Rows whose P or dP hold INF/NaN (the user's non-finite data, or an overflow upstream; a
    fault there was caught by the check of the product or softmax that made them) are not
    judged: their dS passes through as plain math computes it. A fault in dS itself leaves
    P and dP finite and is judged. ``causal``: past the diagonal P is 0 by definition, so dS
    must be 0 there; those entries of dP are not read (on the CPU a causal ``dP`` is computed
    only up to each row block's last column, the rest of its memory is never written) and those
    of dS count in the plain checksum only. Returns (ok, plain error, plain tolerance) of the row
    that is worst by either checksum, from the numba kernel of :mod:`attention._cpu_checks` (the
    GPU judges inside its backward kernel, :mod:`attention._cuda_softmax`).
    """
    from attention import _cpu_checks  # numba: loaded with the CPU path only

    acc = ds.dtype
    u, tiny = backward_tolerance(acc, ds.shape[-1])
    if not ds.size:
        return True, 0.0, tiny
    rows = _cpu_checks.rows
    worst, err, tol = _cpu_checks.backward_ratio(rows(ds), rows(dp, acc), rows(p, acc), u, tiny,
                                                 ds.shape[-2] if ds.ndim > 1 else 1, causal)
    return worst <= 1, err, tol


def _known(outcome: tuple[bool, float, float]) -> Verdict:
    """A verdict already on the host."""
    return lambda: outcome


def _xp(x: Any) -> Any:
    from abftgemm.backend import array_module

    return array_module(x)


def _device_verdict(ws: Any, name: str, rows: int) -> Any:
    """The reusable device verdict of one check (:class:`attention._cuda_softmax.DeviceVerdict`)."""
    import cupy

    from attention._cuda_softmax import DeviceVerdict

    return DeviceVerdict(ws.buffer(name + "_worst", cupy, (1,), np.uint64),
                         ws.buffer(name + "_details", cupy, (rows, 2), np.float64))


# ------------------------------------------------------------------ the layer's softmax steps


class ForwardStep:
    """The forward softmax of one pass: probabilities, the scores' observed row checksums (into
    ``plan.observed`` when the scores are checked) and the invariant verdict.

    Without a fault hook one fused kernel does everything (:func:`attention._cpu_softmax.forward`
    for float32/float64 on the CPU, :func:`attention._cuda_softmax.forward` on the GPU); with one,
    the hook sees ``P`` between computing and checking. ``verdict`` is a :data:`Verdict`, or None
    with ``check="off"``. ``encodings`` is ``(column encoding of P, of P^T)``, each
    ``(batch*heads, L, 3)``, when the CPU's fused kernel made them on its write of ``P`` (so the
    products that read ``P`` need not), else None.
    """

    def __init__(self, inp: Any, scores: Any, probs: Any, ctx: Any, ws: Any, plan: Any | None):
        self.inp, self.scores, self.probs, self.ctx, self.ws, self.plan = \
            inp, scores, probs, ctx, ws, plan
        self.verdict: Verdict | None = None
        self.encodings: tuple[Any, Any] | None = None
        self.run()

    def run(self) -> None:
        """Compute (again, after the scores were repaired), let the hook see ``P``, check."""
        check, hook = self.ctx.check != "off", self.ctx.fault_hook
        fused = check and hook is None
        if _xp(self.scores) is not np:
            self._gpu(compute=True, check=fused)
            if hook is not None:
                hook("softmax", self.probs)
                if check:
                    self._gpu(compute=False, check=True)
            self.verdict = self._device.read if check else None
            return
        errors = self._compute(fused)
        if hook is not None:
            hook("softmax", self.probs)
        if check:
            self.verdict = _known(self._verdict(errors if hook is None else None))

    def recompute(self) -> Verdict:
        """Recompute after a failed invariant; the new verdict."""
        if _xp(self.scores) is not np:
            self._gpu(compute=True, check=True)
            self.verdict = self._device.read
        else:
            self.verdict = _known(self._verdict(self._compute(fused=True)))
        return self.verdict

    # ---------------------------------------------------------------- GPU

    def _gpu(self, compute: bool, check: bool) -> None:
        """One launch of the forward kernel (:func:`attention._cuda_softmax.forward`)."""
        from attention import _cuda_softmax

        inp, scores = self.inp, self.scores
        keys = inp.key_visible
        self._device = _device_verdict(self.ws, "softmax", scores.shape[0] * scores.shape[1])
        _cuda_softmax.forward(
            scores, self.probs, scale=1 / math.sqrt(inp.head_dim), heads=inp.n_heads,
            key_visible=None if keys is None else _xp(keys).ascontiguousarray(keys),
            attn_add=inp.attn_add, causal=inp.causal, compute=compute, check=check,
            floor=LOG_CHECK_FLOOR, p_min=smallest_normal(self.probs.dtype),
            tolerances=forward_tolerances(self.probs.dtype, scores.shape[-1]),
            stats=self.plan.observed if compute and self.plan is not None else None,
            verdict=self._device)

    # ---------------------------------------------------------------- CPU

    def _compute(self, fused: bool) -> Any | None:
        """Fill ``probs`` and the stats; the invariant errors when ``fused`` (float32/float64)."""
        from attention import _cpu_softmax

        inp, scores = self.inp, self.scores
        scale = 1 / math.sqrt(inp.head_dim)
        wide = scores.dtype.itemsize == 2
        s = scores.astype(np.float32) if wide else scores
        out = self.ws.buffer("probs32", np, scores.shape, np.float32) if wide else self.probs
        errors = np.zeros(3)
        fused = fused and not wide
        cols, rows = _encoding_buffers(self.ws, "probs", scores.shape) if fused else _NONE
        _cpu_softmax.forward(s, np.array([scale], s.dtype), *self._masks(), inp.causal,
                             inp.n_heads, fused, LOG_CHECK_FLOOR,
                             smallest_normal(self.probs.dtype), out, _observed_rows(self.plan),
                             _row_limits(self.plan), errors, cols, rows)
        if wide:
            self.probs[...] = out
        self.encodings = (cols.transpose(0, 2, 1), rows) if fused else None
        return errors if fused else None

    def _masks(self) -> tuple[Any, bool, Any, bool]:
        inp = self.inp
        keys = inp.key_visible if inp.key_visible is not None else _NO_KEYS
        add = inp.attn_add if inp.attn_add is not None else _NO_ADD
        return keys, inp.key_visible is not None, add, inp.attn_add is not None

    def _verdict(self, errors: Any | None) -> tuple[bool, float, float]:
        probs, scores = self.probs, self.scores
        acc = accumulation_dtype(probs.dtype)
        if errors is None:
            from attention import _cpu_softmax

            errors = np.zeros(3)
            _cpu_softmax.check_forward(probs.astype(acc), scores.astype(acc),
                                       np.array([1 / math.sqrt(self.inp.head_dim)], acc),
                                       *self._masks(), self.inp.causal, self.inp.n_heads,
                                       LOG_CHECK_FLOOR, smallest_normal(probs.dtype), errors)
        return _forward_verdict(tuple(float(e) for e in errors), probs.dtype, scores.shape[-1])


class BackwardStep:
    """The backward softmax of one pass: ``dS`` (scaled, into ``d_scores``), dP's observed row
    checksums (into ``plan.observed``), the invariant verdict and (fused on the CPU) the
    ``encodings`` of ``dS`` and ``dS^T``; see :class:`ForwardStep`.

    With a fault hook, the hook sees the unscaled ``dS`` in the accumulation dtype.

    With attention dropout (``dropout``: :class:`attention.dropout.Dropout`), ``d_probs`` is the
    gradient of the dropped probabilities, whose row checksums are observed as read, and
    ``probs`` those before dropout; dS and its invariants take the gradient of the latter,
    ``d_probs * keep / (1 - p)``."""

    def __init__(self, d_probs: Any, probs: Any, d_scores: Any, scale: float, ctx: Any, ws: Any,
                 plan: Any | None, causal: bool = False, dropout: Any | None = None):
        self.dp, self.p, self.ds, self.scale = d_probs, probs, d_scores, scale
        self.causal = causal  # P's rows are zero past the diagonal: so are dS's
        self.keep = None if dropout is None else dropout.keep
        self.keep_scale = 1.0 if dropout is None else dropout.scale
        self.ctx, self.ws, self.plan = ctx, ws, plan
        self.verdict: Verdict | None = None
        self.encodings: tuple[Any, Any] | None = None
        self.run()

    def run(self) -> None:
        check, hook = self.ctx.check != "off", self.ctx.fault_hook
        if _xp(self.dp) is not np:
            self._run_gpu(check, hook)
            return
        from attention import _cpu_softmax

        wide = self.dp.dtype.itemsize == 2
        if not (check or wide or hook is not None):  # straight into d_scores, scaled
            _cpu_softmax.backward(self.dp, self.p, np.array([self.scale], self.dp.dtype),
                                  self.causal, False, 0.0, 0.0, self.ds,
                                  _observed_rows(self.plan), _row_limits(self.plan),
                                  np.zeros(3), *_NONE, *self._keep())
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
        result = np.array([-1.0, 0.0, 0.0])
        cols, rows = _encoding_buffers(self.ws, "d_scores", self.ds.shape)
        _cpu_softmax.backward(self.dp, self.p, np.array([self.scale], self.dp.dtype),
                              self.causal, True, u, tiny, self.ds, _observed_rows(self.plan),
                              _row_limits(self.plan), result, cols, rows, *self._keep())
        self.encodings = cols.transpose(0, 2, 1), rows
        self.verdict = _known((result[0] <= 1, float(result[1]), float(result[2]) or tiny))

    def recompute(self) -> Verdict:
        self.encodings = None  # they described the dS being replaced
        if _xp(self.dp) is not np:
            self._gpu(compute=True, check=True, ds=self.ds, ds_acc=None)
            self.verdict = self._device.read
            return self.verdict
        ds = self._unscaled()
        self.verdict = self._checked(ds)
        self.ds[...] = ds * ds.dtype.type(self.scale)
        return self.verdict

    # ---------------------------------------------------------------- GPU

    def _run_gpu(self, check: bool, hook: Any | None) -> None:
        """The fused kernel; with a hook, compute the unscaled dS, let the hook see it, then
        check and scale it (a second launch)."""
        if hook is None:
            self._gpu(compute=True, check=check, ds=self.ds, ds_acc=None)
        else:
            acc = accumulation_dtype(self.dp.dtype)
            ds_acc = self.ws.buffer("ds_unscaled", _xp(self.dp), self.dp.shape, acc)
            self._gpu(compute=True, check=False, ds=None, ds_acc=ds_acc)
            hook("softmax_backward", ds_acc)
            self._gpu(compute=False, check=check, ds=self.ds, ds_acc=ds_acc)
        self.verdict = self._device.read if check else None

    def _gpu(self, compute: bool, check: bool, ds: Any | None, ds_acc: Any | None) -> None:
        """One launch of the backward kernel (:func:`attention._cuda_softmax.backward`)."""
        from attention import _cuda_softmax

        dp = self.dp
        u, tiny = backward_tolerance(accumulation_dtype(dp.dtype), dp.shape[-1])
        self._device = _device_verdict(self.ws, "softmax_backward", dp.shape[0] * dp.shape[1])
        _cuda_softmax.backward(
            dp, self.p, scale=self.scale, compute=compute, check=check, u=u, tiny=tiny, ds=ds,
            ds_acc=ds_acc, stats=self.plan.observed if compute and self.plan is not None else None,
            verdict=self._device, causal=self.causal, keep=self.keep, keep_scale=self.keep_scale)

    # ---------------------------------------------------------------- CPU

    def _acc(self, x: Any) -> Any:
        acc = accumulation_dtype(x.dtype)
        return x if x.dtype == acc else x.astype(acc)

    def _keep(self) -> tuple[Any, float]:
        """The CPU backward kernel's dropout arguments (an empty mask for none)."""
        return (_NO_KEEP if self.keep is None else self.keep), self.keep_scale

    def _checked(self, ds: Any) -> Verdict:
        """The invariant verdict of the unscaled ``ds`` (a hook may have changed it)."""
        dp = self._acc(self.dp)
        if self.keep is not None:  # the gradient of the probabilities before dropout
            dp = np.where(self.keep, dp * dp.dtype.type(self.keep_scale), dp.dtype.type(0))
        return _known(check_backward(ds, dp, self._acc(self.p), self.causal))

    def _unscaled(self) -> Any:
        """Unscaled ``dS`` in the accumulation dtype, and dP's row checksums."""
        from attention import _cpu_softmax

        dp, p = self._acc(self.dp), self._acc(self.p)
        ds = self.ws.buffer("ds_unscaled", np, dp.shape, dp.dtype)
        _cpu_softmax.backward(dp, p, np.ones(1, dp.dtype), self.causal, False, 0.0, 0.0, ds,
                              _observed_rows(self.plan), _row_limits(self.plan), np.zeros(3),
                              *_NONE, *self._keep())
        return ds


#: Empty encoding buffers: the CPU kernels then make no encodings.
_NONE = (np.zeros((0, 3, 0)), np.zeros((0, 0, 3)))
#: Empty dropout mask: the CPU backward kernel then applies none.
_NO_KEEP = np.zeros((0, 0, 0), bool)
#: Empty row-checksum buffer: the CPU kernels then observe nothing.
_NO_STATS = np.zeros((0, 0, 5))
#: Empty row limits: the CPU kernels then observe whole rows.
_WHOLE_ROWS = np.zeros(0, np.int64)
#: Placeholder masks for the CPU forward kernel's "no key-padding mask" / "no additive mask"
#: (flagged off by its arguments, never read).
_NO_KEYS, _NO_ADD = np.ones((1, 1), bool), np.zeros((1, 1, 1))


def _observed_rows(plan: Any | None) -> Any:
    """Where a CPU softmax kernel puts the row checksums it observes: the buffer of the deferred
    plan that reads them, or none."""
    return _NO_STATS if plan is None else plan.observed


def _row_limits(plan: Any | None) -> Any:
    """How far a CPU softmax kernel observes each row: the deferred plan's limits, or whole
    rows (an empty array)."""
    return _WHOLE_ROWS if plan is None or plan.row_limits is None else plan.row_limits


def _encoding_buffers(ws: Any, name: str, shape: tuple[int, int, int]) -> tuple[Any, Any]:
    """Workspace buffers for the column encodings of a ``(n, rows, cols)`` matrix, ``(n, 3,
    cols)``, and of its transpose, ``(n, rows, 3)``."""
    n, rows, cols = shape
    return (ws.buffer(name + "_cols", np, (n, 3, cols), np.float64),
            ws.buffer(name + "_rows", np, (n, rows, 3), np.float64))
