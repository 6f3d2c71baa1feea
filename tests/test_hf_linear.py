"""Protected projections of Hugging Face transformers models (attention.hf_linear,
attention.torch_linear): BERT, RoBERTa, GPT-2 and GPT-Neo with their attention projections (and
with mlp=True their feed-forward layers) on checked products, against the unprotected eager model,
under injected faults, across optimizer steps, saving and compiling."""
import copy

import pytest

from hf_models import torch, transformers  # skips this module without them

from abftgemm.plan import ProtectedMatmul  # noqa: E402
from abftgemm.report import FaultDetectedWarning  # noqa: E402
from attention.hf_linear import ProtectedConv1D, ProtectedLinear, projection_cores  # noqa: E402
from attention.torch import fault_hook, protect  # noqa: E402
from attention._torch_linear_op import weight_on_left  # noqa: E402
from attention.torch_linear import LINEAR_SITES, ProtectedLinearCore  # noqa: E402
from hf_models import (FAMILIES, OncePerSite, assert_close,  # noqa: E402,F401
                       assert_fault_repaired, assert_same_step, batch, build, eager_runs,
                       seq2seq_step, step)

#: The protected projections of layer 0, attention block first, then the feed-forward layers.
LAYER0 = {
    "bert": (["bert.encoder.layer.0.attention.self." + n for n in ("query", "key", "value")]
             + ["bert.encoder.layer.0.attention.output.dense"],
             ["bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.0.output.dense"]),
    "gpt2": (["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj"],
             ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]),
    "gpt-neo": (["transformer.h.0.attn.attention." + n
                 for n in ("q_proj", "k_proj", "v_proj", "out_proj")],
                ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]),
    "llama": (["model.layers.0.self_attn." + n for n in ("q_proj", "k_proj", "v_proj", "o_proj")],
              ["model.layers.0.mlp." + n for n in ("gate_proj", "up_proj", "down_proj")]),
}
LAYER0["roberta"] = tuple([n.replace("bert.", "roberta.", 1) for n in names]
                          for names in LAYER0["bert"])


def layer0_projections(family, mlp):
    attn, ff = LAYER0[family]
    return attn + ff if mlp else attn


@pytest.mark.parametrize("mlp", (False, True), ids=("projections", "mlp"))
@pytest.mark.parametrize("family", FAMILIES)
def test_equals_eager_with_padding_in_train_mode(family, mlp, eager_runs):
    eager, want = eager_runs[family]
    model = protect(copy.deepcopy(eager), mlp=mlp)
    got = step(model, *batch())
    assert_same_step(got, want)
    cores = projection_cores(model)
    assert sorted(n for n in cores if ".0." in n) == sorted(layer0_projections(family, mlp))
    assert len(cores) == 2 * len(layer0_projections(family, mlp))  # two layers
    for name, core in cores.items():
        module = model.get_submodule(name)
        sites = LINEAR_SITES if module.bias is not None else LINEAR_SITES[:3]
        assert core.last_report.checked == {s: 1 for s in sites}, name
        assert not core.last_report.detected


@pytest.mark.parametrize("family", FAMILIES)
def test_fault_at_every_projection_site_of_a_layer_is_corrected(family, eager_runs):
    """One fault per step (INF, NaN, near-INF, 1e3 added, in turn) at each product of
    each protected projection of layer 0: reported repaired at that site, and the logits and
    gradients those of the fault-free run."""
    eager, want = eager_runs[family]
    model = protect(copy.deepcopy(eager), mlp=True)
    clean = step(model, *batch())
    kinds = (("inf", {}), ("nan", {}), ("near-inf", {}), ("additive", {"magnitude": 1e3}))
    count = 0
    for name in layer0_projections(family, mlp=True):
        has_bias = model.get_submodule(name).bias is not None
        for site in LINEAR_SITES if has_bias else LINEAR_SITES[:3]:
            kind, options = kinds[count % len(kinds)]
            count += 1
            assert_fault_repaired(model, projection_cores, name, site, clean, want, kind,
                                  **options)
    assert all(core.fault_hook is None for core in projection_cores(model).values())


def test_unprotected_fault_damages_the_model(eager_runs):
    """check="off": an INF in a projection's forward product reaches the logits; one in its
    input or weight gradient reaches the gradients."""
    eager, want = eager_runs["gpt2"]
    for site, damaged in (("forward", "logits"), ("d_input", "grads"), ("d_weight", "grads")):
        model = protect(copy.deepcopy(eager), check="off", mlp=True)
        with fault_hook(model, OncePerSite(f"transformer.h.0.mlp.c_fc:{site}")):
            logits, grads = step(model, *batch())
        finite = torch.isfinite(logits).all() if damaged == "logits" else \
            all(torch.isfinite(g).all() for g in grads.values())
        assert not finite, site
    assert_same_step(step(model, *batch()), want)  # without the fault, "off" is plain torch


@pytest.mark.parametrize("family", FAMILIES)
def test_protect_keeps_parameters(family):
    model = build(family)
    params = dict(model.named_parameters())
    state = model.state_dict()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    protect(model, mlp=True)
    assert all(a is b for a, b in zip(model.parameters(), params.values()))
    assert dict(model.named_parameters()) == params
    assert model.state_dict().keys() == state.keys()
    kind = ProtectedConv1D if family == "gpt2" else ProtectedLinear
    assert all(type(model.get_submodule(n)) is kind
               for n in layer0_projections(family, mlp=True))
    before = {n: p.detach().clone() for n, p in params.items()}
    step(model, *batch())
    optimizer.step()
    assert all(not torch.equal(before[n], params[n]) for n in params
               if any(n.startswith(m + ".") for m in projection_cores(model)))


def _counting_resets(monkeypatch):
    """A list that records the site of every remade constant encoding."""
    sites = []
    original = ProtectedMatmul.reset_constant

    def reset(plan, *args, **kw):
        sites.append(plan.name)
        return original(plan, *args, **kw)

    monkeypatch.setattr(ProtectedMatmul, "reset_constant", reset)
    return sites


def _linear_step(layer, x):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = layer(x)
    y.pow(2).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _protected_linear(check="correct"):
    """A widening nn.Linear (its d_input keeps the weight's encoding) swapped for a protected
    one, and an unprotected twin."""
    assert weight_on_left(16, 24)
    torch.manual_seed(3)
    layer = torch.nn.Linear(16, 24)
    twin = copy.deepcopy(layer)
    layer.__class__ = ProtectedLinear
    layer.abft_linear = ProtectedLinearCore(check)
    return layer, twin


def test_optimizer_step_remakes_the_weight_encoding(monkeypatch):
    """The d_input product keeps the weight's encoding between calls and remakes it after an
    optimizer step (the Parameter's version moved), never on a false alarm's rare path."""
    layer, twin = _protected_linear()
    resets = _counting_resets(monkeypatch)
    x = torch.randn(5, 16)
    counters = lambda: layer.abft_linear.protection.workspace(x.device).counters  # noqa: E731
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    _linear_step(layer, x)
    assert resets.count("d_input") == 1  # made once
    _linear_step(layer, x)
    assert resets.count("d_input") == 1  # weight unchanged: kept
    optimizer.step()
    twin.load_state_dict(layer.state_dict())
    got = _linear_step(layer, x)
    assert resets.count("d_input") == 2  # the step changed the weight: remade
    assert counters().rare_paths == 0  # so the check never disagreed
    assert resets.count("d_bias") == 1  # the row of ones never changes
    for a, b in zip(got, _linear_step(twin, x)):
        assert_close(a, b)


def test_stale_encoding_cannot_pass_wrong_data(monkeypatch):
    """A weight written behind its version counter (through ``.data``) leaves the encoding
    stale: the check disagrees, the rare path verifies from the operands (the gradient is right,
    and a fault in it is still repaired), and the next call remakes the encoding."""
    layer, twin = _protected_linear()
    resets = _counting_resets(monkeypatch)
    x = torch.randn(5, 16)
    _linear_step(layer, x)
    version = layer.weight._version
    layer.weight.data.mul_(-2.0)
    assert layer.weight._version == version  # the version counter did not see it
    twin.load_state_dict(layer.state_dict())
    want = _linear_step(twin, x)
    counters = layer.abft_linear.protection.workspace(x.device).counters
    rare = counters.rare_paths
    with fault_hook_of(layer, OncePerSite("d_input")):
        got = _linear_step(layer, x)
    assert counters.rare_paths == rare + 1
    report = layer.abft_linear.last_report
    assert [(e.site, e.action) for e in report.events] == [("d_input", "corrected")]
    for a, b in zip(got, want):
        assert_close(a, b)
    assert resets.count("d_input") == 1
    got = _linear_step(layer, x)
    assert resets.count("d_input") == 2 and counters.rare_paths == rare + 1
    for a, b in zip(got, want):
        assert_close(a, b)


class fault_hook_of:
    """Sets one layer's fault hook within the block."""

    def __init__(self, layer, fn):
        self.core, self.fn = layer.abft_linear, fn

    def __enter__(self):
        self.core.fault_hook = self.fn

    def __exit__(self, *exc):
        self.core.fault_hook = None


def test_float64_and_detect_mode():
    layer, twin = _protected_linear("detect")
    layer.double(), twin.double()
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    want = _linear_step(twin, x)
    for a, b in zip(_linear_step(layer, x), want):
        assert a.dtype == torch.float64
        assert_close(a, b, rtol=1e-12)
    with fault_hook_of(layer, OncePerSite("forward", "scale")), \
            pytest.warns(FaultDetectedWarning, match="forward"):
        y = _linear_step(layer, x)[0]
    assert layer.abft_linear.last_report.events[0].action == "reported"  # found, left in place
    assert (y - want[0]).abs().max() > 0.1


def test_bad_input_is_refused(eager_runs):
    layer, _ = _protected_linear()
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        layer(torch.ones(2, 16, dtype=torch.int64))
    with pytest.raises(TypeError, match="differs from the layer's weight"):
        layer(torch.ones(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="16 input features"):
        layer(torch.ones(2, 15))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([1.0] * 16)
    model = copy.deepcopy(eager_runs["gpt2"][0])
    with pytest.raises(ValueError, match="check must be one of"):
        protect(model, check="repair")
    with pytest.raises(ValueError, match="mlp=True needs projections"):
        protect(model, mlp=True, projections=False)
    assert not projection_cores(model)  # nothing was changed
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="transformers models only"):
        protect(torch.nn.Sequential(torch.nn.Linear(4, 4)), mlp=True)


def test_save_pretrained_round_trip(tmp_path, eager_runs):
    model = protect(copy.deepcopy(eager_runs["gpt2"][0]), mlp=True)
    want = step(model, *batch())
    model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert not projection_cores(loaded)  # what is protected is not saved: protect again
    assert loaded.state_dict().keys() == model.state_dict().keys()
    loaded = protect(loaded, mlp=True).train()
    assert_same_step(step(loaded, *batch()), want, rtol=0)


def test_torch_compile_equals_eager(eager_runs):
    eager, want = eager_runs["gpt2"]
    model = protect(copy.deepcopy(eager), mlp=True)
    compiled = torch.compile(model, backend="aot_eager")
    assert_same_step(step(compiled, *batch()), want)
    assert all(core.last_report.checked == {s: 1 for s in LINEAR_SITES}
               for core in projection_cores(model).values())  # the protected ops ran


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True])
def test_16_bit_products_lost_to_zeros_are_found(dtype, bias):
    """A 16-bit protected linear product on the CPU (whose plan takes PyTorch's GEMM as the
    caller's) that comes back as zeros, or as the bias alone, is detected and repaired, forward
    and backward (the plan judged it against float32 copies of the operands that only its own
    GEMM made: it passed)."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    core = ProtectedLinearCore("correct")
    w = torch.randn(24, 32, dtype=dt, requires_grad=True)
    x = torch.randn(16, 32, dtype=dt, requires_grad=True)
    b = torch.randn(24, dtype=dt) if bias else None

    def lose(site, c):
        c[...] = 0 if b is None or site != "forward" else b.float().numpy()

    core.fault_hook = lose
    y = core(x, w, b, False)
    y.backward(torch.ones_like(y))
    assert {e.site for e in core.last_report.events} >= {"forward", "d_input"}
    want = x.detach().double() @ w.detach().double().T + (0 if b is None else b.double())
    assert (y.double() - want).abs().max() < 0.1
    assert (x.grad.double() - torch.ones(16, 24, dtype=torch.float64) @ w.detach().double()
            ).abs().max() < 0.1


def test_a_layer_called_twice_in_a_step_keeps_every_finding_in_total_report():
    """A protected projection applied twice in one step (a shared layer, as ALBERT's):
    ``last_report`` holds the second forward's findings and both backwards', so a fault repaired
    in the first forward was in no report the user could reach; ``total_report`` holds every
    call's findings, each once, until the user replaces it."""
    from abftgemm.report import Report

    torch.manual_seed(0)
    core = ProtectedLinearCore("correct")
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    calls = []

    def hook(site, c):
        calls.append(site)
        if calls == ["forward"]:
            c[0, 0] = float("inf")

    core.fault_hook = hook
    core.total_report = Report()
    y = core(torch.tanh(core(x, w, None, False)), w, None, False)
    y.sum().backward()
    assert calls.count("forward") == 2 and calls.count("d_weight") == 2
    assert not core.last_report.events  # the second forward's, both backwards'
    total = core.total_report
    assert total.sites == {"forward"}, total.summary()
    assert total.checked["forward"] == 2 and total.checked["d_weight"] == 2


def test_t5_feed_forward_layers_are_protected_with_mlp():
    """T5's blocks keep their attention and feed-forward sublayers in a ``ModuleList`` of their
    own (``encoder.block.0.layer.0.SelfAttention``, ``encoder.block.0.layer.1.DenseReluDense``):
    ``mlp=True`` looked for the feed-forward layers in the attention's sublayer alone and left
    every ``DenseReluDense`` unprotected, silently. They are protected with ``mlp=True`` (not
    without it), and the step equals eager's."""
    config = transformers.T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=2,
                                   num_heads=4, d_kv=8, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    eager = transformers.T5ForConditionalGeneration(config).train()
    feed_forward = [f"{stack}.block.{i}.layer.{sub}.DenseReluDense.{w}"
                    for stack, sub in (("encoder", 1), ("decoder", 2)) for i in range(2)
                    for w in ("wi", "wo")]
    attention_only = projection_cores(protect(copy.deepcopy(eager)))
    assert not set(feed_forward) & set(attention_only)
    model = protect(copy.deepcopy(eager), mlp=True)
    cores = projection_cores(model)
    assert set(cores) == set(attention_only) | set(feed_forward)
    ids, mask = batch()
    runs = [seq2seq_step(m, ids, mask) for m in (eager, model)]
    assert_same_step(runs[1], runs[0])
    assert all(cores[name].last_report.checked == {s: 1 for s in LINEAR_SITES[:3]}
               for name in feed_forward)  # no biases: forward, d_input, d_weight


@pytest.mark.parametrize("bias", [False, True])
def test_falcon_projections_are_protected(bias):
    """Falcon's projections are ``FalconLinear`` (an ``nn.Linear`` subclass computing
    ``x W^T + b``), which ``protect`` skipped as not exactly ``nn.Linear``: a protected Falcon
    had no protected projection at all, silently. They are protected (still ``FalconLinear``),
    the step equals eager's and a fault in one is repaired."""
    if not hasattr(transformers, "FalconForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Falcon")
    from transformers.models.falcon.modeling_falcon import FalconLinear

    config = transformers.FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, bias=bias, bos_token_id=0,
                                       eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    eager = transformers.FalconForCausalLM(config).train()
    want = step(eager, *batch())
    attention = ["transformer.h.0.self_attention." + n for n in ("query_key_value", "dense")]
    feed_forward = ["transformer.h.0.mlp." + n for n in ("dense_h_to_4h", "dense_4h_to_h")]
    for mlp in (False, True):
        model = protect(copy.deepcopy(eager), mlp=mlp)
        cores = projection_cores(model)
        assert sorted(n for n in cores if ".0." in n) == sorted(
            attention + feed_forward if mlp else attention)
        assert all(isinstance(model.get_submodule(n), FalconLinear)
                   and isinstance(model.get_submodule(n), ProtectedLinear) for n in cores)
        got = step(model, *batch())
        assert_same_step(got, want)
        assert all(core.last_report.checked["forward"] == 1 for core in cores.values())
    assert_fault_repaired(model, projection_cores, attention[0], "d_input", got, want)


def test_feed_forward_layers_of_layers_without_attention_are_protected_with_mlp():
    """A hybrid model's layers without an attention module (LFM2's convolution layers; Qwen3-Next's
    linear attention and Jamba's Mamba layers alike) have feed-forward layers too: ``mlp=True``
    protected those of the attention layers only, and left the others unprotected, silently.
    With ``mlp=True`` every linear layer of the other layers is protected (they hold no attention
    block to tell apart), and the step equals eager's."""
    if not hasattr(transformers, "Lfm2ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no LFM2")
    config = transformers.Lfm2Config(vocab_size=100, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, layer_types=["conv", "full_attention"],
                                     block_auto_adjust_ff_dim=False, attn_implementation="eager")
    torch.manual_seed(0)
    eager = transformers.Lfm2ForCausalLM(config).train()
    want = step(eager, *batch())
    conv_layer = ["model.layers.0." + n for n in ("conv.in_proj", "conv.out_proj",
                                                  "feed_forward.w1", "feed_forward.w2",
                                                  "feed_forward.w3")]
    assert not set(conv_layer) & set(projection_cores(protect(copy.deepcopy(eager))))
    with pytest.warns(UserWarning, match=r"'model\.layers\.0\.conv\.conv' first, a Conv1d"):
        model = protect(copy.deepcopy(eager), mlp=True)  # (its convolution runs unprotected)
    cores = projection_cores(model)
    assert set(conv_layer) <= set(cores)
    assert_same_step(step(model, *batch()), want)
    assert all(cores[name].last_report.checked["forward"] == 1 for name in conv_layer)
