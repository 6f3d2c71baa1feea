"""Tests of the seeded fault injectors in :mod:`abftgemm.faults` (NumPy arrays)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abftgemm.faults import (
    KINDS,
    PATTERNS,
    Fault,
    Recorder,
    bit_layout,
    bit_name,
    chain,
    near_inf_value,
)

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(UINT[x.dtype.itemsize])


def _matrix(shape, dtype, seed=0) -> np.ndarray:
    """Finite values in [1, 2) with random signs, so every fault kind changes every value."""
    rng = np.random.default_rng(seed)
    values = (1.0 + rng.random(shape)) * rng.choice([-1.0, 1.0], shape)
    return np.ascontiguousarray(values.astype(dtype))


def _expected_cells(pattern, row, col, m, n, tile=(4, 4)):
    if pattern == "element":
        return {(row, col)}
    if pattern == "row":
        return {(row, k) for k in range(n)}
    if pattern == "column":
        return {(r, col) for r in range(m)}
    if pattern == "tile":
        return {(r, k) for r in range(row, min(row + tile[0], m))
                for k in range(col, min(col + tile[1], n))}
    start = col - col % 32
    return {(row, k) for k in range(start, min(start + 32, n))}


def _changed_cells(before: np.ndarray, after: np.ndarray) -> set[tuple[int, ...]]:
    return {tuple(int(i) for i in idx) for idx in np.argwhere(_bits(before) != _bits(after))}


@settings(deadline=None, max_examples=300)
@given(
    kind=st.sampled_from(KINDS),
    pattern=st.sampled_from(PATTERNS),
    dtype=st.sampled_from(DTYPES),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 70)),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_kind_and_pattern_touches_exactly_its_region(kind, pattern, dtype, shape, seed):
    c = _matrix(shape, dtype, seed)
    before = c.copy()
    fault = Fault(kind, pattern, seed, magnitude=4.0, factor=-8.0)
    fault("site", c)
    (rec,) = fault.injected
    b, r0, c0 = rec.batch[0], rec.rows[0], rec.cols[0]
    cells = _expected_cells(pattern, r0, c0 - c0 % 32 if pattern == "warp" else c0, *shape[1:])
    assert set(zip(rec.rows, rec.cols)) == cells
    assert _changed_cells(before, c) == {(b, r, k) for r, k in cells}
    assert all(rec.changed)
    assert rec.old == before[b, rec.rows, rec.cols].astype(np.float64).tolist()
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(rec.new, c[b, rec.rows, rec.cols].astype(np.float64))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_explicit_position(pattern):
    shape = (2, 3, 40, 70)
    c = _matrix(shape, np.float32)
    before = c.copy()
    Fault("nan", pattern, batch=(1, 2), row=5, col=37)("s", c)
    cells = _expected_cells(pattern, 5, 37, 40, 70)
    assert _changed_cells(before, c) == {(1, 2, r, k) for r, k in cells}
    assert np.isnan(c[1, 2][tuple(np.array(sorted(cells)).T)]).all()


def test_warp_is_aligned_and_clipped():
    c = _matrix((1, 2, 70), np.float32)
    fault = Fault("inf", "warp", row=1, col=69)
    fault("s", c)
    assert fault.injected[0].cols == list(range(64, 70))
    assert fault.injected[0].rows == [1] * 6


def test_tile_size_and_clipping():
    c = _matrix((10, 10), np.float64)
    fault = Fault("-inf", "tile", row=8, col=3, tile=(3, 5))
    fault("s", c)
    assert set(zip(fault.injected[0].rows, fault.injected[0].cols)) == {
        (r, k) for r in (8, 9) for k in range(3, 8)
    }
    assert np.isneginf(c[8:10, 3:8]).all()


def test_flat_batch_index():
    c = _matrix((2, 3, 5, 7), np.float32)
    before = c.copy()
    fault = Fault("inf", "element", batch=4, row=1, col=2)
    fault("s", c)
    assert fault.injected[0].batch == (1, 1)
    assert _changed_cells(before, c) == {(1, 1, 1, 2)}


def test_two_dimensional_matrix_has_empty_batch():
    c = _matrix((5, 7), np.float32)
    fault = Fault("inf", "row", seed=1)
    fault("s", c)
    assert fault.injected[0].batch == ()
    assert np.isinf(c[fault.injected[0].rows[0]]).all()


@settings(deadline=None)  # examples: the profile's (300 in CI)
@given(dtype=st.sampled_from(DTYPES), data=st.data())
def test_bitflip_flips_exactly_the_bit(dtype, data):
    width = 8 * np.dtype(dtype).itemsize
    bit = data.draw(st.integers(0, width - 1))
    c = _matrix((4, 6), dtype, data.draw(st.integers(0, 1000)))
    before = c.copy()
    fault = Fault("bitflip", "element", bit=bit, row=2, col=3)
    fault("s", c)
    xor = _bits(before) ^ _bits(c)
    assert xor[2, 3] == 1 << bit
    xor[2, 3] = 0
    assert not xor.any()
    assert fault.injected[0].bits == (bit,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_bitflip_uses_same_bit_everywhere(dtype, pattern):
    c = _matrix((3, 20, 40), dtype)
    before = c.copy()
    fault = Fault("bitflip", pattern, seed=7)
    fault("s", c)
    (bit,) = fault.injected[0].bits
    xor = _bits(before) ^ _bits(c)
    assert set(np.unique(xor).tolist()) == {0, 1 << bit}


@pytest.mark.parametrize("dtype", DTYPES)
def test_multibit_flips_distinct_bits(dtype):
    c = _matrix((6, 6), dtype)
    before = c.copy()
    fault = Fault("multibit", "element", seed=11, row=0, col=0)
    fault("s", c)
    bits = fault.injected[0].bits
    assert 2 <= len(bits) <= 4 and len(set(bits)) == len(bits)
    assert int(_bits(before)[0, 0] ^ _bits(c)[0, 0]) == sum(1 << b for b in bits)


def test_multibit_explicit_bits_and_count():
    c = _matrix((3, 3), np.float32)
    before = c.copy()
    Fault("multibit", "element", bits=(0, 5, 31), row=1, col=1)("s", c)
    assert int(_bits(before)[1, 1] ^ _bits(c)[1, 1]) == 1 | 1 << 5 | 1 << 31
    fault = Fault("multibit", "element", nbits=6)
    fault("s", c)
    assert len(set(fault.injected[0].bits)) == 6


@pytest.mark.parametrize("dtype", DTYPES)
def test_high_exponent_bit_of_one_gives_inf_or_nan(dtype):
    mantissa, exponent = bit_layout(dtype)
    c = np.ones((2, 2), dtype)
    Fault("bitflip", "element", bit=mantissa + exponent - 1, row=0, col=0)("s", c)
    assert not np.isfinite(c[0, 0].astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_near_inf_keeps_sign_and_is_finite(dtype):
    c = _matrix((8, 8), dtype, seed=3)
    signs = np.signbit(c.astype(np.float64))
    Fault("near-inf", "tile", row=0, col=0, tile=(8, 8))("s", c)
    wide = c.astype(np.float64)
    assert np.isfinite(wide).all()
    assert (np.signbit(wide) == signs).all()
    expected = min(1e10, 0.5 * float(ml_dtypes.finfo(dtype).max))
    np.testing.assert_allclose(np.abs(wide), expected, rtol=1e-2)
    assert near_inf_value(dtype) == expected


def test_additive_and_scale_values():
    c = np.full((2, 3), 3.0, np.float32)
    Fault("additive", "row", row=0, magnitude=0.5)("s", c)
    Fault("scale", "row", row=1, factor=-2.0)("s", c)
    np.testing.assert_array_equal(c, [[3.5, 3.5, 3.5], [-6.0, -6.0, -6.0]])


def test_tiny_additive_is_recorded_as_unchanged():
    c = np.full((2, 2), 1e30, np.float32)
    fault = Fault("additive", "element", magnitude=1e-3)
    fault("s", c)
    rec = fault.injected[0]
    assert rec.old == rec.new and rec.changed == [False]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_seed_is_reproducible(kind, pattern):
    shape = (2, 3, 9, 40)
    a, b = _matrix(shape, np.float16), _matrix(shape, np.float16)
    fa, fb = Fault(kind, pattern, seed=42, times=3), Fault(kind, pattern, seed=42, times=3)
    for _ in range(3):
        fa("s", a)
        fb("s", b)
    np.testing.assert_array_equal(_bits(a), _bits(b))
    assert [(r.batch, r.rows, r.cols, r.bits) for r in fa.injected] == [
        (r.batch, r.rows, r.cols, r.bits) for r in fb.injected
    ]


def test_different_seeds_differ():
    positions = set()
    for seed in range(10):
        fault = Fault("inf", "element", seed=seed)
        fault("s", np.zeros((4, 50, 50), np.float32))
        rec = fault.injected[0]
        positions.add((rec.batch, rec.rows[0], rec.cols[0]))
    assert len(positions) > 1


@pytest.mark.parametrize("sites", ["scores", ["scores", "dq"], frozenset({"scores", "dq"})])
def test_sites_filter(sites):
    fault = Fault("nan", "element", sites=sites, times=None)
    for site in ["q_proj", "scores", "context", "dq"]:
        c = np.ones((3, 3), np.float32)
        fault(site, c)
        assert np.isnan(c).any() == (site in fault.sites)
    assert [r.site for r in fault.injected] == [s for s in ["scores", "dq"] if s in fault.sites]


@pytest.mark.parametrize("times", [0, 1, 2])
def test_times_limits_injections(times):
    fault = Fault("inf", "element", times=times)
    hits = 0
    for _ in range(4):
        c = np.ones((3, 3), np.float32)
        fault("s", c)
        hits += bool(np.isinf(c).any())
    assert hits == len(fault.injected) == times


def test_times_counts_only_matching_sites():
    fault = Fault("inf", "element", sites="dq", times=1)
    fault("q_proj", np.ones((2, 2), np.float32))
    c = np.ones((2, 2), np.float32)
    fault("dq", c)
    assert np.isinf(c).any() and len(fault.injected) == 1


@pytest.mark.parametrize("skip", [0, 2, 5])
def test_skip_lets_matching_calls_pass_first(skip):
    """The calls are numbered by their own value: the one injected into is call ``skip`` of the
    matching site (other sites and empty matrices do not count)."""
    fault = Fault("nan", "element", sites="dq", skip=skip, times=2)
    hit = []
    for call in range(5):
        fault("scores", np.ones((2, 2), np.float32))
        fault("dq", np.ones((0, 2), np.float32))
        c = np.full((2, 2), call, np.float32)
        fault("dq", c)
        if np.isnan(c).any():
            hit.append(call)
    assert hit == [call for call in (skip, skip + 1) if call < 5]
    assert [inj.old[0] for inj in fault.injected] == hit


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0), (2, 0, 3), (0, 3, 3)])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_empty_matrices_are_left_alone(shape, pattern):
    fault = Fault("nan", pattern)
    c = np.ones(shape, np.float32)
    fault("s", c)
    assert fault.injected == []
    c = np.ones((2, 2), np.float32)
    fault("s", c)
    assert len(fault.injected) == 1


def test_recorder_and_chain():
    rec = Recorder()
    fault = Fault("inf", "element", sites="b", row=0, col=0)
    hook = chain(rec, fault)
    a = np.ones((2, 3, 4), np.float16)
    b = np.ones((5, 6), np.float32)
    hook("a", a)
    hook("b", b)
    assert [(x.site, x.shape, x.dtype) for x in rec.calls] == [
        ("a", (2, 3, 4), np.dtype(np.float16)),
        ("b", (5, 6), np.dtype(np.float32)),
    ]
    assert rec.sites == {"a", "b"}
    assert (a == 1).all() and np.isinf(b[0, 0])


@pytest.mark.parametrize(
    "dtype,layout,names",
    [
        (np.float16, (10, 5), {0: "mantissa 0", 9: "mantissa 9", 10: "exponent 0", 15: "sign"}),
        (ml_dtypes.bfloat16, (7, 8), {6: "mantissa 6", 7: "exponent 0", 14: "exponent 7",
                                      15: "sign"}),
        (np.float32, (23, 8), {22: "mantissa 22", 30: "exponent 7", 31: "sign"}),
        (np.float64, (52, 11), {51: "mantissa 51", 62: "exponent 10", 63: "sign"}),
    ],
)
def test_bit_layout_and_names(dtype, layout, names):
    assert bit_layout(dtype) == layout
    for bit, name in names.items():
        assert bit_name(dtype, bit) == name
    with pytest.raises(ValueError):
        bit_name(dtype, 8 * np.dtype(dtype).itemsize)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "flip"},
        {"pattern": "diagonal"},
        {"kind": "inf", "bit": 3},
        {"kind": "bitflip", "bits": (1, 2)},
        {"kind": "multibit", "bits": (1, 1)},
        {"times": -1},
        {"skip": -1},
        {"tile": (0, 4)},
    ],
)
def test_invalid_configuration(kwargs):
    with pytest.raises(ValueError):
        Fault(**kwargs)


def test_out_of_range_position_or_bit():
    with pytest.raises(IndexError):
        Fault(row=5)("s", np.ones((5, 5), np.float32))
    with pytest.raises(IndexError):
        Fault(batch=(0, 3))("s", np.ones((2, 3, 4, 4), np.float32))
    with pytest.raises(ValueError):
        Fault(bit=16)("s", np.ones((2, 2), np.float16))
