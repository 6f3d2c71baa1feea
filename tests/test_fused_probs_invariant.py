"""The fused CPU core's softmax check (``attention._cpu_fused._probs_ratio``) on one tile:
silent on the kernels' own probabilities (masked keys, entries the exponential flushes to 0,
rows without a visible key), and flagging, with the entry located, every corruption of one
stored probability that changes it by more than the rounding the check allows, entry by
entry."""
from __future__ import annotations

import numpy as np
import pytest

from attention import _cpu_fused as K
from attention.fused_rules import probs_tolerance


def _tile(dtype: type, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scores ``z`` of a masked tile, its row maxima ``m`` and the kernels' ``p = exp(z - m)``:
    a row with no visible key, one with a single visible key, masked keys, and entries far below
    the exponential's flush."""
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((K.BR, K.BC)) * 4).astype(dtype)
    z[rng.random(z.shape) < 0.2] = -np.inf
    z[3, :40] -= 200  # exp flushes these to 0 (float32) or makes them subnormal (float64)
    z[5] = -np.inf
    z[7, 1:] = -np.inf  # a causal first row: one visible key
    m = np.full(K.BR, -np.inf, dtype)
    K._new_max(z, m, np.empty(K.BR, dtype))
    p = np.empty_like(z)
    K._exp_rows(z, m, p)
    return z, m, p


def _ratio(z: np.ndarray, m: np.ndarray, p: np.ndarray) -> tuple[float, np.ndarray]:
    info = np.zeros(6)
    return K._probs_ratio(z, p, m, probs_tolerance(p.dtype), info), info


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clean_tiles_pass(dtype):
    for seed in range(20):
        z, m, p = _tile(dtype, seed)
        ratio, _ = _ratio(z, m, p)
        assert ratio <= 1, (seed, ratio)


def _corruptions(p: np.ndarray, z: np.ndarray, m: np.ndarray, rng: np.random.Generator):
    """(name, row, col, new value) of one stored probability."""
    with np.errstate(invalid="ignore"):  # -inf - -inf in the row without a visible key
        x = z - m[:, None]
    visible = np.argwhere(np.isfinite(z) & (x > -20))
    r, c = visible[rng.integers(len(visible))]
    v = p[r, c]
    yield "relative 1e-3", r, c, v * (1 + 1e-3)
    yield "halved", r, c, v / 2
    yield "sign", r, c, -v
    yield "zero", r, c, 0.0
    yield "tiny", r, c, 1e-30
    yield "nan", r, c, np.nan
    yield "inf", r, c, np.inf
    yield "near-inf", r, c, np.finfo(p.dtype).max / 2
    flushed = np.argwhere(x < -150)
    r2, c2 = flushed[rng.integers(len(flushed))]
    yield "a flushed entry set", r2, c2, 0.25
    masked = np.argwhere(np.isneginf(z) & np.isfinite(m)[:, None])
    r3, c3 = masked[rng.integers(len(masked))]
    yield "a masked entry set", r3, c3, 1e-3
    yield "row without a visible key", 5, int(rng.integers(K.BC)), 1e-3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(4))
def test_one_corrupted_probability_is_flagged_and_located(dtype, seed):
    z, m, p = _tile(dtype, seed)
    for name, r, c, value in _corruptions(p, z, m, np.random.default_rng(seed)):
        bad = p.copy()
        bad[r, c] = value
        ratio, info = _ratio(z, m, bad)
        assert ratio > 1, name
        assert (info[3], info[4]) == (r, c), name


@pytest.mark.parametrize("dtype,bits", [(np.float32, 23), (np.float64, 52)])
@pytest.mark.parametrize("seed", range(4))
def test_exponents_moved_both_ways_in_a_row_are_flagged(dtype, bits, seed):
    """The lowest exponent bit flipped in entries of one row, as many of odd exponent (halved)
    as of even (doubled): their logs change by -log 2 and +log 2 and cancel in the row's sum,
    which the invariant alone judges, so the forward passed wrong probabilities (found by a
    fault campaign of row patterns). Each exponent is also judged against its ``z``: flagged."""
    z, m, p = _tile(dtype, seed)
    rng = np.random.default_rng(seed)
    r = 11
    normal = np.flatnonzero(p[r] > np.finfo(dtype).tiny)
    uint = np.uint32 if dtype == np.float32 else np.uint64
    bit = uint(1) << uint(bits)
    odd = normal[(p[r, normal].view(uint) & bit) != 0]
    even = normal[(p[r, normal].view(uint) & bit) == 0]
    count = min(len(odd), len(even), 6)
    assert count >= 2
    chosen = np.concatenate([rng.choice(odd, count, replace=False),
                             rng.choice(even, count, replace=False)])
    bad = p.copy()
    row = bad[r].view(uint)
    row[chosen] ^= bit
    with np.errstate(divide="ignore"):
        moved = np.log(bad[r, chosen].astype(np.float64)) - np.log(p[r, chosen].astype(np.float64))
    assert abs(moved.sum()) < 1e-9 and np.abs(moved).min() > 0.6  # cancels in the row's sum
    ratio, info = _ratio(z, m, bad)
    assert ratio > 1 and info[3] == r and info[4] in chosen


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(4))
def test_an_entry_is_judged_by_its_own_tolerance(dtype, seed):
    """A relative change of 3 times an entry's tolerance, ``8 u``, is flagged at that entry,
    though it is far below a row's summed tolerance (about ``8 u sum_j |x_j|``, which a check
    of row sums allows: the check before this one); 0.4 times its tolerance passes."""
    z, m, p = _tile(dtype, seed)
    u = np.finfo(dtype).eps / 2
    with np.errstate(invalid="ignore"):
        x = (z - m[:, None]).astype(np.float64)
    rows = [r for r in range(K.BR) if np.isfinite(m[r]) and (np.isfinite(z[r]).sum() > 60)]
    rng = np.random.default_rng(seed)
    r = rows[rng.integers(len(rows))]
    c = int(np.argmin(np.where(np.isfinite(x[r]), np.abs(x[r] + 2), np.inf)))  # x near -2
    tol = 8 * u
    row_tol = 8 * u * np.abs(x[r][np.isfinite(x[r]) & (p[r] > 0)]).sum()
    assert 3 * tol < row_tol / 4
    for factor, flagged in ((3, True), (-3, True), (0.4, False)):
        bad = p.copy()
        bad[r, c] = p[r, c] * (1 + factor * tol)
        ratio, info = _ratio(z, m, bad)
        assert (ratio > 1) == flagged, factor
        if flagged:
            assert (info[3], info[4]) == (r, c)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_nan_entry_reports_an_infinite_difference(dtype):
    """A NaN probability is reported as the kernels report every non-finite observation (the
    CUDA kernels' ``probs_bad``, :func:`attention._cpu_fused._ratio`, this check before the
    entry-wise one): ``|d|`` INF against a finite threshold, not ``|d| = nan`` (the excess of
    a NaN entry is NaN, and so was the magnitude made from it). Also in a row without a
    visible key, and where ``z - m`` itself is NaN (a NaN score left in place by
    ``check='detect'``), whose tolerance was NaN too."""
    z, m, p = _tile(dtype, 0)
    cases = [(11, 3, "p"), (5, 7, "p"), (11, 4, "z")]
    for r, c, what in cases:
        zz, bad = z.copy(), p.copy()
        if what == "p":
            bad[r, c] = np.nan
        else:
            zz[r, c] = np.nan
        ratio, info = _ratio(zz, m, bad)
        assert ratio == np.inf and (info[3], info[4]) == (r, c), (r, c, what)
        assert info[1] == np.inf, (r, c, what, info)
        assert np.isfinite(info[2]) and info[2] >= 0, (r, c, what, info)


def test_a_nan_probability_event_has_an_infinite_magnitude():
    """End to end (the fault hook at ``fused:P``, ``check='detect'``): the event of a NaN
    probability is located at it and reports ``|d|`` INF against a finite threshold."""
    import warnings

    from attention.context import Context
    from attention.fused import fused_forward

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 40, 16)).astype(np.float32) for _ in range(3))

    def hook(site, tile):
        if site == "fused:P":
            tile[9, 5] = np.nan

    ctx = Context(check="detect", fault_hook=hook)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused_forward(q, k, v, ctx)
    events = [e for e in ctx.report.events if e.site == "fused:P"]
    assert len(events) == 1 and events[0].rows == (9,) and events[0].cols == (5,)
    assert events[0].magnitude == np.inf and np.isfinite(events[0].threshold), events[0]


def test_every_float32_argument_is_within_half_the_tolerance():
    """The check makes the exponential again from the same ``x`` the kernels' exponential got,
    so it cannot flag a clean float32 entry if the two agree within its tolerance for every
    float32 ``x``: run on the kernels themselves (``_exp_rows``, then ``_probs_ratio`` at half
    the tolerance), every 97th bit pattern of [-87.4, 88]; ``ABFT_EVERY_FLOAT32=1`` runs all
    2.2e9 of them (about 20 s; they agree within 4.0 u, half of ``8 u``)."""
    import os

    stride = 1 if os.environ.get("ABFT_EVERY_FLOAT32") == "1" else 97
    tol = probs_tolerance(np.float32).copy()
    tol[:2] *= 0.5
    rows, cols = 256, 4096
    m, p, info = np.zeros(rows, np.float32), np.empty((rows, cols), np.float32), np.zeros(6)
    checked = 0
    for sign, top in ((1 << 31, 87.4), (0, 88.0)):
        last = int(np.float32(top).view(np.int32))
        for start in range(0, last + 1, rows * cols * stride):
            patterns = np.arange(start, min(start + rows * cols * stride, last + 1), stride)
            z = np.full(rows * cols, -np.inf, np.float32)
            z[:len(patterns)] = (patterns | sign).astype(np.uint32).view(np.float32)
            z = z.reshape(rows, cols)
            K._exp_rows(z, m, p)
            ratio = K._probs_ratio(z, p, m, tol, info)
            assert ratio == 0, (ratio, z[int(info[3]), int(info[4])])
            checked += len(patterns)
    assert checked > 2.2e9 / stride
