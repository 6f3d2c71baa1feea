"""bench/timing.py's round orders: a balanced Latin square, so that in interleaved timing every
function runs right after every other equally often."""
from __future__ import annotations

from collections import Counter

import pytest

from bench.timing import round_order


@pytest.mark.parametrize("n", range(1, 9))
def test_every_function_follows_every_other_equally_often(n):
    rounds = 2 * n if n % 2 else n
    follows = Counter()
    for r in range(rounds):
        order = round_order(r, n)
        assert sorted(order) == list(range(n))
        follows.update(zip(order, order[1:]))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) <= 1
