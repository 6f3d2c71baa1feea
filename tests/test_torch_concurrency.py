"""One protected PyTorch module (one ``Protection``) called from several threads at once, as a
server runs one model for concurrent requests: every call returns what it returns alone, to the
bit, and nothing is flagged (each thread has its own plans and buffers; shared ones had raced,
and the checks had caught it as an uncorrectable fault)."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")

from attention.torch import MultiheadAttention  # noqa: E402
from attention.torch_functional import Protection, attention_core  # noqa: E402

THREADS, CALLS = 4, 8


def _concurrently(fn, inputs):
    """``fn(x)`` for each input, ``CALLS`` times each, from ``THREADS`` threads at once: the
    results of every call, and the exceptions raised."""
    results: list[list] = [[] for _ in inputs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(inputs))

    def worker(i):
        try:
            start.wait()
            for _ in range(CALLS):
                results[i].append(fn(inputs[i]))
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def test_attention_core_from_several_threads_at_once():
    protection = Protection()
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(2, 4, 160, 32, generator=gen, requires_grad=True) for _ in range(3)]
              for _ in range(THREADS)]

    def call(qkv):
        out, _ = attention_core(*qkv, protection=protection, is_causal=True)
        grads = torch.autograd.grad(out.square().sum(), qkv)
        return [out.detach(), *grads]

    alone = [call(x) for x in inputs]
    results, errors = _concurrently(call, inputs)
    assert not errors, errors[0]
    for want, got in zip(alone, results):
        for run in got:
            assert all(torch.equal(a, b) for a, b in zip(run, want))


def test_multihead_attention_module_from_several_threads_at_once():
    torch.manual_seed(0)
    module = MultiheadAttention(64, 4, batch_first=True).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 160, 64, generator=gen) for _ in range(THREADS)]

    def call(x):
        with torch.no_grad():
            return module(x, x, x, need_weights=False, is_causal=True,
                          attn_mask=torch.ones(160, 160, dtype=torch.bool).triu(1))[0]

    alone = [call(x) for x in inputs]
    results, errors = _concurrently(call, inputs)
    assert not errors, errors[0]
    for want, got in zip(alone, results):
        assert all(torch.equal(run, want) for run in got)
