"""Attention dropout in ``attention.torch``: against float64 autograd math with the mask the module
drew, against stock ``nn.MultiheadAttention``'s statistics, reproducible with ``torch.manual_seed``,
inside the default ``nn.TransformerEncoderLayer`` (dropout 0.1), under ``torch.compile``, and with
faults injected while dropout is on."""
from __future__ import annotations

import math

import pytest

from abftgemm.faults import Fault

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")
nn = torch.nn

from attention.dropout_hash import keep_mask  # noqa: E402
from attention.torch import MultiheadAttention, protect  # noqa: E402

E, HEADS, N, L = 16, 4, 2, 6


def modules(p, dtype=torch.float64):
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(E, HEADS, dropout=p, batch_first=True, dtype=dtype)
    mine = MultiheadAttention(E, HEADS, dropout=p, batch_first=True, dtype=dtype)
    mine.load_state_dict(stock.state_dict())
    return stock, mine


def explicit(module, x, keep, p, mask):
    """Attention with the dropout mask ``keep`` ``(N * H, L, L)``, in float64 autograd."""
    x = x.detach().double().requires_grad_()
    w, b = module.in_proj_weight.double(), module.in_proj_bias.double()
    q, k, v = (x @ w[i * E:(i + 1) * E].T + b[i * E:(i + 1) * E] for i in range(3))
    hd = E // HEADS

    def heads(t):
        return t.view(N, L, HEADS, hd).transpose(1, 2).reshape(N * HEADS, L, hd)

    s = heads(q) @ heads(k).transpose(1, 2) / math.sqrt(hd)
    s = s.masked_fill(mask, float("-inf"))
    probs = torch.softmax(s, -1) * keep / (1 - p)
    ctx = (probs @ heads(v)).view(N, HEADS, L, hd).transpose(1, 2).reshape(N, L, E)
    y = ctx @ module.out_proj.weight.double().T + module.out_proj.bias.double()
    return y, x


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_train_mode_matches_float64_math_with_the_mask_torch_drew(p):
    _, mine = modules(p)
    mine.train()
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(L, L, dtype=torch.bool).triu(1)
    torch.manual_seed(5)
    y, _ = mine(x, x, x, attn_mask=mask, need_weights=False)
    g = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    (y * g).sum().backward()
    # the module draws the fused core's seed first thing (CPU float64): the same seed again
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())
    keep = torch.from_numpy(keep_mask(seed, p, (N * HEADS, L, L)))
    want, x64 = explicit(mine, x, keep, p, mask)
    (want * g).sum().backward()
    assert torch.allclose(y, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(x.grad, x64.grad, rtol=1e-11, atol=1e-11)
    assert mine.last_core == "fused"
    assert not mine.last_report.detected and mine.last_report.checked["fused:O_acc"] == 1


def test_weights_asked_for_run_the_unfused_core_with_the_same_keep_decisions():
    """need_weights: the unfused core, with the keep decisions of the seed the fused core would
    have drawn (a recomputation that asks for the weights where its forward did not drops the
    same entries)."""
    p = 0.5
    _, mine = modules(p)
    mine.train()
    x = torch.randn(N, L, E, dtype=torch.float64)
    mask = torch.zeros(L, L, dtype=torch.bool)
    torch.manual_seed(6)
    y, _ = mine(x, x, x, attn_mask=mask, need_weights=True)
    torch.manual_seed(6)
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())
    keep = torch.from_numpy(keep_mask(seed, p, (N * HEADS, L, L)))
    want, _ = explicit(mine, x, keep, p, mask)
    assert mine.last_core == "unfused" and mine.last_report.checked["dropout"] == 1
    assert torch.allclose(y, want, rtol=1e-12, atol=1e-12)


def test_same_statistics_as_stock_dropout():
    """Over 300 draws, each output element's mean under dropout agrees with stock PyTorch's within
    five standard errors of the difference, and both are unbiased estimates of the eval output."""
    stock, mine = modules(0.5)
    x = torch.randn(N, L, E, dtype=torch.float64)
    draws = {"stock": [], "mine": []}
    with torch.no_grad():
        for name, m in (("stock", stock), ("mine", mine)):
            m.train()
            for seed in range(300):
                torch.manual_seed(seed)
                draws[name].append(m(x, x, x, need_weights=False)[0])
        stock.eval()
        mine.eval()
        eval_out = stock(x, x, x, need_weights=False)[0]
        assert torch.allclose(mine(x, x, x, need_weights=False)[0], eval_out, atol=1e-12)
    a, b = torch.stack(draws["stock"]), torch.stack(draws["mine"])
    se = ((a.var(0) + b.var(0)) / a.shape[0]).sqrt()
    assert ((a.mean(0) - b.mean(0)).abs() <= 5 * se + 1e-12).all()
    assert ((b.mean(0) - eval_out).abs() <= 5 * (b.var(0) / b.shape[0]).sqrt() + 1e-12).all()
    assert torch.allclose(a.var(0).mean(), b.var(0).mean(), rtol=0.25)


def test_reproducible_with_manual_seed_and_weights_after_dropout():
    _, mine = modules(0.3)
    mine.train()
    x = torch.randn(N, L, E, dtype=torch.float64)
    torch.manual_seed(2)
    y1, w1 = mine(x, x, x, average_attn_weights=False)
    torch.manual_seed(2)
    y2, w2 = mine(x, x, x, average_attn_weights=False)
    assert torch.equal(y1, y2) and torch.equal(w1, w2)
    # as stock PyTorch, the weights returned are those after dropout: zeros where dropped
    zeros = float((w1 == 0).double().mean())
    assert 0.15 < zeros < 0.45, zeros


#: Calls refused for their arguments: (keyword arguments, whether stock refuses them too).
REFUSED = {
    "attn_mask-shape": (lambda: {"attn_mask": torch.zeros(L, L + 1, dtype=torch.bool)}, True),
    "key_padding_mask-shape": (
        lambda: {"key_padding_mask": torch.zeros(N, L + 1, dtype=torch.bool)}, True),
    "int-attn_mask": (lambda: {"attn_mask": torch.zeros(L, L, dtype=torch.int64)}, True),
    "fused-weights": (lambda: {"need_weights": True}, False),
    "fused-learned-mask": (lambda: {"attn_mask": torch.zeros(L, L, dtype=torch.float64,
                                                             requires_grad=True),
                                    "need_weights": False}, False),
    "fused-causal-across-lengths": (lambda: {"key": torch.zeros(N, L + 1, E, dtype=torch.float64),
                                             "is_causal": True, "need_weights": False}, False),
}


@pytest.mark.parametrize("core", ["auto", "unfused", "fused"])
@pytest.mark.parametrize("refused", REFUSED)
def test_a_refused_call_leaves_the_generator_as_stock_does(core, refused):
    """A call refused for its arguments draws no dropout: PyTorch's generator is where stock
    ``nn.MultiheadAttention``'s refusal leaves it (untouched), so the run after it drops what
    it would have (the refused call drew its dropout first, shifting every later draw)."""
    make, stock_refuses = REFUSED[refused]
    if refused.startswith("fused") and core != "fused":
        pytest.skip("only the forced fused core refuses it")
    stock, mine = modules(0.5)
    stock.train(), mine.train()
    mine.core = core
    x = torch.randn(N, L, E, dtype=torch.float64)
    after = []
    for module in (stock, mine) if stock_refuses else (mine,):
        torch.manual_seed(3)
        kw = make()
        key = kw.pop("key", x)
        with pytest.raises((RuntimeError, AssertionError, ValueError, TypeError)):
            module(x, key, key, **kw)
        after.append(torch.rand(3))
    torch.manual_seed(3)
    untouched = torch.rand(3)
    assert all(torch.equal(a, untouched) for a in after)


@pytest.mark.parametrize("refused", ["causal-across-lengths", "fused-learned-mask"])
def test_a_refused_attention_core_call_leaves_the_generator_alone(refused):
    """``attention_core`` with dropout refuses ``is_causal`` across lengths and a learned mask
    on the forced fused core before it draws its dropout (it drew first, then raised)."""
    from attention.torch_functional import Protection, attention_core

    q, k = torch.randn(2, L, 4, dtype=torch.float64), torch.randn(2, L + 1, 4, dtype=torch.float64)
    kw = {"causal-across-lengths": {"is_causal": True},
          "fused-learned-mask": {"core": "fused", "attn_mask": torch.zeros(
              L, L + 1, dtype=torch.float64, requires_grad=True)}}[refused]
    torch.manual_seed(3)
    with pytest.raises(ValueError):
        attention_core(q, k, k, protection=Protection(), dropout_p=0.5, **kw)
    after = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(3))


def encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)  # dropout 0.1
    stock = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return stock


def test_default_transformer_encoder_layer_trains_protected():
    stock = encoder()
    model = protect(encoder())
    x = torch.randn(3, 10, 32)
    model.eval()
    stock.eval()
    with torch.no_grad():
        assert torch.allclose(model(x), stock(x), atol=1e-5)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item())
    attn = model.layers[0].self_attn  # float32 on the CPU: dropout on the fused core
    assert attn.last_core == "fused"
    assert attn.last_report.checked["fused:O_acc"] == 1 and not attn.last_report.detected


def test_compiled_model_with_dropout_runs_the_protected_op():
    model = protect(encoder())
    model.train()
    x = torch.randn(2, 8, 32)
    compiled = torch.compile(model, fullgraph=True)
    torch.manual_seed(3)
    y1 = compiled(x)
    y1.square().mean().backward()
    torch.manual_seed(3)
    y2 = compiled(x)
    assert torch.equal(y1, y2)
    assert model.layers[1].self_attn.last_report.checked["fused:O_acc"] == 1


def test_a_fault_with_dropout_on_is_repaired():
    _, mine = modules(0.4)
    mine.train()
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=True)

    def run(hook=None):
        mine.fault_hook = hook
        x.grad = None
        torch.manual_seed(9)
        y, _ = mine(x, x, x, need_weights=False)
        y.sum().backward()
        return y.detach(), x.grad.clone()

    y0, g0 = run()  # the fused core; a fault hook runs the unfused core on the same decisions
    assert mine.last_core == "fused"
    for site in ("dropout", "context", "d_v", "softmax_backward"):
        y, g = run(Fault("nan", "element", seed=1, sites=site))
        assert site in mine.last_report.sites, mine.last_report.summary()
        assert torch.allclose(y, y0, atol=1e-12) and torch.allclose(g, g0, atol=1e-12)


def test_forced_fused_core_draws_a_seed_on_any_device():
    """``core="fused"`` runs the fused core wherever the data are (CuPy data run its CUDA
    kernels, whose dropout takes a seed, not a mask): the draw is its seed on every device. On
    CUDA tensors it was a mask, which the forced fused core refuses ("an explicit dropout
    mask"), so the module and ``attention_core`` raised in training with dropout on a GPU. The
    stand-in query has what the draw reads of a CUDA tensor (no GPU here)."""
    from types import SimpleNamespace

    from attention.torch_functional import _dropout_draw

    cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    drawn = _dropout_draw((2, 3, 4), cuda, 0.5, False, "fused")
    assert drawn.dtype == torch.int64 and tuple(drawn.shape) == (1,)
    cpu = torch.zeros(1)
    for core, seed in (("auto", True), ("fused", True), ("unfused", False)):
        drawn = _dropout_draw((2, 3, 4), cpu, 0.5, False, core)
        assert (tuple(drawn.shape) == (1,)) == seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_forced_fused_core_trains_with_dropout_on_a_gpu():
    module = MultiheadAttention(16, 2, dropout=0.3, batch_first=True, core="fused").cuda()
    x = torch.randn(2, 10, 16, device="cuda", requires_grad=True)
    y, _ = module(x, x, x, need_weights=False)
    y.sum().backward()
    assert module.last_core == "fused" and torch.isfinite(x.grad).all()
