"""The fused CPU core's ``dS`` check (``attention._cpu_fused._dscores_ratio``) on one tile:
silent on the kernels' own ``dS = P (dP - D)`` (with and without dropout, with subnormal
products), and flagging, with the entry located, every corruption of one stored entry larger
than the rounding the check allows (``8 u`` of ``|P dP| + |P D|``)."""
from __future__ import annotations

import numpy as np
import pytest

from attention import _cpu_fused as K
from attention.fused_rules import dscores_entry_tolerance

NO_KEEP = np.empty((0, 0), np.uint8)


def _tile(dtype: type, seed: int, dropout: bool) -> tuple:
    """``(p, dp, dd, keep, ks, ds)`` of one tile: probabilities of a masked softmax row block
    (zeros and subnormal entries among them), ``dP``, ``D = rowsum(P dP)``, the keep tile (or
    an empty one) and the kernels' ``dS``."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((K.BR, K.BC)) * 3
    z[rng.random(z.shape) < 0.2] = -np.inf
    p = np.exp(z - z.max(axis=1, keepdims=True)).astype(dtype)
    p[2, :10] = np.finfo(dtype).smallest_subnormal * 3
    dp = (rng.standard_normal(p.shape) * 2).astype(dtype)
    dd = (p * dp).sum(axis=1).astype(dtype)
    keep = (rng.random(p.shape) < 0.8).astype(np.uint8) if dropout else NO_KEEP
    ks = dtype(1 / 0.8) if dropout else dtype(1)
    ds = np.empty_like(p)
    K._dscores(p, dp, dd, keep, ks, ds)
    return p, dp, dd, keep, ks, ds


def _ratio(ds, p, dp, dd, keep, ks) -> tuple[float, np.ndarray]:
    info = np.zeros(6)
    return K._dscores_ratio(ds, p, dp, dd, keep, ks, dscores_entry_tolerance(ds.dtype),
                            info), info


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dropout", [False, True])
def test_clean_tiles_pass(dtype, dropout):
    for seed in range(10):
        p, dp, dd, keep, ks, ds = _tile(dtype, seed, dropout)
        ratio, _ = _ratio(ds, p, dp, dd, keep, ks)
        assert ratio == 0, seed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_one_corrupted_entry_is_flagged_and_located(dtype, dropout, seed):
    """Corruptions of one stored ``dS`` entry: gross ones, and a relative change of 3 times
    the entry's tolerance where ``dS`` is its full magnitude (``dP`` and ``D`` of opposite
    signs); 0.4 times it passes. A check of row sums (the check before this one) passed the
    small ones."""
    p, dp, dd, keep, ks, ds = _tile(dtype, seed, dropout)
    u = np.finfo(dtype).eps / 2
    g = np.where(keep == 1, dp * ks, 0).astype(dtype) if dropout else dp
    full = (p > 0.05) & (np.sign(g) == -np.sign(dd)[:, None]) & (np.abs(g) > 0.5)
    cand = np.argwhere(full)
    r, c = cand[np.random.default_rng(seed).integers(len(cand))]
    v = ds[r, c]
    for name, value, flagged in (("sign", -v, True), ("zero", 0.0, True), ("nan", np.nan, True),
                                 ("inf", np.inf, True), ("doubled", 2 * v, True),
                                 ("3 tolerances", v * (1 + 3 * 8 * u), True),
                                 ("-3 tolerances", v * (1 - 3 * 8 * u), True),
                                 ("0.4 tolerance", v * (1 + 0.4 * 8 * u), False)):
        bad = ds.copy()
        bad[r, c] = value
        ratio, info = _ratio(bad, p, dp, dd, keep, ks)
        assert (ratio > 1) == flagged, name
        if flagged:
            assert (info[3], info[4]) == (r, c), name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_nan_entry_reports_an_infinite_difference(dtype):
    """A NaN ``dS`` entry is flagged, located, and reported as the kernels report every
    non-finite observation (:func:`attention._cpu_fused._ratio`): ``|d|`` INF against its
    finite threshold, not ``|d| = nan``."""
    p, dp, dd, keep, ks, ds = _tile(dtype, 0, False)
    bad = ds.copy()
    bad[4, 9] = np.nan
    ratio, info = _ratio(bad, p, dp, dd, keep, ks)
    assert ratio == np.inf and (info[3], info[4]) == (4, 9)
    assert info[1] == np.inf and np.isfinite(info[2]) and info[2] > 0, info


def test_products_that_overflow_where_ds_does_not_pass():
    """``P`` a little above 1 (the backward's ``exp(z - lse)`` at a row's max, ``lse`` rounded
    down) with ``dP`` and ``D`` near float32's largest number, of one sign: ``dS = P (dP - D)``
    is finite and right, but the check's ``P dP`` and ``P D`` overflow (INF - INF is NaN),
    which flagged the clean entry. The flagged tile is judged again in float64, which holds;
    a corrupted entry beside it is still flagged and located."""
    p, dp, dd, _, _, _ = _tile(np.float32, 0, False)
    big = np.finfo(np.float32).max
    p[4, :] = 0
    p[4, 7] = np.float32(1.0000001)
    dp[4, :] = big
    dp[4, 7] = np.nextafter(big, np.float32(0))
    dd[4] = big
    ds = np.empty_like(p)
    K._dscores(p, dp, dd, NO_KEEP, np.float32(1), ds)
    assert np.isfinite(ds[4]).all()
    assert _ratio(ds, p, dp, dd, NO_KEEP, np.float32(1))[0] == 0
    ds[9, 3] = ds[9, 3] * 2 + 1
    ratio, info = _ratio(ds, p, dp, dd, NO_KEEP, np.float32(1))
    assert ratio > 1 and (info[3], info[4]) == (9, 3)
