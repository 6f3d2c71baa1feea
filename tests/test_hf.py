"""Hugging Face transformers models protected by attention.torch.protect: BERT, RoBERTa, GPT-2,
GPT-Neo and Llama, and Mistral's sliding window (tiny configurations built in code, random weights
and token ids; nothing downloaded) against the "eager" attention, under injected faults, and
around saving and compiling."""
import contextlib
import copy

import pytest

from hf_models import torch, transformers  # skips this module without them

from attention._torch_arrays import recomputing  # noqa: E402
from attention.core import CORE_INVARIANT_SITES, CORE_SITES  # noqa: E402
from attention.dropout_hash import keep_mask  # noqa: E402
from attention.hf import abft_attention_forward  # noqa: E402
from attention.hf_linear import projection_cores  # noqa: E402
from attention.hf_protect import ProtectedGPTNeoSelfAttention, attention_cores  # noqa: E402
from attention.torch import fault_hook, protect, protected_cores  # noqa: E402
from hf_models import (ATOL_16, FAMILIES, HEADS, RTOL_16, VOCAB, WIDTH,  # noqa: E402,F401
                       OncePerSite, assert_close, assert_fault_repaired, assert_same_step, batch,
                       build, eager_runs, layer0, step)

@pytest.mark.parametrize("family", FAMILIES)
def test_equals_eager_with_padding_in_train_mode(family, eager_runs):
    eager, want = eager_runs[family]
    model = protect(copy.deepcopy(eager))
    assert model.training
    got = step(model, *batch())
    assert_same_step(got, want)
    cores = attention_cores(model)
    assert len(cores) == 2  # one per layer
    for core in cores.values():
        report = core.last_report
        assert not report.detected and report.checked  # the protected products ran, clean


@pytest.mark.parametrize("family", FAMILIES)
def test_protect_keeps_parameters(family):
    model = build(family)
    params = dict(model.named_parameters())
    state = model.state_dict()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    protect(model)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert all(a is b for a, b in zip(model.parameters(), params.values()))
    assert model.state_dict().keys() == state.keys()
    if family == "gpt-neo":
        assert all(isinstance(m.attn.attention, ProtectedGPTNeoSelfAttention)
                   for m in model.transformer.h)
    else:
        assert model.config._attn_implementation == "abft"
    before = {n: p.detach().clone() for n, p in params.items()}
    step(model, *batch())
    optimizer.step()
    assert any(not torch.equal(before[n], p) for n, p in params.items())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_protect_leaves_models_sharing_its_config_alone(family):
    """Two models built from one config object: protecting one leaves the other (and the
    config) on its attention (it switched both to "abft"), and setting the other's back does
    not unprotect this one (it did, silently: its attention checked nothing)."""
    base = build(family)
    config = base.config
    other = type(base)(config)
    protect(base)
    assert config._attn_implementation == other.config._attn_implementation != "abft"
    assert base.config._attn_implementation == "abft" and base.config is not config
    other.set_attn_implementation("sdpa")
    step(base, *batch())
    assert all(core.last_report.checked for core in attention_cores(base).values())


@pytest.mark.parametrize("family", FAMILIES)
def test_fault_at_every_site_of_a_layer_is_corrected(family, eager_runs):
    """One INF per step, at each site of layer 0 in turn: reported repaired at that site, and
    the logits and gradients those of the fault-free run."""
    eager, want = eager_runs[family]
    model = protect(copy.deepcopy(eager))
    clean = step(model, *batch())
    layer = layer0(family)
    for site in CORE_SITES + CORE_INVARIANT_SITES:
        assert_fault_repaired(model, attention_cores, layer, site, clean, want)
    for core in attention_cores(model).values():
        assert core.fault_hook is None  # the context manager restored the hooks


def test_unprotected_fault_damages_the_model(eager_runs):
    eager, _ = eager_runs["gpt2"]
    model = protect(copy.deepcopy(eager), check="off")
    with fault_hook(model, OncePerSite(layer0("gpt2") + ":")):
        logits, grads = step(model, *batch())
    assert not torch.isfinite(logits).all()
    assert not all(torch.isfinite(g).all() for g in grads.values())


def masked_dropout(x, p=0.5, training=True, inplace=False):
    """``torch.nn.functional.dropout`` with its mask drawn as the protected attention draws its
    own on CPU float32 data (the fused core's seed, ``torch.randint`` on the default generator,
    and its keep decisions, :func:`attention.dropout_hash.keep_mask`, over the attention
    weights ``(batch, heads, L, S)`` as ``(batch * heads, L, S)``), so that both see the same
    masks after the same seed."""
    if not training or p == 0:
        return x
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())
    seq_q, seq_k = x.shape[-2:]
    keep = keep_mask(seed, p, (x.numel() // (seq_q * seq_k), seq_q, seq_k))
    keep = torch.from_numpy(keep).reshape(x.shape)
    return x * keep / (1 - p)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_dropout_equals_eager_with_the_same_masks(family, monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "dropout", masked_dropout)
    eager = build(family, attn_dropout=0.3)
    torch.manual_seed(4)
    want = step(eager, *batch())
    model = protect(copy.deepcopy(eager))
    torch.manual_seed(4)
    got = step(model, *batch())
    assert_same_step(got, want)
    for core in attention_cores(model).values():
        assert core.last_core == "fused"  # float32 on the CPU: dropout on the fused core
        assert core.last_report.checked["fused:O_acc"] == 1 and not core.last_report.detected
    model.eval()  # no dropout outside training
    with torch.no_grad():
        model(batch()[0])
    assert all("dropout" not in c.last_report.checked for c in attention_cores(model).values())


def test_refuses_what_it_cannot_honour():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcap"):
        abft_attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)
    for name in ("indices", "block_indices", "cu_seq_lens_q"):  # ignored, they ran dense
        with pytest.raises(ValueError, match=name):
            abft_attention_forward(torch.nn.Module(), q, q, q, None,
                                   **{name: torch.zeros(1, 2, 4, 2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="no attention module|does not call"):
        protect(transformers.BertModel(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=0, num_attention_heads=HEADS,
            intermediate_size=WIDTH)))
    with pytest.raises(ValueError, match="no protected module"):
        with fault_hook(build("gpt2"), print):
            pass


def test_sliding_window_comes_in_the_mask():
    q = torch.randn(1, 2, 6, 8)
    module = torch.nn.Module()
    module.is_causal = True
    with pytest.raises(ValueError, match="sliding window"):  # no mask: the window is lost
        abft_attention_forward(module, q, q, q, None, sliding_window=5)
    out, _ = abft_attention_forward(module, q, q, q, None, sliding_window=6)  # hides nothing
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert_close(out.transpose(1, 2), ref)


def test_mistral_sliding_window_equals_eager():
    """Mistral (Llama with a sliding window): a window of 4 over 12 tokens, with padding, in
    train mode: logits and gradients equal eager's, and the window matters (without it the
    logits differ)."""
    def mistral(window):
        torch.manual_seed(0)
        config = transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, sliding_window=window,
            attn_implementation="eager", bos_token_id=0, eos_token_id=0)
        return transformers.MistralForCausalLM(config).train()

    want = step(mistral(4), *batch())
    unwindowed = step(mistral(None), *batch())
    assert (unwindowed[0] - want[0]).abs().max() > 1e-3
    model = protect(mistral(4))
    assert_same_step(step(model, *batch()), want)
    assert {c.last_core for c in attention_cores(model).values()} == {"fused"}


def test_float_and_boolean_4d_masks_and_causal_offset():
    """The mask forms transformers passes: 4-D float (eager's), 4-D boolean (sdpa's, True =
    attend), none with a causal module, and none with fewer queries than keys, which sdpa's
    ``is_causal`` aligns top-left (a prefill into an empty static cache)."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 4, n, 8, requires_grad=True) for n in (6, 6, 6))
    module = torch.nn.Module()
    module.is_causal = False
    allowed = torch.rand(2, 1, 6, 6) > 0.3
    allowed[..., 0] = True
    add = torch.zeros(2, 1, 6, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    for mask in (allowed, add):
        out, weights = abft_attention_forward(module, q, k, v, mask, scaling=8 ** -0.5)
        assert_close(out.transpose(1, 2), ref.detach())
        assert weights.shape == (2, 4, 6, 6)
    module.is_causal = True
    out, _ = abft_attention_forward(module, q, k, v, None, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    assert_close(out.transpose(1, 2), ref.detach())
    grads = torch.autograd.grad(out.transpose(1, 2).sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, w in zip(grads, want):
        assert_close(g, w)
    first = q[:, :, :2].detach()  # two queries over six key slots, the last four empty
    out, _ = abft_attention_forward(module, first, k, v, None)
    ref = torch.nn.functional.scaled_dot_product_attention(first, k, v, is_causal=True)
    assert_close(out.transpose(1, 2), ref.detach())


@pytest.mark.parametrize("reentrant", (False, True), ids=("non-reentrant", "reentrant"))
def test_gradient_checkpointing_equals_eager_and_repairs(reentrant, eager_runs):
    """Activation (gradient) checkpointing (the Trainer's memory saver: each layer's forward runs
    again inside the backward): the step equals eager's, and a fault in a backward product is
    repaired there."""
    eager, want = eager_runs["llama"]
    model = protect(copy.deepcopy(eager))
    options = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.25
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    assert_same_step(step(model, *batch()), want)
    name = layer0("llama")
    assert_fault_repaired(model, attention_cores, name, "d_q", want, want)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_checkpointed_recomputation_on_the_other_core_equals_eager(family, eager_runs):
    """Non-reentrant checkpointing requires the recomputation to save what the forward saved:
    a forward on the unfused core (the attention weights asked for, or a fault hook set around
    the forward alone) and a recomputation in backward on the fused core (no weights, no hook)
    saved different tensors: ``CheckpointError``. The recomputation runs the forward's core;
    both steps equal eager's."""
    eager, want = eager_runs[family]
    model = protect(copy.deepcopy(eager))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask = batch()
    for weights, hooked in ((True, False), (False, True)):
        model.zero_grad(set_to_none=True)
        with fault_hook(model, lambda site, c: None) if hooked else contextlib.nullcontext():
            logits = model(ids, attention_mask=mask, output_attentions=weights).logits
        keep = mask.bool()
        logits[keep].pow(2).mean().backward()
        got = (logits[keep].detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None})
        assert_same_step(got, want)


@pytest.mark.parametrize("reentrant", (False, True), ids=("non-reentrant", "reentrant"))
@pytest.mark.parametrize("call", (0, 1), ids=("forward", "recomputation"))
@pytest.mark.parametrize("site", ("scores", "q_proj"))
def test_checkpointed_steps_report_every_repaired_fault(reentrant, call, site, eager_runs):
    """With activation checkpointing a layer's forward runs twice: a fault repaired in the first
    forward or in the recomputation inside backward is in the step's ``last_report`` (the
    recomputation's report replaced the forward's, or the backward restored the forward's and
    dropped the recomputation's); the step equals eager's."""
    eager, want = eager_runs["llama"]
    model = protect(copy.deepcopy(eager))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
                                                                       reentrant})
    name = layer0("llama")
    target = f"{name}:{site}" if site == "scores" else f"{name}.q_proj:forward"
    injected = []

    def hook(at, c):
        if at == target and not injected and recomputing() == bool(call):
            injected.append(at)
            c.flat[0] = float("inf")

    with fault_hook(model, hook):
        got = step(model, *batch())
    assert injected
    assert_same_step(got, want)
    cores = protected_cores(model)
    owner = cores[name] if site == "scores" else cores[f"{name}.q_proj"]
    assert owner.last_report.detected, owner.last_report.summary()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gradient_checkpointing_with_attention_dropout_keeps_the_forwards_masks(family):
    """The recomputation in backward runs outside transformers' output collector: its dropout
    must drop what the forward dropped, whichever core runs (it asked for the attention weights,
    ran the unfused core and drew a new ``torch.rand`` mask: gradients 8-25% off, the logits
    equal), and it makes no weights (the fused core runs, O(L) memory, as in the forward)."""
    base = build(family, attn_dropout=0.3)
    runs = []
    for checkpointed in (False, True):
        model = protect(copy.deepcopy(base)).train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
                                                                               False})
        torch.manual_seed(7)
        runs.append(step(model, *batch()))
        assert {c.last_core for c in attention_cores(model).values()} == {"fused"}
    assert_same_step(runs[1], runs[0])


@pytest.mark.parametrize("family", ["gpt2", "gpt-neo", "llama"])
def test_generate_with_cache_equals_eager(family, eager_runs):
    # greedy decoding of a left-padded batch (batched generation's layout) with a KV cache
    eager = copy.deepcopy(eager_runs[family][0]).eval()
    model = protect(copy.deepcopy(eager))
    ids = batch()[0][:2, :5]
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), eager.generate(ids, **kw))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_static_cache_generation_equals_eager(family, eager_runs):
    """A static cache is longer than the prompt, and transformers hands its prefill no mask
    (sdpa's ``is_causal``, aligned top-left, hides the empty slots): greedy decoding and the
    first step's scores equal eager's."""
    eager = copy.deepcopy(eager_runs[family][0]).eval()
    model = protect(copy.deepcopy(eager))
    ids = batch()[0][:2, :5]
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
              pad_token_id=0, cache_implementation="static", output_scores=True,
              return_dict_in_generate=True)
    got, want = (m.generate(ids, **kw) for m in (model, eager))
    assert torch.equal(got.sequences, want.sequences)
    assert_close(got.scores[0], want.scores[0])


def test_save_pretrained_round_trip(tmp_path, eager_runs):
    model = protect(copy.deepcopy(eager_runs["roberta"][0]))
    want = step(model, *batch())
    model.save_pretrained(tmp_path)
    loaded = transformers.RobertaForMaskedLM.from_pretrained(tmp_path)
    assert loaded.config._attn_implementation != "abft"  # the choice is not saved: protect again
    loaded = protect(loaded).train()
    assert_same_step(step(loaded, *batch()), want, rtol=0)


def test_deepcopy_after_forward(eager_runs):
    model = protect(copy.deepcopy(eager_runs["gpt2"][0]))
    want = step(model, *batch())
    twin = copy.deepcopy(model)
    assert_same_step(step(twin, *batch()), want, rtol=0)
    assert attention_cores(twin).keys() == attention_cores(model).keys()


@pytest.mark.parametrize("family,backend", [("gpt2", "aot_eager"), ("llama", "aot_eager"),
                                            ("gpt2", "inductor")])
def test_torch_compile_equals_eager(family, backend, eager_runs):
    """Inductor (about 20 s to compile here) reuses buffers: the fused core's backward reads
    its output from autograd's saved tensors (it read a reused buffer: wrong gradients, and the
    final dK check raised without a fault)."""
    eager, want = eager_runs[family]
    model = protect(copy.deepcopy(eager))
    compiled = torch.compile(model, backend=backend, fullgraph=False)
    assert_same_step(step(compiled, *batch()), want)
    assert all(c.last_report.checked for c in attention_cores(model).values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_16bit_autocast_equals_eager(family, dtype):
    """Under CPU autocast the protected projections and feed-forward layers cast input, weight
    and bias to the 16-bit dtype as nn.Linear does, hand the attention 16-bit Q, K and V, and
    every protected product runs in that dtype like eager's; the gradients keep the
    Parameters' float32."""
    runs = []
    for model in (build(family), protect(build(family), mlp=True)):
        ids, mask = batch()
        with torch.autocast("cpu", dtype=dtype):
            if not torch.is_autocast_enabled("cpu"):
                pytest.skip(f"this PyTorch has no CPU autocast to {dtype}")
            logits = model(ids, attention_mask=mask).logits
        assert logits.dtype == dtype
        keep = mask.bool()
        logits[keep].float().pow(2).mean().backward()
        runs.append((logits[keep].float().detach(),
                     {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert all(g.dtype == torch.float32 for g in runs[1][1].values())
    assert_same_step(runs[1], runs[0], rtol=RTOL_16[dtype], atol=ATOL_16[dtype])
    assert all(c.last_report.checked for c in attention_cores(model).values())
    assert {c.last_core for c in attention_cores(model).values()} == {"fused"}
    assert all(core.last_report.checked.get("d_weight") == 1
               for core in projection_cores(model).values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_16bit_model_equals_eager(family, dtype):
    """A model loaded in a 16-bit dtype (``torch_dtype=torch.bfloat16``, no autocast): every
    protected product takes and returns that dtype, and the step equals eager's within the same
    few roundoffs as under autocast, its gradients in that dtype."""
    eager = build(family).to(dtype)
    want = step(eager, *batch())
    model = protect(copy.deepcopy(eager), mlp=True)
    got = step(model, *batch())
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1].values())
    assert_same_step((got[0].float(), {k: g.float() for k, g in got[1].items()}),
                     (want[0].float(), {k: g.float() for k, g in want[1].items()}),
                     rtol=RTOL_16[dtype], atol=ATOL_16[dtype])
    assert {c.last_core for c in attention_cores(model).values()} == {"fused"}
    assert all(core.last_report.checked.get("d_weight") == 1
               for core in projection_cores(model).values())


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_core_without_padding_and_weights_when_asked(family):
    # no padding mask and no output_attentions: the fused core runs, equal to eager (in GPT-Neo
    # too, whose causal and window masks come as additive masks); asked for the attention
    # weights, the unfused core makes them, equal to eager's
    eager = build(family)
    model = protect(copy.deepcopy(eager))
    ids, _ = batch()
    full = torch.ones_like(ids)
    got, want = step(model, ids, full), step(eager, ids, full)
    assert_same_step(got, want)
    assert {c.last_core for c in attention_cores(model).values()} == {"fused"}
    out = model(ids, output_attentions=True)
    ref = eager(ids, output_attentions=True)
    assert {c.last_core for c in attention_cores(model).values()} == {"unfused"}
    assert len(out.attentions) == len(ref.attentions) == 2
    for a, b in zip(out.attentions, ref.attentions):
        assert_close(a, b)


@pytest.mark.parametrize("family,causal", [("bert", False), ("roberta", False), ("gpt2", True),
                                           ("gpt-neo", True), ("llama", True)])
def test_padding_masks_reach_the_core_as_key_visibility(family, causal, monkeypatch):
    # a padded batch's masks (and the causal triangle with them) reach the core as key
    # visibility (n, S) and the causal flag, not as an L x S mask; GPT-Neo's local layers (a
    # window: not key padding) keep theirs
    from attention import _torch_core_op
    calls = []
    real = _torch_core_op.core_forward

    def spy(q, k, v, ctx, **kw):
        mask, visible = kw.get("attn_mask"), kw.get("key_visible")
        calls.append((mask is None, None if visible is None else visible.shape, kw["causal"]))
        return real(q, k, v, ctx, **kw)

    monkeypatch.setattr(_torch_core_op, "core_forward", spy)
    model = protect(build(family))
    ids, mask = batch()
    step(model, ids, mask)
    padding = (True, (ids.shape[0] * HEADS, ids.shape[1]), causal)
    window = (False, None, False)
    assert set(calls) == ({padding, window} if family == "gpt-neo" else {padding})
    assert {c.last_core for c in attention_cores(model).values()} == {"fused"}


@pytest.mark.parametrize("projections", [True, False], ids=["projections", "attention-only"])
def test_a_protected_model_loads_in_a_fresh_process(tmp_path, projections):
    """``torch.save`` of a whole protected model, ``torch.load`` and a forward in a new
    interpreter (a checkpoint of the module, a worker ``torch.multiprocessing`` spawns with it):
    unpickling never imported :mod:`attention.hf`, which registers ``"abft"``, and the forward
    failed with transformers' "not a valid attention implementation"."""
    from fresh_python import run_python

    torch.manual_seed(0)
    model = protect(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=20)), projections=projections)
    model.eval()
    ids = torch.randint(0, 20, (2, 8))
    want = model(ids).logits
    torch.save({"model": model, "ids": ids, "want": want}, tmp_path / "m.pt")
    run_python("-c", "import torch; s = torch.load(%r, weights_only=False); "
               "torch.testing.assert_close(s['model'](s['ids']).logits, s['want'], rtol=0, "
               "atol=0); assert s['model'].config._attn_implementation == 'abft'"
               % str(tmp_path / "m.pt"))


@pytest.mark.parametrize("family", FAMILIES)
def test_one_model_serves_several_threads_with_and_without_weights(family):
    """One protected model called from four threads at once, two of them asking for the
    attention weights: each call's logits are the single-threaded ones, with weights exactly where
    asked. GPT-Neo's protected attention kept "weights asked for" on the module, which every
    thread shared: a call got none though it asked, and a thread's clean-up failed with
    ``AttributeError`` after another's."""
    import threading

    model = protect(build(family).eval())
    ids, mask = batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    start, failed = threading.Barrier(4), []

    def worker(weights):
        start.wait()
        try:
            for _ in range(3):
                with torch.no_grad():
                    out = model(ids, attention_mask=mask, output_attentions=weights)
                assert_close(out.logits, want, name="logits")
                assert all((a is not None) == weights for a in out.attentions or [None]), \
                    f"output_attentions={weights}"
        except Exception as exc:  # reported by the test's thread
            failed.append(exc)

    threads = [threading.Thread(target=worker, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed
