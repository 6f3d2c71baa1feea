"""The backends' reduction primitives against a float64 NumPy reference (abftgemm.backend).

The kernels step through rows in groups (eight rows per column-sum update, four per row-sum step,
64-row cache blocks on the CPU; warps and row chunks on the GPU), so the shapes here run past
every group size with remainders, with default and explicit coefficients, broadcast batches and
non-finite elements. One body per property, run on every backend present.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from abftgemm.backend import get_backend, to_host
from abftgemm.checksums import location_weights
from conftest import BACKENDS

#: Row and column counts around the kernels' step and block sizes (1, 4, 8, 64, 256, 2 x 256).
SIDES = st.sampled_from([1, 3, 4, 7, 8, 9, 31, 63, 64, 65, 130, 257, 520])


def reference(x: np.ndarray, coef: np.ndarray | None, along_rows: bool, batch: int = 1) -> np.ndarray:
    """``(batch, vectors, 5)``: the five fields of every row (or column) of ``x``, in float64
    (``batch`` at least the given one: a batch-1 ``x`` broadcasts)."""
    x = x.astype(np.float64)
    if not along_rows:
        x = x.transpose(0, 2, 1)
    length = x.shape[2]
    if coef is None:
        coef = np.stack([np.ones(length), location_weights(length), np.ones(length)], -1)[None]
    batch = max(batch, x.shape[0], coef.shape[0])
    x = np.broadcast_to(x, (batch,) + x.shape[1:])
    coef = np.broadcast_to(coef, (batch,) + coef.shape[1:])
    bad = ~np.isfinite(x)
    last = np.where(bad.any(-1), length - 1 - np.argmax(bad[..., ::-1], -1), -1)
    with np.errstate(invalid="ignore", over="ignore"):
        fields = [np.einsum("bvl,bl->bv", x, coef[..., 0]),
                  np.einsum("bvl,bl->bv", x, coef[..., 1]),
                  np.einsum("bvl,bl->bv", np.abs(x), coef[..., 2])]
    return np.stack(fields + [bad.sum(-1), last], -1)


def assert_fields_match(got: np.ndarray, want: np.ndarray, x: np.ndarray, coef: np.ndarray | None,
                        along_rows: bool) -> None:
    """Counts and last indices exact; finite sums equal up to float64 rounding of any order."""
    np.testing.assert_array_equal(got[..., 3:], want[..., 3:])
    finite = want[..., 3] == 0
    length = x.shape[2] if along_rows else x.shape[1]
    magnitude = np.abs(coef) if coef is not None else None
    for f in range(3):
        # sum of |c_f| |x| over each vector: field 2 of the reference with |c_f| as its weights
        weights = None if magnitude is None else np.repeat(magnitude[..., f:f + 1], 3, -1)
        scale = reference(np.abs(x), weights, along_rows, got.shape[0])[..., 2]
        tol = 4 * (length + 1) * 2.0**-53 * scale + 1e-300
        with np.errstate(invalid="ignore"):
            err = np.abs(got[..., f] - want[..., f])
        assert (err[finite] <= tol[finite]).all(), (f, err[finite].max(), tol[finite].max())


@st.composite
def cases(draw):
    """``(x, coef_batch)`` with float32 or float64 ``x`` of batch 1 or 3 and a coefficient batch
    of 0 (defaults), 1 or 3."""
    rows, cols = draw(SIDES), draw(SIDES)
    x_batch, coef_batch = draw(st.sampled_from([(1, 0), (3, 0), (1, 3), (3, 1), (3, 3)]))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**16))
    x = np.random.default_rng(seed).standard_normal((x_batch, rows, cols)).astype(dtype)
    return x, coef_batch, seed


def _encoding(xp, coef: np.ndarray | None):
    """Coefficients ``(batch, L, 3)`` as the backends take them: an encoding ``(3, batch, L)``."""
    return None if coef is None else xp.asarray(np.ascontiguousarray(coef.transpose(2, 0, 1)))


def _coef(batch: int, length: int, seed: int) -> np.ndarray | None:
    if batch == 0:
        return None
    return np.random.default_rng(seed + 1).standard_normal((batch, length, 3))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("along_rows", [True, False], ids=["rows", "cols"])
@given(case=cases())
def test_row_and_column_reductions_match_reference(xp, along_rows, case):
    x, coef_batch, seed = case
    length = x.shape[2] if along_rows else x.shape[1]
    vectors = x.shape[1] if along_rows else x.shape[2]
    coef = _coef(coef_batch, length, seed)
    batch = max(x.shape[0], coef_batch)
    out = xp.full((batch, vectors, 5), np.nan)
    be = get_backend(xp)
    reduce = be.row_reduce if along_rows else be.col_reduce
    reduce(xp.asarray(x), _encoding(xp, coef), out)
    assert_fields_match(to_host(out), reference(x, coef, along_rows), x, coef, along_rows)


@pytest.mark.parametrize("xp", BACKENDS)
@given(case=cases(), row_coef=st.booleans())
def test_both_directions_in_one_pass_match_reference(xp, case, row_coef):
    x, coef_batch, seed = case
    ccoef = _coef(coef_batch, x.shape[1], seed)
    rcoef = _coef(max(coef_batch, 1), x.shape[2], seed + 7) if row_coef else None
    batch = max(x.shape[0], coef_batch, 0 if rcoef is None else rcoef.shape[0])
    out_col = xp.full((batch, x.shape[2], 5), np.nan)
    out_row = xp.full((batch, x.shape[1], 5), np.nan)
    get_backend(xp).both_reduce(xp.asarray(x), _encoding(xp, ccoef), _encoding(xp, rcoef),
                                out_col, out_row)
    assert_fields_match(to_host(out_col), reference(x, ccoef, False, batch), x, ccoef, False)
    assert_fields_match(to_host(out_row), reference(x, rcoef, True, batch), x, rcoef, True)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
def test_nonfinite_elements_are_counted_with_their_last_index(xp, bad):
    x = np.random.default_rng(0).standard_normal((2, 70, 67))
    x[0, 5, 9] = x[0, 5, 60] = x[1, 69, 66] = bad
    out_col, out_row = xp.empty((2, 67, 5)), xp.empty((2, 70, 5))
    get_backend(xp).both_reduce(xp.asarray(x), None, None, out_col, out_row)
    assert_fields_match(to_host(out_col), reference(x, None, False), x, None, False)
    assert_fields_match(to_host(out_row), reference(x, None, True), x, None, True)
    assert to_host(out_row)[0, 5, 3:].tolist() == [2, 60]


@pytest.mark.parametrize("xp", BACKENDS)
def test_location_weighted_sum_of_near_inf_float64_stays_finite(xp):
    """One error near the float64 maximum per row: the weighted sum must stay finite, or the
    error cannot be located (the weights are normalized to (0, 1] for this)."""
    x = np.ones((1, 16, 40))
    x[0, :, 33] = 1.7e308
    out_col, out_row = xp.empty((1, 40, 5)), xp.empty((1, 16, 5))
    get_backend(xp).both_reduce(xp.asarray(x), None, None, out_col, out_row)
    rows = to_host(out_row)[0]
    assert np.isfinite(rows[:, :3]).all(), rows[:3]
    np.testing.assert_allclose(rows[:, 1] / rows[:, 0] * 40 - 1, 33, atol=1e-6)


@pytest.mark.parametrize("xp", BACKENDS)
def test_flag_matches_reference(xp):
    """``flag``: threshold, verifiability (finite prediction) and disagreement per vector, and the
    two counts, including non-finite predictions and observations."""
    rng = np.random.default_rng(0)
    pred = rng.standard_normal((2, 500, 5))
    obs = pred + rng.standard_normal((2, 500, 5)) * 1e-3
    pred[..., 2], obs[..., 2], obs[..., 3] = np.abs(pred[..., 2]) * 10, np.abs(obs[..., 2]) * 10, 0
    obs[0, 5, 0] += 100        # plain checksum off
    obs[0, 6, 1] += 100        # weighted checksum off
    pred[0, 7, 1] = np.nan     # unverifiable
    obs[1, 9, 2] = np.inf      # observed |C| sum overflowed
    obs[1, 11, 3] = 1          # a non-finite element
    pred[1, 13, 0] = np.inf    # unverifiable
    obs[1, 15, 0] = np.nan     # observed sum NaN
    obs[1, 17, 2] = pred[1, 17, 2] * 1.5 + 1e-6  # sum |C| above its bound: a magnitude fault
    coefficients = (0.01, 0.02, 1e-9, 1.25)
    counts = xp.zeros(2, dtype=np.int64)
    tau, bad, verifiable = get_backend(xp).flag(xp.asarray(pred), xp.asarray(obs), coefficients,
                                                np.inf, counts)  # nothing may overflow
    want_tau = 0.01 * obs[..., 2] + 0.02 * pred[..., 2] + 1e-9
    ok = np.isfinite(pred[..., :3]).all(-1)
    with np.errstate(invalid="ignore"):
        within = ((np.abs(pred[..., 0] - obs[..., 0]) <= want_tau)
                  & (np.abs(pred[..., 1] - obs[..., 1]) <= want_tau)
                  & np.isfinite(obs[..., 2]) & (obs[..., 3] == 0)
                  & (obs[..., 2] <= 1.25 * pred[..., 2] + 1e-9))
    np.testing.assert_allclose(to_host(tau), want_tau, rtol=1e-15)
    np.testing.assert_array_equal(to_host(verifiable), ok)
    np.testing.assert_array_equal(to_host(bad), ok & ~within)
    assert to_host(counts).tolist() == [int((ok & ~within).sum()), int((~ok).sum())]
    assert {(0, 5), (0, 6), (1, 9), (1, 11), (1, 15), (1, 17)} <= set(zip(*to_host(bad).nonzero()))
