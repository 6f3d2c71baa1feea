"""The fused attention core's final checks (CPU): its outputs as returned, after the kernels and
the rounding to the data's dtype, against predictions that do not come from them, at O(L d) a
head.

``fused:out`` (forward)
    The output rows' checksums ``O 1``, ``O w`` and ``|O| 1`` (``w`` over the head dimension),
    observed on the returned ``O``, against those the forward kernel carried beside its
    accumulator, ``P [V1, Vw, |V|1] / l`` in float64 from V's row encodings
    (:mod:`attention.fused`, ``fused:O_acc``): the kernel's own check judges its float32 or
    float64 output before it leaves the kernel, this one what the caller gets (the rounding to
    float16 or bfloat16 included, and whatever happened to ``O`` after the kernel wrote it).
    Threshold: ``fused:O_acc``'s, plus ``1.01 u_out`` times the observed ``sum |O|`` and ``d
    u_out tiny_out`` (subnormal results) for the rounding to a 16-bit dtype (and the magnitude
    bound ``sum |O| <= c_mag sum P |V|1`` times ``1 + 1.01 u_out``).
``fused:dV_out`` (backward)
    ``dV = P^T dO`` and the rows of ``P`` sum to 1 (0 for a query that sees no key), so the
    column sums of each head's ``dV`` over the keys equal those of ``dO`` over the queries that
    see a key: ``1^T dV = (P 1)^T dO``. The prediction reads only ``dO`` and the saved
    log-sum-exp (which rows see a key); the kernel's ``fused:dV_acc`` check reads ``P`` and the
    accumulator, this one the returned ``dV``. Threshold per column ``c`` (``u`` the unit
    roundoff of the tiles' dtype, ``T`` key tiles): ``sum_i |dO_ic|`` times ``max_i (2u (L_k +
    2T + |lse_i| + log L_k + 8) + 1.01 u (L_q + 2 T_q))`` (the rows of the recomputed ``P`` sum
    to 1 within the first term: the float32 log-sum-exp's error and the exponential's, ``sum_j
    P_ij |log P_ij| <= log L_k``; the second is the accumulation's) plus ``1.01 u_out sum_j
    |dV_jc| + L_k u_out tiny_out`` for the rounding to a 16-bit dtype. It has no weighted sum:
    it detects, by column, and does not locate the row. Not with attention dropout: the rows of
    the dropped ``P`` do not sum to 1, and their sums are not carried out of the forward, so a
    backward with dropout has no ``fused:dV_out`` check (its ``dV`` is checked by the kernel's
    ``fused:dV_acc`` alone).

A flag in ``check="correct"`` recomputes the whole forward (or backward) and checks again
(:class:`abftgemm.UncorrectableError` if that fails too); ``check="detect"`` reports and warns;
``check="off"`` only calls the fault hook. The dQ and dK roundings to a 16-bit dtype are not
checked after the cast (they are 1 rounding each, outside the kernels' checks).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from abftgemm.checksums import smallest_normal, unit_roundoff
from abftgemm.report import Event, UncorrectableError, announce
from attention import _cpu_fused as K
from attention.context import Context
from attention.fused import fused_backward, fused_forward, work_dtype
from attention.fused_rules import coefficients

#: The final checks' fault-hook and report sites, forward and backward.
OUTPUT_SITE = "fused:out"
GRAD_SITE = "fused:dV_out"
FINAL_SITES = (OUTPUT_SITE, GRAD_SITE)


def verify_output(out: np.ndarray, saved: dict[str, Any], ctx: Context
                  ) -> tuple[np.ndarray, dict[str, Any]]:
    """Check :func:`attention.fused.fused_forward`'s ``out`` against its carried row checksums
    ``saved["sums"]`` (module docstring; fault-hook site ``"fused:out"``). Returns ``(out,
    saved)``, the forward's again after a repair.

    Raises
    ------
    abftgemm.UncorrectableError
        The recomputed output failed the check too.
    """
    _numpy(out)

    def redo() -> tuple[np.ndarray, dict[str, Any]]:
        visible = saved["visible"] if saved["visible"].shape[1] else None
        add = saved["add"] if saved["add"].shape[1] else None
        p, seed = saved.get("dropout") or (0.0, None)
        return fused_forward(saved["q"], saved["k"], saved["v"], ctx, scale=saved["scale"],
                             causal=saved["causal"], key_visible=visible, attn_mask=add,
                             dropout=p, dropout_seed=seed)

    return _verified(ctx, OUTPUT_SITE, (out, saved), lambda r: r[0],
                     lambda r: _output_ratio(*r), redo)


def verify_grads(saved: dict[str, Any], d_out: np.ndarray, grads: tuple[np.ndarray, ...],
                 ctx: Context) -> tuple[np.ndarray, ...]:
    """Check :func:`attention.fused.fused_backward`'s ``dv`` (``grads[2]``) by its column sums
    against those of ``d_out`` (module docstring; fault-hook site ``"fused:dV_out"``). Returns
    ``(dq, dk, dv)``, the backward's again after a repair.

    With attention dropout (``saved["dropout"]``) there is no such prediction: the gradients
    are returned unchecked here (module docstring).

    Raises
    ------
    abftgemm.UncorrectableError
        The recomputed gradients failed the check too.
    """
    _numpy(grads[2])
    if saved.get("dropout") is not None:
        return grads
    return _verified(ctx, GRAD_SITE, grads, lambda g: g[2],
                     lambda g: _grad_ratio(saved, d_out, g[2]),
                     lambda: fused_backward(saved, d_out, ctx))


def _numpy(x: Any) -> None:
    """The final checks take the CPU core's NumPy results (the CUDA kernels carry no output
    checksums out)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"the fused core's final checks take NumPy arrays, got "
                        f"{type(x).__name__}")


def _verified(ctx: Context, site: str, result: Any, checked: Callable[[Any], np.ndarray],
              ratio: Callable[[Any], tuple[float, int, tuple, tuple, float, float]],
              redo: Callable[[], Any]) -> Any:
    """The hook on ``checked(result)``, the check, and the report: ``result``, or ``redo()``'s
    once it verifies."""
    for attempt in range(2):
        if ctx.fault_hook is not None:
            ctx.fault_hook(site, checked(result))
        if ctx.check == "off":
            return result
        if attempt == 0:
            ctx.report.checked[site] = ctx.report.checked.get(site, 0) + 1
        worst, head, rows, cols, mag, tau = ratio(result)
        if worst <= 1:
            if attempt:
                _finding(ctx, site, *first, "recomputed", "recomputed the whole pass and checked "
                     f"it again: |d|/threshold {worst:.3g}")
            return result
        if ctx.check == "detect":
            _finding(ctx, site, head, rows, cols, mag, tau, "reported",
                     "left in place (check='detect')")
            return result
        if attempt:
            _finding(ctx, site, *first, "reported", "recomputed the whole pass, "
                     f"which still failed its check: |d|/threshold {worst:.3g}")
            raise UncorrectableError(f"{site}: the fused core's output still fails its final "
                                     "check after recomputation", ctx.report)
        first = (head, rows, cols, mag, tau)
        result = redo()
    return result


def _finding(ctx: Context, site: str, head: int, rows: tuple, cols: tuple, mag: float, tau: float,
             action: str, verified: str) -> None:
    pattern = "0D" if rows and cols else "1R" if rows else "1C"
    event = Event(site=site, batch=head, pattern=pattern, rows=rows, cols=cols, magnitude=mag,
                  threshold=tau, action=action, verified=verified)
    ctx.report.events.append(event)
    if ctx.check == "detect":
        announce(event)


def _output_ratio(out: np.ndarray, saved: dict[str, Any]
                  ) -> tuple[float, int, tuple, tuple, float, float]:
    """``(worst |d|/tau, head, rows, cols, |d|, tau)`` of the output rows (the worst row, and
    its column where the weighted sum locates it)."""
    n, lq, d = out.shape
    lk = saved["k"].shape[1]
    wt = work_dtype(out.dtype)
    coef = coefficients(lk, d, wt, 2 * -(-lk // K.BC))
    if out.dtype != wt:  # the rounding to the output's dtype (subnormals: absolute, u * tiny)
        u_out = unit_roundoff(out.dtype)
        coef[0] += 1.01 * u_out
        coef[2] += d * u_out * smallest_normal(out.dtype)
        coef[3] *= 1 + 1.01 * u_out
    obs = _row_checksums(out.reshape(n * lq, d))
    pred = np.ascontiguousarray(saved["sums"].reshape(n * lq, 3))
    info = np.zeros(6)
    info[5] = d
    worst = K._judge(pred, obs, n * lq, coef, info)
    v, c = int(info[3]), int(info[4])
    if v < 0:
        return worst, 0, (), (), info[1], info[2]
    return worst, v // lq, (v % lq,), ((c,) if c >= 0 else ()), info[1], info[2]


def _grad_ratio(saved: dict[str, Any], d_out: np.ndarray, dv: np.ndarray
                ) -> tuple[float, int, tuple, tuple, float, float]:
    """``(worst |d|/tau, head, (), (column,), |d|, tau)`` of the heads' ``dV`` column sums
    (float64 sums of the data as stored, no float64 copy of it)."""
    lse = saved["lse"].astype(np.float64)
    n, lq = lse.shape
    lk = dv.shape[1]
    wt = work_dtype(dv.dtype)
    u = unit_roundoff(wt)
    sees = np.isfinite(lse)  # a row that sees no key has lse -inf and a zero P row
    eps = 2 * u * (lk + 2 * -(-lk // K.BC) + np.abs(np.where(sees, lse, 0.0)) + math.log(lk)
                   + 8) + 1.01 * u * (lq + 2 * -(-lq // K.BR))
    tau = np.empty((n, dv.shape[2]))
    for b in range(n):  # one head's |dO| at a time, in its dtype; the worst row's eps
        tau[b] = eps[b].max(initial=0.0) * np.abs(d_out[b]).sum(0, dtype=np.float64)
    tau += lk * smallest_normal(wt)
    if dv.dtype != wt:
        u_out = unit_roundoff(dv.dtype)
        tau += lk * u_out * smallest_normal(dv.dtype)
        for b in range(n):
            tau[b] += 1.01 * u_out * np.abs(dv[b]).sum(0, dtype=np.float64)
    pred = d_out.sum(1, dtype=np.float64)
    if not sees.all():
        pred -= np.where(sees[:, :, None], 0.0, d_out).sum(1, dtype=np.float64)
    diff = np.abs(pred - dv.sum(1, dtype=np.float64))
    ratio = np.where(np.isfinite(diff), diff / tau, np.inf)
    at = int(np.argmax(ratio))
    head, col = divmod(at, ratio.shape[1])
    return float(ratio.flat[at]), head, (), (col,), float(diff.flat[at]), float(tau.flat[at])


def _row_checksums(x: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """``(rows, 3)`` float64 ``(x 1, x w, |x| 1)``, ``w = (j + 1) / d`` as the kernels weigh,
    ``chunk`` rows at a time (no float64 copy of ``x``)."""
    rows, d = x.shape
    w = np.arange(1, d + 1) / d
    out = np.empty((rows, 3))
    for r0 in range(0, rows, chunk):
        xc = x[r0:r0 + chunk].astype(np.float64)
        out[r0:r0 + chunk, 0] = xc.sum(1)
        out[r0:r0 + chunk, 1] = xc @ w
        out[r0:r0 + chunk, 2] = np.abs(xc).sum(1)
    return out
