"""The fused attention core's final checks: its outputs as returned, after the kernels and the
rounding to the data's dtype, against predictions that do not come from them, at O(L d) a head.
NumPy results (the CPU kernels, :mod:`attention._cpu_fused`) are summed by the numba kernels of
:mod:`attention._cpu_final`, CuPy results (the CUDA kernels, :mod:`attention._cuda_fused`) by CuPy
array operations, with the same formulas and thresholds; ``T`` and ``T_q`` below count the tiles
of the kernels that ran (128 x 128 on the CPU, 32 x 32 in CUDA).

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
    accumulator, this one the returned ``dV``. Threshold per column ``c`` (``u`` the unit roundoff
    of the tiles' dtype, ``T`` key tiles): ``sum_i |dO_ic|`` times ``max_i (2u (L_k + 2T + |lo_i| +
    log L_k + 8) + 1.01 u (L_q + 2 T_q))`` (the rows of the recomputed ``P`` sum to 1 within the
    first term: the error of the log-sum-exp, kept as ``lse + lse_lo`` (``lo`` for short; the sum
    ``l`` and the rounding of ``lo`` and of ``log l``), and the exponential's, ``sum_j P_ij |log
    P_ij| <= log L_k``; the second is the accumulation's) plus ``1.01 u_out sum_j |dV_jc| + L_k
    u_out tiny_out`` for the rounding to a 16-bit dtype. It has no weighted sum: it detects, by
    column, and does not locate the row. With attention dropout ``dV = P_d^T dO``, ``P_d =
    fl(P ks) keep``, whose rows do not sum to 1: the forward carries their sums ``r_i = sum_j
    P_d,ij / l`` in float64 beside the output's checksums (``saved["sums"][..., 3]``, made from
    the forward's ``P`` and keep decisions as its ``P_d`` is), and the prediction is ``sum_i r_i
    dO_ic``. The forward's weights are ``P*_ij (1 + omega_ij)`` (``fused:dK_out``'s below), the
    backward's ``c_i P*_ij (1 + eta_ij)``, each rounded once more by ``ks``, and both divide by
    the same ``l``; so each row's ``r_i`` and the backward's kept sum differ by at most ``1.02
    ks' (e_i + h_i + w + 4.04 u) <= eps'_i = 1.05 ks' (eps_i + h_i + w + 5 u)`` (``ks' = (1 +
    u) / (1 - p)``, the kernels' rounded ``ks``; ``eps_i`` the per-row term above, which bounds
    ``e_i``): the threshold is ``sum_i |dO_ic|`` times ``max_i eps'_i``, the magnitude bound
    ``ks' (1 + max_i eps'_i)`` times ``sum_i |dO_ic|``, and the 16-bit terms as above. It needs
    the forward's sums: a backward whose forward ran with ``check="off"`` has no ``fused:dV_out``
    check with dropout.
``fused:dK_out`` (backward)
    ``dK = scale dS^T Q`` with ``dS = P (dP - D)``, ``D_i = rowsum(dO_i O_i)``, and the rows of
    ``dS`` sum to 0: ``sum_j P_ij dP_ij = dO_i . sum_j P_ij V_j = dO_i . O_i = D_i`` and ``sum_j
    P_ij = 1``, so ``sum_j dS_ij = D_i - D_i = 0`` (a row that sees no key: ``P``, ``dS`` 0).
    Hence ``1^T dK = scale (dS 1)^T Q = 0``: the column sums of each head's ``dK`` over the keys
    are 0 up to rounding. With dropout it holds too: ``dS = P (dP' keep ks - D)`` with ``P``
    before dropout (rows summing to 1) and ``O = (P keep ks) V``, so ``sum_j P_ij dP'_ij keep_ij
    ks = dO_i . O_i = D_i`` (``ks`` the kernels' factor, whatever its rounding). The check reads
    ``dK``, ``Q``, ``dO``, ``O`` (as the backward read it), ``max_j |V_jc|`` and the log-sum-exp;
    no product with ``P``. Threshold, derived against ``P* = softmax(z)`` of the scores ``z`` the
    kernels computed (forward and backward make them alike, as for ``fused:dV_out``), ``O* = (P*
    keep ks) V``, ``u`` the tiles' unit roundoff, ``T``/``T_q`` the key/query tiles, ``x_ij = z_ij -
    lse_i - lo_i`` (``sum_j P*_ij |x_ij| <= log L_k``, the entropy), ``G_i = ks sum_c |dO_ic| max_j
    |V_jc|`` (``|dP_ij| <= (1 + d u) G_i / ks``, ``sum_j P*_ij keep_ij ks |dO_i| |V_j| <= G_i``) and
    ``A_i = sum_c |dO_ic O_ic|`` (``|D_i| <= A_i``):

    - the backward's ``P_ij = fl(exp(fl(fl(z_ij - lse_i) - lo_i))) = c_i P*_ij (1 + eta_ij)``
      (``z_ij - lse_i`` exact where ``P`` matters: the two are within a factor 2): ``c_i =
      exp(lse*_i - lse_i - lo_i)`` is common to the row (``|lse_i + lo_i - lse*_i| <= e_i = 2u (L_k
      + 2T + |lo_i| + log L_k + 8) + L_k tiny``, ``fused:dV_out``'s bound) and cancels from ``sum_j
      P (g - D)``; the rest, the exponential's ulp and its argument's rounding, ``sum_j P*_ij
      |eta_ij| <= h_i = 2.01 u + 1.01 u (log L_k + e_i)``. So ``sum_j dS_ij = c_i [sum_j P* (g -
      g*) - (D - dO . O) - dO . (O - O*) + sum_j P* ((1 + eta)(1 + theta) - 1)(g - D)]`` (``g`` the
      ``dP`` the kernel used, ``theta`` dS's two roundings), at most ``1.01 c_i`` times ``(d + 2) u
      G_i`` (the product ``dP`` and the dropout factor) ``+ (u + d u64) A_i`` (``D``'s float64 sum
      rounded to the tiles' dtype) ``+ F_i + 1.02 (h_i + 2.01 u) (G_i + A_i) + L_k tiny (1 + G_i +
      A_i)`` (flushed entries);
    - ``F_i >= |dO_i . (O_i - O*_i)|``, the forward's error of the O the backward read: the online
      softmax gives ``O = acc / l`` with the same weights ``W_j = exp(z_j - m) (1 + omega_j)`` in
      ``acc`` and ``l`` (the same tiles ``p`` and rescalings ``alpha``), ``|omega_j| <= 1.02 u
      (2.01 (T + 1) + |x_j|)`` (a tile's exponential and the later ``alpha``'s, whose arguments
      add up to ``m - z_j <= |x_j|``), so the normalized weights are within ``2.02 w`` of ``P*``
      in sum, ``w = 1.02 u (2.01 (T + 1) + log L_k) + 1.01 L_k tiny``; ``acc`` and ``l`` round
      ``L_k + 2T + 1`` times (the tiles' sums, the rescalings, the dropout product, the division):
      ``F_i = (2.02 w + 1.01 u (L_k + 2T + 1)(1 + 2.02 w)) G_i + (1.02 u (L_k + 2T + 1) + 1.01
      u_out) A_i + u_out tiny_out sum_c |dO_ic|`` (``u_out``, ``tiny_out``: the rounding to a
      16-bit dtype, else 0);
    - ``sum_j |dS_ij| <= 1.02 c_i (1 + h_i)(G_i + A_i)``, and ``dK += dS^T Q`` errs by ``1.01 u
      (L_q + 2 T_q) sum_i |dS_ij| |Q_ic|``.

    Per column ``c``: ``scale sum_i |Q_ic| (|sum_j dS_ij| + 1.01 u (L_q + 2 T_q) sum_j |dS_ij|)``
    plus ``(1.01 u + 1.01 u_out + L_k u64) sum_j |dK_jc|`` (the multiplication by ``scale``, the
    rounding to a 16-bit dtype, the float64 column sum) and ``L_k (tiny + u_out tiny_out)`` for
    subnormal results; rows that see no key add nothing (their ``P`` and ``dS`` are 0); a head
    with ``e_i > 0.5`` (over 2^21 keys in float32) has no finite threshold, only INF or NaN sums
    are flagged there. Worst-case
    bounds: at L = 130, d = 32 (float32 tiles, standard normal data) the threshold is about 0.2%
    of a column's ``sum_j |dK_jc|``, and it grows with ``L``. It detects by column and does not
    locate the row.
``fused:dV_out`` and ``fused:dK_out``, their rows (backward)
    Each row of the returned ``dK`` and ``dV`` against the row checksums the backward kernel
    carried beside its accumulator and verified there (``fused:dK_acc``, ``fused:dV_acc``: ``dS^T
    [Q1, Qw, |Q|1]`` times ``scale``, ``P_d^T [dO1, dOw, |dO|1]``, float64), which it returns as
    ``saved["kv_sums"]`` ``(n, L_k, 6)``, as ``fused:out`` judges O's rows: the threshold is the
    kernel check's (the queries summed over, one rounding per query tile), plus ``1.01 u`` of the
    observed magnitude for ``dK``'s multiplication by ``scale`` (its absolute floor times
    ``max(1, scale)``) and the 16-bit rounding's terms. Judged at the same sites as the column
    sums (the worse of the two is reported), they locate a row, and catch what column sums
    cannot: a whole column of ``dK`` scaled, negated or zeroed keeps its sum 0.

A flag in ``check="correct"`` recomputes the whole forward (or backward) and checks again
(:class:`abftgemm.UncorrectableError` if that fails too); ``check="detect"`` reports and warns;
``check="off"`` only calls the fault hook. A backward's sites are judged together: a flag at
either recomputes the backward, whose ``dV`` and ``dK`` are then both checked again. The dQ
rounding to a 16-bit dtype is not checked after the cast (1 rounding, outside the kernels'
checks).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from abftgemm.backend import array_module, astype, to_host
from abftgemm.checksums import smallest_normal, unit_roundoff
from abftgemm.report import Event, UncorrectableError, announce
from abftgemm.threads import pool_kernels
from attention import _cpu_final as F
from attention import _cpu_fused as K
from attention.context import Context
from attention.dropout import keep_scale
from attention.fused import fused_backward, fused_forward, in_work_dtype, work_dtype
from attention.fused_choice import all_finite
from attention.fused_deferred import Deferred
from attention.fused_rules import coefficients, count_checked

#: The final checks' fault-hook and report sites, forward and backward.
OUTPUT_SITE = "fused:out"
GRAD_SITE = "fused:dV_out"
DK_SITE = "fused:dK_out"
#: The backward's final-check sites, in the passes table's order.
GRAD_SITES = (GRAD_SITE, DK_SITE)
FINAL_SITES = (OUTPUT_SITE, *GRAD_SITES)


def verify_output(out: Any, saved: dict[str, Any], ctx: Context) -> tuple[Any, dict[str, Any]]:
    """Check :func:`attention.fused.fused_forward`'s ``out`` against its carried row checksums
    ``saved["sums"]`` (module docstring; fault-hook site ``"fused:out"``). Returns ``(out,
    saved)``, the forward's again after a repair.

    Raises
    ------
    abftgemm.UncorrectableError
        The recomputed output failed the check too.
    """
    array_module(out)  # TypeError for anything but a NumPy or CuPy array

    def redo() -> tuple[Any, dict[str, Any]]:
        visible, add, keys = (_given(saved[name]) for name in ("visible", "add", "keys"))
        p, seed = saved.get("dropout") or (0.0, None)
        return fused_forward(saved["q"], saved["k"], saved["v"], ctx, scale=saved["scale"],
                             causal=saved["causal"], key_visible=visible, attn_mask=add,
                             dropout=p, dropout_seed=seed, key_add=keys)

    return _verified(ctx, [(OUTPUT_SITE, lambda r: r[0], lambda r: _output_ratio(*r))],
                     (out, saved), redo)


def verify_grads(saved: dict[str, Any], d_out: Any, grads: tuple[Any, ...], ctx: Context,
                 sites: tuple[str, ...] = GRAD_SITES) -> tuple[Any, ...]:
    """Check :func:`attention.fused.fused_backward`'s gradients ``(dq, dk, dv)``: ``dv`` by its
    column sums against those of ``d_out`` (fault-hook site ``"fused:dV_out"``), ``dk`` by its
    column sums against 0 (``"fused:dK_out"``), both by their rows against the row checksums
    the backward carried (``saved["kv_sums"]``); module docstring. Returns ``(dq, dk, dv)``,
    the backward's again after a repair.

    Parameters
    ----------
    saved : dict
        :func:`attention.fused.fused_forward`'s, as the backward read it.
    d_out : ndarray
        The gradient of the output the backward took.
    grads : tuple of ndarray
        The backward's ``(dq, dk, dv)``.
    ctx : Context
    sites : tuple of str
        The checks to run, of :data:`GRAD_SITES` (one passes-table step runs one). With
        attention dropout (``saved["dropout"]``) and no carried sums (``saved["sums"]`` None: the
        forward ran unchecked) ``"fused:dV_out"`` has no prediction: nothing judges ``dv``, which
        is still the fault hook's site (module docstring).

    Raises
    ------
    abftgemm.UncorrectableError
        The recomputed gradients failed a check too.
    ValueError
        ``sites`` is empty or names a site outside :data:`GRAD_SITES`.
    """
    xp = array_module(d_out, *grads)  # TypeError unless all NumPy or all CuPy arrays
    checks = [(site, lambda g, i=i: g[i], None if unjudged else (
               lambda g, i=i, columns=columns, rows=rows:
               _grad_judged(xp, saved, g[i], columns, rows)))
              for site, i, columns, rows, unjudged in _grad_checks(saved, d_out, sites)]
    return _verified(ctx, checks, grads, lambda: fused_backward(saved, d_out, ctx))


def defer_output(out: Any, saved: dict[str, Any], ctx: Context, defer: Deferred) -> None:
    """:func:`verify_output` in an attention pass on CuPy data: the fault hook now, the check on
    the device, read at the pass's settle (:mod:`attention.fused_deferred`). A failed check is
    booked there and replays the pass, whose fused core is checked and recomputed as
    :func:`verify_output` does."""
    _hook_and_count(ctx, OUTPUT_SITE, out)
    coef = _output_coefficients(out, saved)
    pred = saved["sums"][..., :3]
    observed = _observed_rows(out)
    defer.add(_rows_failures(observed, pred, coef),
              lambda c: _looked(c, OUTPUT_SITE, _rows_ratio(observed, out.shape[2], pred, coef)))


def defer_grads(saved: dict[str, Any], d_out: Any, grads: tuple[Any, ...], ctx: Context,
                sites: tuple[str, ...], defer: Deferred) -> None:
    """:func:`verify_grads` as :func:`defer_output` does :func:`verify_output`."""
    xp = array_module(d_out, *grads)
    for site, i, columns, rows, unjudged in _grad_checks(saved, d_out, sites):
        g = grads[i]
        if unjudged:  # the fault hook's site all the same (as in verify_grads)
            if ctx.fault_hook is not None:
                ctx.fault_hook(site, g)
            continue
        _hook_and_count(ctx, site, g)
        observed_rows, observed_columns = _observed(g)
        bad = xp.zeros((), bool)
        if columns is not None:
            bad = bad | ~(columns(g, observed_columns)[0] <= 1).all()
        if saved.get("kv_sums") is not None:
            bad = bad | _rows_failures(observed_rows, saved["kv_sums"][..., rows],
                                       _grad_coefficients(g, saved, rows))
        defer.add(bad, lambda c, site=site, g=g, columns=columns, rows=rows:
                  _looked(c, site, _grad_judged(xp, saved, g, columns, rows)))


#: A backward final check's column ratios ``(|d|/tau, |d|, tau)``, each ``(n, d)``, of a gradient
#: and its :func:`_observed` column sums.
_Columns = Callable[[Any, Any], tuple[Any, Any, Any]]


def _grad_checks(saved: dict[str, Any], d_out: Any, sites: tuple[str, ...]
                 ) -> list[tuple[str, int, _Columns | None, slice, bool]]:
    """The backward's final checks of ``sites``: ``(site, index of the gradient it checks, its
    column ratios (None where there is no prediction: dropout without the forward's sums), the
    slice of ``saved["kv_sums"]`` its rows are judged against, whether it has neither part and
    judges nothing)`` (:func:`verify_grads`); a check that judges nothing is still the fault
    hook's site (an unchecked run's faults land where a checked run's do)."""
    unknown = [s for s in sites if s not in GRAD_SITES]
    if unknown or not sites:
        raise ValueError(f"sites must be some of {', '.join(GRAD_SITES)}, got {sites}")
    checks: list[tuple[str, int, _Columns | None, slice]] = []
    if GRAD_SITE in sites:
        columns = saved.get("dropout") is None or saved.get("sums") is not None
        checks.append((GRAD_SITE, 2, (lambda dv, sums: _grad_ratios(saved, d_out, dv, sums))
                       if columns else None, slice(3, 6)))
    if DK_SITE in sites:
        checks.append((DK_SITE, 1, lambda dk, sums: _dk_ratios(saved, d_out, dk, sums),
                       slice(0, 3)))
    rows = saved.get("kv_sums") is not None
    return [(*c, c[2] is None and not rows) for c in checks]


def _grad_judged(xp: Any, saved: dict[str, Any], g: Any, columns: _Columns | None,
                 rows: slice) -> tuple[float, int, tuple, tuple, float, float]:
    """The worse of a gradient's two final checks: its column sums (``columns``), and its rows
    against the row checksums the backward kernel carried beside its accumulator
    (``saved["kv_sums"][..., rows]``, ``dK``'s scaled), which a fault that scales, negates or
    zeroes a whole column of ``dK`` changes though its column sum stays 0."""
    found: tuple[float, int, tuple, tuple, float, float] = (0.0, 0, (), (), 0.0, 0.0)
    observed_rows, observed_columns = _observed(g)
    if columns is not None:
        found = _worst_column(xp, *columns(g, observed_columns))
    sums = saved.get("kv_sums")
    if sums is not None:
        judged = _rows_ratio(observed_rows, g.shape[2], sums[..., rows],
                             _grad_coefficients(g, saved, rows))
        if not judged[0] <= found[0]:
            found = judged
    return found


def _hook_and_count(ctx: Context, site: str, checked: Any) -> None:
    """A deferred final check's start: the fault hook on the array it checks, and one more
    check of ``site`` in the report."""
    if ctx.fault_hook is not None:
        ctx.fault_hook(site, checked)
    count_checked(ctx, (site,))


def _looked(ctx: Context, site: str, judged: tuple[float, int, tuple, tuple, float, float]
            ) -> bool:
    """A deferred final check the device flagged, judged on the host (a pass defers them in
    ``check="correct"`` only): its finding, and the pass's replay to recompute the core, unless
    the host's judgment passes it."""
    if not judged[0] > 1:
        return False
    _finding(ctx, site, *judged[1:], "recomputed", "recomputed in the pass's replay, which "
             f"checks it again (|d|/threshold {judged[0]:.3g} before)")
    return True


def _given(x: Any | None) -> Any | None:
    """A saved mask as the forward takes it again: None where the call had none (the CPU
    kernels' empty stand-in, the CUDA launchers' None)."""
    return None if x is None or x.size == 0 else x


#: One final check: its site, the array it checks of a result, and the judgment of a result,
#: ``(worst |d|/tau, head, rows, cols, |d|, tau)`` (None: the site has no check, its array the
#: fault hook's alone).
_Check = tuple[str, Callable[[Any], Any],
               Callable[[Any], tuple[float, int, tuple, tuple, float, float]] | None]


def _verified(ctx: Context, checks: list[_Check], result: Any, redo: Callable[[], Any]) -> Any:
    """The hook on each check's array, the checks, and the report: ``result``, or ``redo()``'s
    once every check verifies it (a flag at any check recomputes the whole pass)."""
    first: list[tuple[str, Any]] = []  # the first attempt's flags, reported after the second
    for attempt in range(2):
        if ctx.fault_hook is not None:
            for site, checked, _ in checks:
                ctx.fault_hook(site, checked(result))
        judging = [(site, ratio) for site, _, ratio in checks if ratio is not None]
        if ctx.check == "off" or not judging:
            return result
        if attempt == 0:
            count_checked(ctx, tuple(site for site, _ in judging))
        with np.errstate(all="ignore"):  # extremes judged here (an INF bound), not warned of
            judged = [(site, ratio(result)) for site, ratio in judging]
        bad = [(site, r) for site, r in judged if r[0] > 1]
        worst = max(r[0] for _, r in judged)
        if not bad:
            for site, r in first if attempt else ():
                _finding(ctx, site, *r[1:], "recomputed", "recomputed the whole pass and checked "
                         f"it again: |d|/threshold {worst:.3g}")
            return result
        if ctx.check == "detect":
            for site, r in bad:
                _finding(ctx, site, *r[1:], "reported", "left in place (check='detect')")
            return result
        if attempt:
            for site, r in first:
                _finding(ctx, site, *r[1:], "reported", "recomputed the whole pass, "
                         f"which still failed its check: |d|/threshold {worst:.3g}")
            flagged = [checked(result) for site, checked, _ in checks if site in dict(bad)]
            raise UncorrectableError(
                f"{', '.join(s for s, _ in bad)}: the fused core's output still fails its "
                "final check after recomputation" + (
                    "; it holds INF or NaN, which a genuine overflow of "
                    f"{flagged[0].dtype} also gives (the unfused core, core='unfused', passes "
                    "an overflow through as plain math gives it)"
                    if not all(all_finite(x) for x in flagged) else ""), ctx.report)
        first = bad
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


def _output_ratio(out: Any, saved: dict[str, Any]
                  ) -> tuple[float, int, tuple, tuple, float, float]:
    """:func:`_rows_ratio` of the output rows against the checksums the forward carried."""
    return _rows_ratio(_observed_rows(out), out.shape[2], saved["sums"][..., :3],
                       _output_coefficients(out, saved))


def _rows_ratio(observed: Any, d: int, pred: Any, coef: np.ndarray
                ) -> tuple[float, int, tuple, tuple, float, float]:
    """``(worst |d|/tau, head, rows, cols, |d|, tau)`` of the rows of an ``(n, L, d)`` array, its
    :func:`_observed_rows` ``observed``, against the row checksums ``pred`` ``(n, L, 3)`` a kernel
    carried (the worst row, and its column where the weighted sum locates it), judged with
    ``coef`` (:func:`attention._cpu_fused._judge`)."""
    n, length, _ = observed.shape
    info = np.zeros(6)
    info[5] = d
    worst = K._judge(to_host(pred).reshape(n * length, 3),
                     to_host(observed).reshape(n * length, 3), n * length, coef, info)
    v = int(info[3])
    c = int(info[4])
    if v < 0:
        return worst, 0, (), (), info[1], info[2]
    return worst, v // length, (v % length,), ((c,) if c >= 0 else ()), info[1], info[2]


def _output_coefficients(out: Any, saved: dict[str, Any]) -> np.ndarray:
    """The output rows' judging coefficients: ``fused:O_acc``'s (the keys summed over, two
    roundings per key tile), and the rounding to a 16-bit dtype."""
    lk = saved["k"].shape[1]
    _, bc = _tiles(out)
    return _rows_coefficients(out, lk, 2 * -(-lk // bc), min(lk, bc), scaled=False)


def _grad_coefficients(g: Any, saved: dict[str, Any], rows: slice) -> np.ndarray:
    """The judging coefficients of the rows of ``dK`` (``rows`` from 0) or ``dV``:
    ``fused:dK_acc``'s and ``fused:dV_acc``'s (the queries summed over, one rounding per query
    tile), the multiplication of ``dK`` by ``scale``, and the rounding to a 16-bit dtype."""
    lq = saved["q"].shape[1]
    br, _ = _tiles(g)
    scaled = rows.start == 0
    coef = _rows_coefficients(g, lq, -(-lq // br), min(lq, br), scaled)
    if scaled:  # the kernel's absolute floor, scaled with the accumulator
        coef[2] *= max(1.0, float(saved["scale"]))
    return coef


def _rows_coefficients(x: Any, k: int, roundings: int, block: int,
                       scaled: bool) -> np.ndarray:
    """The judging coefficients (:func:`attention._cpu_fused._ratio`) of the rows of a returned
    ``x`` against its kernel's carried row checksums: the kernel's accumulator check's (``k``
    terms summed, ``roundings`` more by the tiling, tile products of inner length ``block``:
    :func:`attention.fused_rules.coefficients`), one rounding more where the kernel scaled
    the accumulator (``scaled``), and the rounding to a 16-bit dtype (subnormals: absolute, ``u
    tiny``)."""
    d = x.shape[2]
    wt = work_dtype(x.dtype)
    coef = coefficients(k, d, wt, roundings, block)
    for u_out in ([unit_roundoff(wt)] if scaled else []) + (
            [unit_roundoff(x.dtype)] if x.dtype != wt else []):
        coef[0] += 1.01 * u_out
        coef[3] *= 1 + 1.01 * u_out
    if x.dtype != wt:
        coef[2] += d * unit_roundoff(x.dtype) * smallest_normal(x.dtype)
    return coef


def _rows_failures(observed: Any, pred: Any, coef: np.ndarray) -> Any:
    """A 0-d bool device array: a row of an array, its :func:`_observed_rows` ``observed``, fails
    its check against ``pred`` (on the device, as :func:`attention._cpu_fused._ratio` judges one
    on the host)."""
    xp = array_module(observed)
    c_obs, c_pred, floor, c_mag, safe = (float(c) for c in coef[:5])
    pred = pred.reshape(-1, 3)
    obs = observed.reshape(-1, 3)
    p0, p1, p2 = (pred[:, i] for i in range(3))
    o0, o1, o2 = (obs[:, i] for i in range(3))
    d = xp.maximum(xp.abs(p0 - o0), xp.abs(p1 - o1))
    holds = (d / (c_obs * o2 + c_pred * p2 + floor) <= 1) & (o2 / (c_mag * p2 + floor) <= 1)
    ok = ~xp.isfinite(pred).all(1) | xp.where(xp.isfinite(obs).all(1), holds, p2 >= safe)
    return ~ok.all()


def _grad_ratios(saved: dict[str, Any], d_out: Any, dv: Any, dv_sums: Any | None = None
                 ) -> tuple[Any, Any, Any]:
    """``(|d|/tau, |d|, tau)``, each ``(n, d)``, of the heads' ``dV`` column sums (float64
    sums of the data as stored; ``dv_sums``, its :func:`_column_sums` over every row, where
    already made); the ratio is also at least ``sum_j |dV_jc|`` over its bound
    (:func:`_magnitude_ratio`)."""
    xp = array_module(dv)
    lse, lo = (saved[name].astype(np.float64) for name in ("lse", "lse_lo"))
    n, lq = lse.shape
    lk = dv.shape[1]
    wt = work_dtype(dv.dtype)
    u = unit_roundoff(wt)
    br, bc = _tiles(dv)
    sees = xp.isfinite(lse)  # a row that sees no key has lse -inf and a zero P row
    tiles = -(-lk // bc)
    eps = 2 * u * (lk + 2 * tiles + xp.abs(xp.where(sees, lo, 0.0)) + math.log(lk)
                   + 8) + 1.01 * u * (lq + 2 * -(-lq // br))
    ks = 1.0
    p, _ = saved.get("dropout") or (0.0, None)
    if p:  # weights r_i, the forward's kept sums (module docstring)
        ks = keep_scale(p) * (1 + u)
        h = 2.01 * u + 1.01 * u * (math.log(lk) + eps)
        w = 1.02 * u * (2.01 * (tiles + 1) + math.log(lk)) + 1.01 * lk * smallest_normal(wt)
        eps = 1.05 * ks * (eps + h + w + 5 * u)
        do_sums = _column_sums(d_out, saved["sums"][..., 3])
    else:
        do_sums = _column_sums(d_out, sees)  # over the rows that see a key
    if dv_sums is None:
        dv_sums = _column_sums(dv, None)
    tau = eps.max(1)[:, None] * do_sums[:, 1]  # the worst row's eps
    tau += lk * smallest_normal(wt)
    u_out, tiny_out = 0.0, 0.0
    if dv.dtype != wt:
        u_out, tiny_out = unit_roundoff(dv.dtype), smallest_normal(dv.dtype)
    # sum_j |dV_jc| <= sum_i |dO_ic| sum_j P_d,ij: the rows of P sum to 1 within eps (of P_d to
    # at most ks (1 + eps))
    bound = do_sums[:, 1] * ks * (1 + eps.max(1)[:, None]) * (1 + 1.01 * u_out) \
        * (1 + lq * unit_roundoff(np.float64)) + lk * (smallest_normal(wt) + u_out * tiny_out)
    tau += lk * u_out * tiny_out + 1.01 * u_out * xp.minimum(dv_sums[:, 1], bound)
    diff = xp.abs(do_sums[:, 0] - dv_sums[:, 0])
    ratio = xp.where(xp.isfinite(diff), diff / tau, xp.inf)
    return xp.maximum(ratio, _magnitude_ratio(xp, dv_sums[:, 1], bound)), diff, tau


def _magnitude_ratio(xp: Any, magnitude: Any, bound: Any) -> Any:
    """``sum_j |x_jc|`` over its bound from the inputs, per head and column (INF where not
    finite): a fault whose values cancel in a column's sum (a pair of opposite near-INF values,
    a column scaled by a flipped exponent bit) shows in its magnitude."""
    return xp.where(xp.isfinite(magnitude), magnitude / bound, xp.inf)


def _dk_ratios(saved: dict[str, Any], d_out: Any, dk: Any, dk_sums: Any
               ) -> tuple[Any, Any, Any]:
    """``(|d|/tau, |d|, tau)``, each ``(n, d)``, of the heads' ``dK`` column sums against 0
    (module docstring; ``dk_sums`` as :func:`dk_column_terms` takes it)."""
    xp = array_module(dk)
    diff, tau, magnitude = dk_column_terms(saved, d_out, dk, dk_sums)
    finite = xp.isfinite(diff)
    ratio = xp.where(finite, xp.where(finite, diff, 0.0) / tau, xp.inf)
    return xp.maximum(ratio, magnitude), diff, tau


def _worst_column(xp: Any, ratio: Any, diff: Any, tau: Any
                  ) -> tuple[float, int, tuple, tuple, float, float]:
    """``(ratio, head, (), (column,), |d|, tau)`` of the first worst of ``(n, d)`` ratios (one
    transfer of the three numbers from a device)."""
    at = int(to_host(xp.argmax(ratio)))
    head, col = divmod(at, ratio.shape[1])
    r, d, t = (float(x) for x in to_host(xp.stack([a.ravel()[at] for a in (ratio, diff, tau)])))
    return r, head, (), (col,), d, t


def dk_column_sums(saved: dict[str, Any], d_out: Any, dk: Any) -> tuple[Any, Any]:
    """``(|1^T dK|, tau)``, each ``(n, d)``: the absolute column sums of each head's ``dk`` over
    the keys (0 in exact arithmetic) and their thresholds (``fused:dK_out``, module docstring),
    float64 sums of the data as stored, NumPy or CuPy arrays as the data.
    :func:`dk_column_terms` adds the magnitude check.

    Parameters
    ----------
    saved : dict
        :func:`attention.fused.fused_forward`'s, as the backward read it.
    d_out : ndarray (n, seq_q, d)
        The output gradient the backward took.
    dk : ndarray (n, seq_k, d)
        The backward's ``dk``.
    """
    return dk_column_terms(saved, d_out, dk)[:2]


def dk_column_terms(saved: dict[str, Any], d_out: Any, dk: Any, dk_sums: Any | None = None
                    ) -> tuple[Any, Any, Any]:
    """:func:`dk_column_sums` and the ratio of each column's ``sum_j |dK_jc|`` to its bound,
    ``scale sum_i |Q_ic| sum_j |dS_ij|`` with the module docstring's bound on ``sum_j |dS_ij|``
    (:func:`_magnitude_ratio`); ``dk_sums``: ``dk``'s :func:`_column_sums` over every row, where
    already made."""
    xp = array_module(dk)
    lse, lo = (saved[name].astype(np.float64) for name in ("lse", "lse_lo"))
    n, lq = lse.shape
    lk, d = dk.shape[1], dk.shape[2]
    wt = work_dtype(dk.dtype)
    u, u64, tiny = unit_roundoff(wt), unit_roundoff(np.float64), smallest_normal(wt)
    u_out, tiny_out = 0.0, 0.0
    if dk.dtype != wt:
        u_out, tiny_out = unit_roundoff(dk.dtype), smallest_normal(dk.dtype)
    br, bc = _tiles(dk)
    tk, tq = -(-lk // bc), -(-lq // br)
    p, _ = saved.get("dropout") or (0.0, None)
    ks = float(wt.type(keep_scale(p)))  # the kernels' factor
    sees = xp.isfinite(lse)  # a row that sees no key has a zero dS row
    eps = xp.where(sees, 2 * u * (lk + 2 * tk + xp.abs(xp.where(sees, lo, 0.0))
                                  + math.log(lk) + 8) + lk * tiny, 0.0)
    w = 1.02 * u * (2.01 * (tk + 1) + math.log(lk)) + 1.01 * lk * tiny  # forward weights' error
    if dk_sums is None:
        dk_sums = _column_sums(dk, None)
    diff = xp.abs(dk_sums[:, 0])
    g, a, s = _dk_rows(d_out, saved["out"], _column_abs_max(saved["v"]))
    g *= ks
    loose = (eps > 0.5).any(1)  # the log-sum-exp's error bound past any use
    c = xp.exp(xp.minimum(eps, 0.5))  # the row's common factor exp(lse* - lse - lo), at most
    h = 2.01 * u + 1.01 * u * (math.log(lk) + eps)
    forward = (2.02 * w + 1.01 * u * (lk + 2 * tk + 1) * (1 + 2.02 * w)) * g \
        + (1.02 * u * (lk + 2 * tk + 1) + 1.01 * u_out) * a + u_out * tiny_out * s
    row = 1.01 * c * ((d + 2) * u * g + (u + d * u64) * a + forward
                      + 1.02 * (h + 2.01 * u) * (g + a) + lk * tiny * (1 + g + a))
    row += 1.01 * u * (lq + 2 * tq) * 1.02 * c * (1 + h) * (g + a)
    floor = lk * (tiny + u_out * tiny_out)  # (u tiny underflows in float64)
    # of sum_j |dK_jc| (sum_j |dS_ij| <= 1.02 c (1 + h)(g + a)), and the rows' part of tau
    bound, spread = _weighted_abs_columns(saved["q"], saved["scale"] * xp.stack(
        [xp.where(sees, 1.02 * c * (1 + h) * (g + a), 0.0), xp.where(sees, row, 0.0)]))
    bound = bound * (1 + 1.01 * u * (lq + 2 * tq)) * (1 + 1.01 * u + 1.01 * u_out) \
        * (1 + lk * u64) + floor
    tau = xp.minimum(dk_sums[:, 1], bound) * (1.01 * u + 1.01 * u_out + lk * u64) + spread
    tau += floor
    tau = xp.where(loose[:, None], xp.inf, tau)  # only non-finite sums are flagged there
    magnitude = xp.where(loose[:, None], 0.0, _magnitude_ratio(xp, dk_sums[:, 1], bound))
    return diff, tau, magnitude


# ---- the reductions: numba kernels (attention._cpu_final) for NumPy, array operations for CuPy,
# float64 sums of the data as stored.

def _tiles(x: Any) -> tuple[int, int]:
    """``(query rows, keys)`` per tile of the kernels that made ``x`` (the tilings' roundings)."""
    if isinstance(x, np.ndarray):
        return K.BR, K.BC
    from attention import _cuda_fused
    return _cuda_fused.BR, _cuda_fused.BC


def _wide(x: Any) -> Any:
    """A CuPy ``x`` in float64 (a copy; bfloat16 widened through its bits)."""
    return astype(x, np.float64)


def _kernels() -> Any:
    """:mod:`attention._cpu_final`'s kernels in numba's pool, or their serial twins
    (:func:`abftgemm.threads.pool_kernels`)."""
    return pool_kernels(F.PARALLEL, F.SERIAL)


def _observed_rows(x: Any) -> Any:
    """``(n, L, 3)``: per row of ``x`` ``(n, L, d)`` its sum, its sum weighted by ``(c + 1) /
    d`` and its sum of magnitudes (:func:`attention._cpu_final.observe_rows`)."""
    if isinstance(x, np.ndarray):
        obs = np.empty((*x.shape[:2], 3))
        _kernels().observe_rows(in_work_dtype(x), obs)
        return obs
    xp, w, d = array_module(x), _wide(x), x.shape[2]
    weights = xp.arange(1, d + 1, dtype=np.float64) / d
    return xp.stack([w.sum(2), (w * weights).sum(2), xp.abs(w).sum(2)], axis=2)


def _observed(x: Any) -> tuple[Any, Any]:
    """``(_observed_rows(x), _column_sums(x, None))`` (:func:`attention._cpu_final.observe`: one
    pass over NumPy data)."""
    if isinstance(x, np.ndarray):
        rows, cols = np.empty((*x.shape[:2], 3)), np.empty((x.shape[0], 2, x.shape[2]))
        _kernels().observe(in_work_dtype(x), rows, cols)
        return rows, cols
    return _observed_rows(x), _column_sums(x, None)


def _column_sums(x: Any, rows: Any | None) -> Any:
    """``(n, 2, d)``: per head and column of ``x`` ``(n, L, d)`` its sum over the rows ``rows``
    ``(n, L)`` marks (None: all) and its sum of magnitudes over all rows
    (:func:`attention._cpu_final.column_sums`)."""
    if isinstance(x, np.ndarray):
        out = np.empty((x.shape[0], 2, x.shape[2]))
        _kernels().column_sums(in_work_dtype(x), F.EVERY_ROW if rows is None else rows, out)
        return out
    xp, w = array_module(x), _wide(x)
    taken = w if rows is None else w * rows[:, :, None]
    return xp.stack([taken.sum(1), xp.abs(w).sum(1)], axis=1)


def _column_abs_max(x: Any) -> Any:
    """``(n, d)``: ``max_r |x_brc|`` (:func:`attention._cpu_final.column_abs_max`)."""
    if isinstance(x, np.ndarray):
        out = np.empty((x.shape[0], x.shape[2]))
        _kernels().column_abs_max(in_work_dtype(x), out)
        return out
    return array_module(x).abs(_wide(x)).max(1)


def _dk_rows(d_out: Any, out: Any, vmax: Any) -> tuple[Any, Any, Any]:
    """``(g, a, s)``, each ``(n, L)``: the row terms of the dK threshold
    (:func:`attention._cpu_final.dk_rows`)."""
    if isinstance(d_out, np.ndarray):
        g, a, s = (np.empty(d_out.shape[:2]) for _ in range(3))
        _kernels().dk_rows(in_work_dtype(d_out), in_work_dtype(out), vmax, g, a, s)
        return g, a, s
    xp, g = array_module(d_out), _wide(d_out)
    mag = xp.abs(g)
    return (mag * vmax[:, None, :]).sum(2), xp.abs(g * _wide(out)).sum(2), mag.sum(2)


def _weighted_abs_columns(x: Any, weights: Any) -> Any:
    """``(m, n, d)``: ``sum_r weights[i, b, r] |x_brc|`` per weighting ``i``, head ``b`` and
    column ``c`` of ``x`` ``(n, L, d)``, ``weights`` ``(m, n, L)``
    (:func:`attention._cpu_final.add_weighted_abs_columns`: one pass over NumPy data)."""
    if isinstance(x, np.ndarray):
        out = np.zeros((weights.shape[0], x.shape[0], x.shape[2]))
        _kernels().add_weighted_abs_columns(in_work_dtype(x), weights, out)
        return out
    magnitude = array_module(x).abs(_wide(x))
    return array_module(x).stack([(w[:, :, None] * magnitude).sum(1) for w in weights])
