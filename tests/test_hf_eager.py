"""The eager path of the protected PyTorch products (attention._torch_arrays.eager,
attention._torch_linear_op.apply_linear, attention._torch_core_op.apply_core) against their custom
operators, and PyTorch's GEMM as the engine of the attention products
(abftgemm._cpu_triangles.gemm_engine, attention._torch_arrays.torch_gemm): what it writes is
checked like any product."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from abftgemm._cpu_triangles import gemm_engine, lower_product, triangular_matmul  # noqa: E402
from attention import _torch_arrays, _torch_core_op, _torch_linear_op  # noqa: E402
from attention.torch_core import ProtectedCore  # noqa: E402
from attention.torch_linear import ProtectedLinearCore  # noqa: E402


def _run_linear(core, x, w, b):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = core(x, w, b, weight_in_out=False)
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [y.detach(), x.grad, w.grad, b.grad]


def _run_core(core, q, k, v, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, weights = core(q, k, v, is_causal=causal, need_weights=True)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return [out.detach(), weights, q.grad, k.grad, v.grad]


def test_eager_path_equals_the_custom_operators(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((2, 5, 12), (7, 12), (7,)))
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen) for _ in range(3))
    linear, core = ProtectedLinearCore(), ProtectedCore()
    eager = [_run_linear(linear, x, w, b)] + [_run_core(core, q, k, v, c) for c in (False, True)]
    assert linear.last_report.checked and core.last_report.checked
    monkeypatch.setattr(_torch_linear_op, "eager", lambda *t: False)
    monkeypatch.setattr(_torch_core_op, "eager", lambda *t: False)
    ops = [_run_linear(linear, x, w, b)] + [_run_core(core, q, k, v, c) for c in (False, True)]
    for mine, theirs in zip(eager, ops):
        for a, b_ in zip(mine, theirs):
            assert torch.equal(a, b_)


def test_eager_only_on_plain_tensors():
    t = torch.ones(2)
    assert _torch_arrays.eager(t, torch.nn.Parameter(t), None)
    assert not _torch_arrays.eager(t, torch.ones(2, device="meta"))


def test_eager_backward_refuses_double_backward():
    x = torch.randn(4, 6, requires_grad=True)
    w, b = torch.randn(3, 6, requires_grad=True), torch.randn(3, requires_grad=True)
    linear = ProtectedLinearCore()
    y = linear(x, w, b, weight_in_out=False)
    (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


@pytest.mark.parametrize("kind", ["whole", "shared_b", "lower_product", "triangle"])
def test_torch_gemm_writes_the_product_into_views(kind):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 200, 40)).astype(np.float32)
    b = rng.standard_normal((1 if kind == "shared_b" else 3, 40, 200)).astype(np.float32)
    if kind == "triangle":
        a = rng.standard_normal((3, 200, 200)).astype(np.float32)
        a = np.tril(a)
        b = rng.standard_normal((3, 200, 30)).astype(np.float32)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    out = np.full(want.shape, np.nan, np.float32)
    with gemm_engine(_torch_arrays.torch_gemm):
        if kind == "lower_product":
            lower_product(a, b, out)
        else:
            triangular_matmul(a, b, out, "lower" if kind == "triangle" else None)
    if kind == "lower_product":  # each row at least up to its diagonal, the rest left alone
        done = ~np.isnan(out)
        assert all(done[..., i, :i + 1].all() for i in range(200)) and not done.all()
        out, want = np.where(done, out, 0), np.where(done, want, 0)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)


def test_a_wrong_product_of_the_engine_is_corrected(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen) for _ in range(3))
    clean_core = ProtectedCore()
    clean = _run_core(clean_core, q, k, v, False)
    assert not clean_core.last_report.detected
    calls, right = [], _torch_arrays.torch_gemm

    def faulty(a, b, out):
        right(a, b, out)
        if not calls:
            out[0, 1, 2] += 1e3
        calls.append(out.shape)

    monkeypatch.setattr(_torch_arrays, "torch_gemm", faulty)
    core = ProtectedCore()
    got = _run_core(core, q, k, v, False)
    assert calls, "the attention products did not run on the engine"
    assert core.last_report.detected and core.last_report.corrected + \
        core.last_report.recomputed >= 1, core.last_report.summary()
    for a, b_ in zip(got, clean):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)
