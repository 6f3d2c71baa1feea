"""Recycled outputs (``Workspace.recycled``): an output array is handed out again only when
nothing references it any more, and the attention cores' results do not depend on where their
outputs came from."""
from __future__ import annotations

import weakref

import numpy as np
import pytest

from attention.context import Context
from attention.core import core_backward, core_forward
from attention.fused import fused_backward, fused_forward
from attention.workspace import RECYCLED_KEYS, RECYCLED_PER_KEY, Workspace


def _address(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


def test_an_unreferenced_output_is_handed_out_again():
    ws = Workspace()
    a = ws.recycled("out", np, (4, 8), np.float32)
    b = ws.recycled("out", np, (4, 8), np.float32)
    assert _address(a) != _address(b)  # a is still held
    where = _address(b)
    del b
    c = ws.recycled("out", np, (4, 8), np.float32)
    assert _address(c) == where and _address(c) != _address(a)
    assert c.flags.c_contiguous and c.shape == (4, 8) and c.dtype == np.float32


@pytest.mark.parametrize("holder", ["view", "memoryview", "list", "torch"])
def test_a_referenced_output_is_never_handed_out(holder):
    ws = Workspace()
    a = ws.recycled("out", np, (16,), np.float64)
    a[:] = np.arange(16)
    if holder == "view":
        kept = a[3:]
    elif holder == "memoryview":
        kept = memoryview(a)
    elif holder == "list":
        kept = [a]
    else:
        torch = pytest.importorskip("torch")
        kept = torch.from_numpy(a)
    where = _address(a)
    del a
    for _ in range(RECYCLED_PER_KEY + 2):
        b = ws.recycled("out", np, (16,), np.float64)
        assert _address(b) != where
        b[:] = -1  # b is ours to write; what `kept` sees must not change
    seen = np.asarray(kept[0] if holder == "list" else kept, dtype=np.float64)
    assert np.array_equal(seen, np.arange(16)[3:] if holder == "view" else np.arange(16))


def test_keys_do_not_share_arrays():
    ws = Workspace()
    a = ws.recycled("dq", np, (4, 4), np.float32)
    where = _address(a)
    del a
    assert _address(ws.recycled("dk", np, (4, 4), np.float32)) != where
    assert _address(ws.recycled("dq", np, (2, 8), np.float32)) != where
    assert _address(ws.recycled("dq", np, (4, 4), np.float64)) != where
    assert _address(ws.recycled("dq", np, (4, 4), np.float32)) == where


def test_clear_forgets_the_outputs():
    ws = Workspace()
    a = ws.recycled("out", np, (8,), np.float32)
    alive = weakref.ref(a)
    del a
    assert alive() is not None  # the workspace remembers it
    ws.clear()
    assert alive() is None


def test_other_array_modules_get_new_arrays():
    class Module:  # an array module that is not NumPy: recycled asks it for each array
        made: list = []

        @classmethod
        def empty(cls, shape, dtype):
            cls.made.append(np.empty(shape, dtype))
            return cls.made[-1]

    ws = Workspace()
    a = ws.recycled("out", Module, (4,), np.float32)
    del a
    b = ws.recycled("out", Module, (4,), np.float32)
    assert len(Module.made) == 2 and b is Module.made[1] and not ws._handed_out


def test_fused_core_reuses_dropped_outputs_and_keeps_held_ones():
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((2, 70, 16)).astype(np.float32) for _ in range(4))
    want_out, saved = fused_forward(q, k, v, Context(), causal=True)
    want_grads = fused_backward(saved, do, Context())
    ws = Workspace()

    out, saved = fused_forward(q, k, v, Context(), causal=True, workspace=ws)
    grads = fused_backward(saved, do, Context(), ws)
    held_out, held_grads = out.copy(), [g.copy() for g in grads]
    # every output is still held: the next call's are new arrays, and these stay as they were
    out2, saved2 = fused_forward(q, k, v, Context(), causal=True, workspace=ws)
    grads2 = fused_backward(saved2, do, Context(), ws)
    assert len({_address(x) for x in (out, out2, *grads, *grads2)}) == 8
    assert np.array_equal(out, held_out)
    assert all(np.array_equal(g, h) for g, h in zip(grads, held_grads))
    # the first call's outputs dropped: the third call writes into their memory
    addresses = [_address(x) for x in (out, *grads)]
    del out, saved, grads
    out3, saved3 = fused_forward(q, k, v, Context(), causal=True, workspace=ws)
    grads3 = fused_backward(saved3, do, Context(), ws)
    assert [_address(x) for x in (out3, *grads3)] == addresses
    for got in ((out2, *grads2), (out3, *grads3)):
        assert np.array_equal(got[0], want_out)
        assert all(np.array_equal(g, w) for g, w in zip(got[1:], want_grads))


@pytest.mark.parametrize("core", ["fused", "unfused"])
def test_attention_core_results_do_not_depend_on_recycling(core):
    """The bare core (:func:`attention.core.core_forward`), each core: a call whose earlier
    outputs are still held gets new arrays and leaves those as they were; once they are dropped,
    a call reuses their memory; every call's results equal a call without a workspace."""
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((2, 40, 8)).astype(np.float32) for _ in range(4))

    def call(ws):
        out, saved = core_forward(q, k, v, Context(), causal=True, core=core, workspace=ws)
        return (out, *core_backward(saved, do, Context(), workspace=ws))

    want = call(None)
    ws = Workspace()
    first = call(ws)
    held = [x.copy() for x in first]
    second = call(ws)
    assert not {_address(x) for x in first} & {_address(x) for x in second}
    assert all(np.array_equal(x, h) for x, h in zip(first, held))
    addresses = [_address(x) for x in first]
    del first
    third = call(ws)
    assert [_address(x) for x in third] == addresses
    for got in (second, third):
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_only_the_latest_keys_are_remembered():
    ws = Workspace()
    first = ws.recycled("out", np, (1,), np.float32)
    alive = weakref.ref(first)
    del first
    for n in range(2, RECYCLED_KEYS + 1):  # RECYCLED_KEYS keys in all: the first still kept
        ws.recycled("out", np, (n,), np.float32)
    assert alive() is not None
    ws.recycled("out", np, (1,), np.float32)  # used again: now the latest
    ws.recycled("out", np, (RECYCLED_KEYS + 1,), np.float32)
    assert alive() is not None
    for n in range(RECYCLED_KEYS + 2, 2 * RECYCLED_KEYS + 2):
        ws.recycled("out", np, (n,), np.float32)
    assert alive() is None
