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

Values. Every call's output and gradients are also compared, element by element, with an
independent float64 computation of the same product (:func:`reference_call`: the same inputs as
the kernels take them, the additive mask, key padding, causal mask and the dropout keep
decisions materialized by :func:`attention.dropout_hash.keep_mask`; ``-inf`` in the mask is a
hidden key, a query that sees no key has output and gradients 0). An element is a *wrong value*
when ``|got - ref| > tol``, ``tol`` a first-order rounding bound at the data's dtype
(:func:`reference_call` derives it): with ``u`` the unit roundoff of the work dtype (float32 for
16-bit and float32 data, float64 for float64), ``gamma(n) = n u / (1 - n u)``,

- each masked score ``z_ij = scale q_i.k_j + mask_ij`` may be off by ``E_ij = (d+2) u scale
  |q_i|.|k_j| + u (|z_ij| + 2 |z_ij - max_k z_ik|) + (2T+4) u`` (the dot product, the scale,
  the rounding of the sum with the mask, of ``z - m`` and the rescalings ``alpha`` of the
  online softmax, ``T`` key tiles); the computed ``P`` is then ``softmax(z + delta)``,
  ``|delta| <= E`` relative to the row's largest entry, whose exact interval gives ``dP_ij``
  (no linearization: rows of huge logits stay resolved where the gaps exceed ``E``);
- backward recomputes ``P = exp((z - lse) - lse_lo)`` unnormalized: its log is off by ``E_ij``
  plus the error of the log-sum-exp (the forward's ``z`` errors through it, the sum ``l``; kept
  as two numbers, it is ``m + log l`` to float64's rounding);
- products and accumulations add ``gamma(n) |A||B|`` with ``n`` = the tiled length (a tile of
  at most 128 plus two roundings per tile of 64 and more) for every product
  (``P V``, ``dO V^T``, ``P^T dO``, ``dS K``, ``dS^T Q``), ``dS = P (dP - D)`` its two roundings,
  ``D = rowsum(dO O)`` the output's own bound;
- 16-bit results are rounded to the data's dtype: ``u_out |ref| +`` half its smallest
  subnormal; the float64 reference's own roundings are the same bounds with ``u = 2^-53``
  (they matter for float64 data); every bound is taken twice (the library's convention for
  its thresholds: second-order terms and unmodelled constants), plus the work dtype's smallest
  normal per term for underflow.

The bound is worst case in every term (no statistical shrinking); it is not a catch-all: a wrong
probability normalization, a dropped tile, a wrong keep decision or a lost ``log l`` in a row
changes elements by far more. Where the bound cannot resolve a row's softmax (``sum_j dP_ij >=
1/2``: e.g. a row masked only by float32's lowest number, whose logits are lost in rounding in
float32 and float64 alike) its elements are still compared, with that bound; such rows are counted
("unresolved rows") so the reader knows what the comparison covers.

Exit status 1 when any call had a false positive, raised, produced INF/NaN, or returned a wrong
value.
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
from abftgemm.checksums import unit_roundoff  # noqa: E402
from attention.context import Context  # noqa: E402
from attention.dropout_hash import keep_mask  # noqa: E402
from attention.fused import fused_backward, fused_forward, work_dtype  # noqa: E402
from bench.timing import device_name  # noqa: E402

#: Largest logit of the "near overflow" cases: float32's exp overflows above ~88.72.
NEAR_OVERFLOW = 88.0
#: The kinds of case :func:`adversarial_case` cycles through.
CASES = ("near-overflow", "far-beyond", "flat-rows", "padded", "one-head-masked", "additive-mask",
         "dropout", "plain")
#: The float64 reference's unit roundoff (its own roundings enter every tolerance).
U64 = 2.0 ** -53
#: The values compared per call, in the order :func:`reference_call` returns them.
VALUES = ("out", "dq", "dk", "dv")


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


# --------------------------------------------------------------------------- float64 reference


def _gamma(n: int, u: float) -> float:
    """``gamma(n) = n u / (1 - n u)``: the relative error bound of a sum of ``n`` roundings."""
    return n * u / (1.0 - n * u)


def _tiled(n: int) -> int:
    """The roundings a tiled accumulation over ``n`` terms makes, at most: a tile of at most
    128 (the CPU kernels' ``BC``/``BR``; the CUDA kernels' tiles are not longer), then two per
    tile of 64 or more (the addition of the tile's partial sum, forward also the rescaling by
    ``alpha``), and two more (the final division or scale, the dropout factor)."""
    return min(n, 128) + 2 * -(-n // 64) + 2


def _lse(y: np.ndarray, vis: np.ndarray) -> np.ndarray:
    """Row log-sum-exp of ``y`` over the ``vis`` entries, ``(rows, 1)``; -inf where none."""
    m = np.max(np.where(vis, y, -np.inf), axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    total = np.where(vis, np.exp(np.where(vis, y - m, -np.inf)), 0.0).sum(axis=1, keepdims=True)
    return m + np.log(total)


def _interval(logp: np.ndarray, p: np.ndarray, e: np.ndarray, vis: np.ndarray,
              tiny: float) -> np.ndarray:
    """``max |softmax(z + delta) - P|`` over ``|delta_ij - delta_im| <= e_ij + e_im`` (``m`` the
    row's largest entry, which softmax's shift invariance makes the reference): the exact
    interval ``P_j e^{-e'_j} / sum_k P_k e^{e'_k} <= P~_j <= P_j e^{e'_j} / sum_k P_k e^{-e'_k}``,
    in log space (no overflow for huge ``e``), capped at 1, plus ``tiny`` for underflow."""
    jm = np.argmax(np.where(vis, logp, -np.inf), axis=1)
    rows = np.arange(len(logp))
    ep = e + e[rows, jm][:, None]
    ep[rows, jm] = 0.0
    hi = np.minimum(1.0, np.exp(logp + ep - _lse(logp - ep, vis)))
    lo = np.exp(logp - ep - _lse(logp + ep, vis))
    return np.where(vis, np.maximum(hi - p, p - lo) + tiny, 0.0)


def reference_call(case: Case, dtype: Any
                   ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]:
    """The float64 values of ``case``'s call and their tolerances (module docstring):
    ``({name: (ref, tol)} for name in VALUES, unresolved rows)``, for the fused core (``P``
    recomputed from the saved log-sum-exp, tiled accumulations, float32 for 16-bit data).

    Derivation, per head, rows ``i`` (queries), columns ``j`` (keys), first order except where
    the interval is exact: the scores' error ``E`` (docstring) through the softmax's exact
    interval (:func:`_interval`) gives ``dP``; ``|dO|`` is bounded by ``2 [ (dP K) |V| +
    gamma(n_K) (P K |V| + |O|) ]`` (``K`` the keep factor: ``ks`` or 0), then the output
    rounding. Backward, ``dPB`` the recomputed ``P``'s error, ``AdP = (|dO| |V|^T) K``: ``ddP =
    gamma(d+2) AdP``, ``dD = |dO|.tol_O + gamma(d+2) |dO|.|O|``, ``ddS = dPB |dP - D|
    + (P + dPB)(ddP + dD + 2u (|dP| + |D|))``, then ``tol_dV = 2 [ (dPB K)^T |dO| + gamma(n_Q)
    (P K)^T |dO| ]``, ``tol_dQ = 2 scale [ ddS |K| + gamma(n_K + 1) |dS| |K| ]``, ``tol_dK = 2
    scale [ ddS^T |Q| + gamma(n_Q + 1) |dS|^T |Q| ]``, each plus the output rounding.
    """
    n, lq, d = case.q.shape
    lk = case.k.shape[1]
    dt = np.dtype(dtype)
    work = work_dtype(dt)
    u = unit_roundoff(work)
    us = u + U64
    uo = 0.0 if dt == work else unit_roundoff(dt)
    sub = 0.0 if dt == work else 0.5 * float(ml_dtypes.finfo(dt).smallest_subnormal)
    tiny = float(np.finfo(work).tiny)
    scale = 1.0 / np.sqrt(d)
    q, k, v, do = (x.astype(np.float64) for x in (case.q, case.k, case.v, case.do))
    biggest = max(float(np.abs(x).max()) for x in (q, k, v, do))
    floor = 4.0 * (lq + lk + d) * tiny * (1.0 + biggest)  # underflow in the products' sums
    keep = (keep_mask(case.dropout_seed, case.dropout, (n, lq, lk)) if case.dropout else None)
    ks = 0.0 if case.dropout == 1 else 1.0 / (1.0 - case.dropout)
    tk = -(-lk // 64)

    def acc(m: int, uu: float, extra: int = 0) -> float:
        return _gamma(_tiled(m) + extra, uu) + _gamma(m + 2 + extra, U64)

    g_k = acc(lk, u)
    gb_q, gb_d = acc(lq, u), _gamma(d + 2, u) + _gamma(d + 2, U64)
    gb_k1, gb_q1 = acc(lk, u, 1), acc(lq, u, 1)
    names = {name: (np.zeros(x.shape), np.zeros(x.shape))
             for name, x in zip(VALUES, (case.q, case.q, case.k, case.v))}
    names["dv/keys"] = (np.zeros((n, d)), np.zeros((n, d)))  # a bound on sum_j |dV_j - ref_j|
    unresolved = 0
    with np.errstate(all="ignore"):
        for b in range(n):
            vis = np.ones((lq, lk), bool)
            if case.visible is not None:
                vis &= np.asarray(case.visible[b], bool)[None, :]
            if case.causal:
                vis &= np.tri(lq, lk, dtype=bool)
            add = 0.0
            if case.attn_mask is not None:
                add = case.attn_mask[b if len(case.attn_mask) > 1 else 0].astype(np.float64)
                vis &= add != -np.inf
                add = np.where(vis, add, 0.0)
            a = scale * (np.abs(q[b]) @ np.abs(k[b]).T)
            z = np.where(vis, scale * (q[b] @ k[b].T) + add, -np.inf)
            any_vis = vis.any(axis=1, keepdims=True)
            zmax = np.where(any_vis, np.max(z, axis=1, keepdims=True), 0.0)
            x = z - zmax
            lse0 = np.where(any_vis, _lse(x, vis), 0.0)
            logp = np.where(vis, x - lse0, -np.inf)
            p = np.exp(logp)

            e = np.where(vis, (d + 2) * us * a + us * (np.abs(z) + 2 * np.abs(x))
                         + (2 * tk + 4) * u, 0.0)
            dp = _interval(logp, p, e, vis, tiny)
            unresolved += int((dp.sum(axis=1) >= 0.5).sum())
            kd = 1.0 if keep is None else keep[b] * ks
            pd = p * kd
            absv, absdo = np.abs(v[b]), np.abs(do[b])
            out = pd @ v[b]
            tol = 2 * ((dp * kd) @ absv + g_k * (pd @ absv + np.abs(out)))
            tol_out = tol + uo * (np.abs(out) + tol) + sub + floor
            names["out"][0][b], names["out"][1][b] = out, tol_out
            # The recomputed P = exp((z - lse) - lse_lo): the log-sum-exp as two numbers is
            # m + log l to float64's rounding; l's own error, that of z - lse.
            lam = np.maximum(_lse(logp + e, vis), -_lse(logp - e, vis))
            lam = np.where(any_vis, lam, 0.0)
            eta = g_k + U64 * np.abs(zmax + lse0) + 4 * u
            dpb = np.where(vis, np.exp(logp + e + lam + eta) - p + tiny, 0.0)
            dpr = (do[b] @ v[b].T) * kd
            adp = (absdo @ absv.T) * kd
            dd = (do[b] * out).sum(axis=1, keepdims=True)
            ddd = (absdo * tol_out).sum(axis=1, keepdims=True) \
                + gb_d * (absdo * np.abs(out)).sum(axis=1, keepdims=True)
            ds = p * (dpr - dd)
            dds = dpb * np.abs(dpr - dd) + (p + dpb) * (gb_d * adp + ddd
                                                        + 2 * u * (np.abs(dpr) + np.abs(dd)))
            dds = np.where(vis, np.nan_to_num(dds, nan=np.inf), 0.0)
            abss = np.abs(ds)
            # Sum over the keys of dV's errors: the recomputed P sums to 1 within l's rounding
            # (it is exp(z - m) / l, the forward's exponentials over their own sum), so it moves
            # by at most 2 (1 + gamma) in a row in all, whatever E.
            budget = np.minimum(dpb.sum(axis=1, keepdims=True), 2.0 * (1 + g_k))
            rounding = 2 * gb_q * (np.abs(pd).T @ absdo)
            names["dv/keys"][1][b] = (2 * max(ks if keep is not None else 1.0, 1.0)
                                      * (budget * absdo).sum(axis=0)
                                      + (rounding + uo * np.abs(pd.T @ do[b]) + sub
                                         + floor).sum(axis=0)) * (1 + 4 * lk * U64)
            for name, ref, bound in (
                    ("dv", pd.T @ do[b],
                     2 * ((dpb * kd).T @ absdo + gb_q * (np.abs(pd).T @ absdo))),
                    ("dq", scale * (ds @ k[b]),
                     2 * scale * (dds @ np.abs(k[b]) + gb_k1 * (abss @ np.abs(k[b])))),
                    ("dk", scale * (ds.T @ q[b]),
                     2 * scale * (dds.T @ np.abs(q[b]) + gb_q1 * (abss.T @ np.abs(q[b]))))):
                bound = np.nan_to_num(bound, nan=np.inf)
                names[name][0][b] = ref
                names[name][1][b] = bound + uo * (np.abs(ref) + bound) + sub + floor
    return names, unresolved


def compare(values: dict[str, tuple[np.ndarray, np.ndarray]], got: dict[str, Any]
            ) -> tuple[int, float, list[str]]:
    """Elements of ``got`` (host arrays, by name) off their reference by more than the tolerance:
    ``(count, largest |got - ref| / tol over the elements with a finite positive tol, one line per
    array that holds any)``. A NaN or INF element is wrong. With ``dv``, also its errors summed
    over the keys against ``values["dv/keys"]`` (each (head, channel) sum over bound counts as
    one wrong value): that catches an unnormalized ``P`` in rows the elementwise bound cannot
    resolve."""
    wrong, worst, lines = 0, 0.0, []
    if "dv" in got and "dv/keys" in values:
        total = np.abs(np.asarray(got["dv"]).astype(np.float64) - values["dv"][0]).sum(axis=1)
        bound = values["dv/keys"][1]
        bad = ~(total <= bound)
        if bad.any():
            wrong += int(bad.sum())
            at = np.unravel_index(int(np.argmax(np.where(bad, np.nan_to_num(
                total, nan=np.inf) / np.maximum(bound, 1e-300), -1.0))), bound.shape)
            lines.append(f"dv summed over the keys: {int(bad.sum())} of {bound.size} (head, "
                         f"channel) sums wrong, worst at {tuple(map(int, at))}: sum |diff| "
                         f"{total[at]:.3g} > bound {bound[at]:.3g}")
    for name, x in got.items():
        ref, tol = values[name]
        err = np.abs(np.asarray(x).astype(np.float64) - ref)
        bad = ~(err <= tol)
        with np.errstate(all="ignore"):
            ratio = np.where((tol > 0) & np.isfinite(tol) & np.isfinite(err), err / tol, 0.0)
        worst = max(worst, float(ratio.max()) if ratio.size else 0.0)
        if bad.any():
            count = int(bad.sum())
            wrong += count
            at = np.unravel_index(int(np.argmax(np.where(bad, np.nan_to_num(
                err, nan=np.inf) / np.maximum(tol, 1e-300), -1.0))), ref.shape)
            lines.append(f"{name}: {count} of {ref.size} wrong, worst at {tuple(map(int, at))}: "
                         f"got {float(np.asarray(x)[at]):.6g}, ref {ref[at]:.6g}, "
                         f"|diff| {err[at]:.3g} > tol {tol[at]:.3g}")
    return wrong, worst, lines


@dataclass
class Tally:
    """Counts over the calls run."""

    calls: int = 0
    flagged: int = 0
    raised: int = 0
    nonfinite: int = 0
    #: Calls with any output or gradient element off the reference (:func:`compare`), and those
    #: elements.
    wrong: int = 0
    wrong_elements: int = 0
    #: Calls whose values were compared (``--compare-every``).
    compared: int = 0
    #: The largest ``|got - ref| / tol`` seen.
    worst_ratio: float = 0.0
    #: Rows whose softmax the rounding bound cannot resolve (:func:`reference_call`).
    unresolved: int = 0
    by_case: dict[str, int] = field(default_factory=dict)
    first_flags: list[str] = field(default_factory=list)
    seconds: float = 0.0
    dtype: Any = np.float32

    def _note(self, line: str) -> None:
        if len(self.first_flags) < 30:
            self.first_flags.append(line)

    def run(self, case: Case, label: str, xp: Any = np, values: bool = True) -> None:
        """One clean fwd+bwd of ``case`` on array module ``xp``, counted and (with ``values``)
        its values compared with the float64 reference."""
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
            self._note(f"{label}: raised {exc}")
            grads, out = (), None
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.by_case[case.name] = self.by_case.get(case.name, 0) + 1
        if ctx.report.events:
            self.flagged += 1
            self._note(f"{label}: {ctx.report.summary()}")
        if out is not None and not all(np.isfinite(x.astype(np.float32)).all()
                                       for x in (out, *grads)):
            self.nonfinite += 1
            self._note(f"{label}: INF/NaN in the results")
        if out is None or not values:
            return
        self.compared += 1
        expected, unresolved = reference_call(case, self.dtype)
        self.unresolved += unresolved
        wrong, worst, lines = compare(expected, dict(zip(VALUES, (out, *grads))))
        self.worst_ratio = max(self.worst_ratio, worst)
        if wrong:
            self.wrong += 1
            self.wrong_elements += wrong
            for line in lines:
                self._note(f"{label}: wrong values: {line}")


def _compared(args: argparse.Namespace, call: int) -> bool:
    """Whether call number ``call`` has its values compared (``--compare-every``)."""
    return args.compare_every > 0 and call % args.compare_every == 0


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
    parser.add_argument("--compare-every", type=int, default=1,
                        help="compare the values of every N-th call with the float64 reference "
                             "(0: none; the reference dominates the time at long lengths)")
    parser.add_argument("--minutes", type=float, default=0.0,
                        help="stop calling after this long, random-length and long calls alike "
                             "(0: no limit); what ran is reported")
    args = parser.parse_args(argv)
    if min(args.calls, args.long_calls, args.compare_every) < 0 \
            or min(args.max_len, args.long_len) < 1:
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
    """The calls :func:`main` was asked for, on array module ``xp``; 1 when any flagged, raised,
    returned INF/NaN or a wrong value."""
    rng = np.random.default_rng(args.seed)
    dtype = np.dtype(ml_dtypes.bfloat16 if args.dtype == "bfloat16" else args.dtype)
    fused_forward(*(xp.ones((1, 8, 16), dtype) for _ in range(3)), Context())  # compile
    short, long = Tally(dtype=dtype), Tally(dtype=dtype)
    deadline = time.monotonic() + 60 * args.minutes if args.minutes > 0 else None
    for call in range(args.calls):
        if deadline is not None and time.monotonic() > deadline:
            break
        case = adversarial_case(rng, call, args.max_len, dtype)
        short.run(case, f"call {call} ({case.name}, {_shape(case)})", xp, _compared(args, call))
    for call in range(args.long_calls):
        if deadline is not None and time.monotonic() > deadline:
            break
        case = adversarial_case(rng, call, args.long_len, dtype, length=args.long_len)
        long.run(case, f"long call {call} ({case.name}, {_shape(case)})", xp,
                 _compared(args, call))
        print(f"long call {call}: {case.name}, {_shape(case)}, {long.seconds:.0f} s so far, "
              f"{long.flagged} flagged, {long.raised} raised, {long.nonfinite} with INF/NaN, "
              f"{long.wrong} with wrong values", flush=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{datetime.date.today()}, {device_name(xp)}, load average {load}; "
          f"backend {args.backend}, dtype {dtype.name}, seed {args.seed}")
    for label, t, size in (("random lengths", short, f"1..{args.max_len}"),
                           ("long", long, str(args.long_len))):
        cases = ", ".join(f"{k} {v}" for k, v in sorted(t.by_case.items()))
        print(f"{label} (L {size}): {t.calls} clean fwd+bwd calls in {t.seconds:.0f} s: "
              f"{t.flagged} flagged (false positives), {t.raised} raised, {t.nonfinite} with "
              f"INF/NaN, {t.wrong} with wrong values [{cases}]")
        print(f"  values of {t.compared} calls: {t.wrong_elements} wrong elements, largest "
              f"|diff|/tol {t.worst_ratio:.3g}, {t.unresolved} unresolved rows")
    for line in short.first_flags + long.first_flags:
        print("  " + line)
    bad = sum(t.flagged + t.raised + t.nonfinite + t.wrong for t in (short, long))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
