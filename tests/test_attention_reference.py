"""Tests of the float64 attention reference (``attention.reference``).

The reference is the oracle for the protected layer, so it is checked against
independent computations: central finite differences for the backward pass and
a naive per-head / per-row loop for the forward pass.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention import reference as ref
from finite_differences import central_differences

#: Central differences of the O(1) loss sum(g * y) (x, g standard normal, unit-scale weights):
#: truncation error eps^2/6 |f'''| ~ 1e-12, cancellation error ~ u64 |L| / eps ~ 1e-16 * 10 /
#: 1e-6 = 1e-9; eps = 1e-6 balances the two near their minimum.
FD_EPS = 1e-6
#: The finite-difference error above (~1e-9) with a 10x margin in absolute terms (ATOL); the
#: cancellation term grows with |L|, so large gradients get 1e-6 relative (RTOL) instead.
RTOL = 1e-6
ATOL = 1e-8

MASK_CASES = ["none", "padding", "causal", "padding+causal"]


# --------------------------------------------------------------------------- helpers


def make_problem(
    batch: int, seq: int, d_model: int, seed: int
) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """Random ``x``, ``params`` and upstream gradient ``g`` (the functional ``L = Σ g*y``)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, seq, d_model))
    params = ref.init_params(d_model, rng)
    g = rng.normal(size=(batch, seq, d_model))
    return x, params, g


def make_mask(case: str, batch: int, seq: int) -> tuple[np.ndarray | None, bool]:
    """Mask and causal flag for a named case; ``padding`` fully masks the last batch row."""
    causal = "causal" in case
    if "padding" not in case:
        return None, causal
    mask = np.ones((batch, seq), dtype=bool)
    mask[0, -1] = False  # a padded key in a normal row
    if batch > 1:
        mask[-1, :] = False  # a fully masked batch row
    return mask, causal


def central_difference(f: Callable[[], float], a: np.ndarray, eps: float = FD_EPS) -> np.ndarray:
    """Central-difference gradient of ``f()`` w.r.t. every entry of ``a`` (perturbed in place)."""
    return central_differences(f, a, list(np.ndindex(a.shape)), eps).reshape(a.shape)


def check_gradients(
    x: np.ndarray,
    params: dict[str, np.ndarray],
    g: np.ndarray,
    n_heads: int,
    mask: np.ndarray | None,
    causal: bool,
) -> None:
    """Assert the analytic dx and every parameter gradient match finite differences."""
    x = x.copy()
    params = {key: value.copy() for key, value in params.items()}

    def loss() -> float:
        y, _ = ref.forward(x, params, n_heads, mask=mask, causal=causal)
        return float(np.sum(g * y))

    _, cache = ref.forward(x, params, n_heads, mask=mask, causal=causal)
    dx, grads = ref.backward(g, cache, params, n_heads)

    assert set(grads) == set(params)
    np.testing.assert_allclose(dx, central_difference(loss, x), rtol=RTOL, atol=ATOL, err_msg="dx")
    for key in ref.PARAM_KEYS:
        assert grads[key].shape == params[key].shape
        assert grads[key].dtype == np.float64
        np.testing.assert_allclose(
            grads[key], central_difference(loss, params[key]), rtol=RTOL, atol=ATOL, err_msg=key
        )


def naive_forward(
    x: np.ndarray,
    params: dict[str, np.ndarray],
    n_heads: int,
    mask: np.ndarray | None,
    causal: bool,
) -> np.ndarray:
    """Loop-per-(batch, head, query) attention written directly from the conventions."""
    batch, seq, d_model = x.shape
    hd = d_model // n_heads
    q = x @ params["wq"] + params["bq"]
    k = x @ params["wk"] + params["bk"]
    v = x @ params["wv"] + params["bv"]
    context = np.zeros((batch, seq, d_model))
    for b in range(batch):
        for h in range(n_heads):
            cols = slice(h * hd, (h + 1) * hd)
            for i in range(seq):
                keys = [
                    j
                    for j in range(seq)
                    if (mask is None or mask[b, j]) and not (causal and j > i)
                ]
                if not keys:
                    continue
                scores = np.array([q[b, i, cols] @ k[b, j, cols] for j in keys]) / np.sqrt(hd)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                for w, j in zip(weights, keys):
                    context[b, i, cols] += w * v[b, j, cols]
    return context @ params["wo"] + params["bo"]


# --------------------------------------------------------------------------- finite differences


@pytest.mark.parametrize("case", MASK_CASES)
def test_backward_matches_finite_differences(case: str) -> None:
    batch, seq, d_model, n_heads = 2, 3, 4, 2
    x, params, g = make_problem(batch, seq, d_model, seed=1)
    mask, causal = make_mask(case, batch, seq)
    check_gradients(x, params, g, n_heads, mask, causal)


@settings(deadline=None)  # examples per the profile: 30 dev, 300 CI
@given(
    batch=st.integers(1, 2),
    seq=st.integers(1, 4),
    n_heads=st.integers(1, 2),
    hd=st.integers(1, 3),
    causal=st.booleans(),
    use_mask=st.booleans(),
    mask_bits=st.lists(st.booleans(), min_size=8, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_backward_matches_finite_differences_property(
    batch: int,
    seq: int,
    n_heads: int,
    hd: int,
    causal: bool,
    use_mask: bool,
    mask_bits: list[bool],
    seed: int,
) -> None:
    d_model = n_heads * hd
    x, params, g = make_problem(batch, seq, d_model, seed)
    mask = np.array(mask_bits[: batch * seq]).reshape(batch, seq) if use_mask else None
    check_gradients(x, params, g, n_heads, mask, causal)


# --------------------------------------------------------------------------- forward oracle


@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("shape", [(2, 3, 4, 2), (1, 5, 6, 3), (3, 1, 2, 1), (2, 4, 6, 1)])
def test_forward_matches_naive_loop(case: str, shape: tuple[int, int, int, int]) -> None:
    batch, seq, d_model, n_heads = shape
    x, params, _ = make_problem(batch, seq, d_model, seed=2)
    mask, causal = make_mask(case, batch, seq)
    y, cache = ref.forward(x, params, n_heads, mask=mask, causal=causal)
    expected = naive_forward(x, params, n_heads, mask, causal)
    # two float64 evaluations of O(1) sums of at most 6 terms, in different orders: they differ
    # by a few u64 = 1e-16 (relative to the O(1) magnitudes); 1e-12 is far above that and far
    # below any mistake in the formula.
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    assert y.dtype == np.float64
    assert cache["p"].shape == (batch, n_heads, seq, seq)
    assert cache["visible"].shape == (batch, 1, seq, seq)
    for key in ("x", "q", "k", "v", "context"):
        assert cache[key].shape == (batch, seq, d_model)


def test_float32_inputs_are_computed_in_float64() -> None:
    x, params, g = make_problem(2, 3, 4, seed=3)
    x32 = x.astype(np.float32)
    params32 = {key: value.astype(np.float32) for key, value in params.items()}
    y, cache = ref.forward(x32, params32, 2)
    dx, grads = ref.backward(g.astype(np.float32), cache, params32, 2)
    assert y.dtype == dx.dtype == cache["p"].dtype == np.float64
    assert all(grad.dtype == np.float64 for grad in grads.values())
    params_up = {key: value.astype(np.float64) for key, value in params32.items()}
    y_up, _ = ref.forward(x32.astype(np.float64), params_up, 2)
    np.testing.assert_array_equal(y, y_up)


def test_probabilities_rows_sum_to_one_or_zero() -> None:
    batch, seq, d_model, n_heads = 2, 4, 4, 2
    x, params, _ = make_problem(batch, seq, d_model, seed=4)
    mask = np.array([[False, True, True, False], [False, False, False, False]])
    _, cache = ref.forward(x, params, n_heads, mask=mask, causal=True)
    p, vis = cache["p"], cache["visible"]
    assert np.all(p[~np.broadcast_to(vis, p.shape)] == 0.0)
    sums = p.sum(axis=-1)
    has_key = np.broadcast_to(vis.any(axis=-1), sums.shape)
    np.testing.assert_allclose(sums[has_key], 1.0, rtol=1e-14)  # 4 terms: <= 4 u64 = 9e-16
    assert np.all(sums[~has_key] == 0.0)
    # query 0 of batch row 0 sees only key 0, which is padded: no visible key
    assert not has_key[0, 0, 0] and has_key[0, 0, 1]


def test_visible() -> None:
    mask = np.array([[True, False, True], [False, False, False]])
    vis = ref.visible(mask, causal=True, batch=2, seq=3)
    assert vis.shape == (2, 1, 3, 3) and vis.dtype == np.bool_
    expected0 = np.array([[1, 0, 0], [1, 0, 0], [1, 0, 1]], dtype=bool)
    np.testing.assert_array_equal(vis[0, 0], expected0)
    assert not vis[1].any()
    assert ref.visible(None, causal=False, batch=1, seq=2).all()
    causal_only = ref.visible(None, True, 1, 3)[0, 0]
    np.testing.assert_array_equal(causal_only, np.tril(np.ones((3, 3), dtype=bool)))


# --------------------------------------------------------------------------- fully masked rows


def test_fully_masked_rows_output_bias_and_get_zero_score_gradient() -> None:
    batch, seq, d_model, n_heads = 2, 3, 4, 2
    x, params, g = make_problem(batch, seq, d_model, seed=5)
    mask = np.array([[False, True, True], [False, False, False]])
    y, cache = ref.forward(x, params, n_heads, mask=mask, causal=True)

    # batch row 1 is fully masked; in row 0 query 0 sees only the padded key 0
    np.testing.assert_array_equal(y[1], np.broadcast_to(params["bo"], (seq, d_model)))
    np.testing.assert_array_equal(y[0, 0], params["bo"])
    assert np.all(cache["p"][1] == 0.0) and np.all(cache["p"][0, :, 0] == 0.0)
    assert np.all(cache["context"][1] == 0.0)

    steps = ref.backward_steps(g, cache, params, n_heads)
    d_s = steps["d_s"]
    assert np.all(d_s[1] == 0.0)
    assert np.all(d_s[0, :, 0] == 0.0)
    assert np.all(d_s[~np.broadcast_to(cache["visible"], d_s.shape)] == 0.0)
    # nothing flows from a fully masked batch row back into Q, K, V or x
    for key in ("d_q", "d_k", "d_v", "dx"):
        assert np.all(steps[key][1] == 0.0), key
    # the gradient is nonetheless correct there (bo still receives it)
    check_gradients(x, params, g, n_heads, mask, causal=True)


def test_split_merge_heads_roundtrip_and_layout() -> None:
    t = np.arange(2 * 3 * 6, dtype=np.float64).reshape(2, 3, 6)
    heads = ref.split_heads(t, 3)
    assert heads.shape == (2, 3, 3, 2)
    np.testing.assert_array_equal(heads[:, 1], t[:, :, 2:4])
    np.testing.assert_array_equal(ref.merge_heads(heads), t)


# --------------------------------------------------------------------------- bad input


def test_bad_input_raises() -> None:
    x, params, _ = make_problem(1, 2, 4, seed=7)
    with pytest.raises(ValueError):
        ref.forward(x, params, 3)  # 3 does not divide 4
    with pytest.raises(ValueError):
        ref.forward(x[0], params, 2)  # not 3-D
    with pytest.raises(ValueError):
        ref.forward(x, params, 2, mask=np.ones((1, 3), dtype=bool))
    with pytest.raises(TypeError):
        ref.forward(x, params, 2, mask=np.ones((1, 2), dtype=np.int64))
    with pytest.raises(KeyError):
        ref.forward(x, {k: v for k, v in params.items() if k != "bo"}, 2)
    with pytest.raises(ValueError):
        ref.forward(x, {**params, "wq": params["wq"][:, :3]}, 2)
