"""``protect`` on transformers architectures beyond the five families of tests/test_hf.py: every
model whose attention calls transformers' ``AttentionInterface`` runs protected, forward and
backward, equal to its eager self (tiny configurations built in code, a padded batch, train mode
with dropout 0); architectures the protected product cannot honour are refused with a clear
error and left unchanged."""
import contextlib
import copy
import re

import pytest

from hf_models import torch, transformers  # skips this module without them

from attention.hf import EAGER_MASKS, name_for  # noqa: E402
from attention.hf_protect import attention_cores  # noqa: E402
from attention.torch import protect  # noqa: E402
from hf_models import (VOCAB, assert_close, assert_same_step, batch, seq2seq_step,  # noqa: E402
                       step)

#: name: (config class, model class, config arguments besides the vocabulary and eager
#: attention); 2 layers, width 32, 4 heads (2 key/value heads where the model has the option),
#: dropout 0.
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)
BERT_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", LLAMA_LIKE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", LLAMA_LIKE),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", LLAMA_LIKE),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(LLAMA_LIKE, head_dim=8, sliding_window=4)),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(BERT_LIKE, bos_token_id=0, eos_token_id=0)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, bos_token_id=0, eos_token_id=0)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                 word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                 eos_token_id=0, pad_token_id=1)),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    bos_token_id=0, eos_token_id=0)),
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM",
                   dict(BERT_LIKE, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                        cls_token_id=0, sep_token_id=0, global_attn_every_n_layers=2,
                        local_attention=4)),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM",
                   dict(dim=32, hidden_dim=64, n_layers=2, n_heads=4, dropout=0.0,
                        attention_dropout=0.0)),
    "albert": ("AlbertConfig", "AlbertForMaskedLM",
               dict(BERT_LIKE, **NO_DROPOUT, embedding_size=16)),
    "electra": ("ElectraConfig", "ElectraForMaskedLM",
                dict(BERT_LIKE, **NO_DROPOUT, embedding_size=16)),
    # Its self-attention calls the attention function without an is_causal flag.
    "layoutlm": ("LayoutLMConfig", "LayoutLMForMaskedLM", dict(BERT_LIKE, **NO_DROPOUT)),
    # Attention sinks (a learned logit per head, s_aux), mixture of experts, sliding windows.
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(LLAMA_LIKE, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    # Heads split by a view of the attention output (it must be contiguous).
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM",
               dict(hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
                    intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                    bos_token_id=0, eos_token_id=0)),
    # Multi-head latent attention: value heads narrower than query and key heads (8 and 16).
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(LLAMA_LIKE, num_key_value_heads=4, moe_intermediate_size=16,
                         n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1)),
}


def _build(name):
    config_name, model_name, options = ARCHITECTURES[name]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=VOCAB, attn_implementation="eager",
                                                **options)
    return getattr(transformers, model_name)(config).train()


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_equals_eager_with_padding_in_train_mode(name):
    eager = _build(name)
    try:
        model = protect(copy.deepcopy(eager))
    except ValueError as exc:  # refused with this error only where it does not use it
        if "does not call the attention function" not in str(exc):
            raise
        pytest.skip(f"transformers {transformers.__version__}: {name} has no AttentionInterface")
    assert model.config._attn_implementation == name_for(model)
    want = step(eager, *batch())
    assert_same_step(step(model, *batch()), want)
    cores = attention_cores(model).values()
    assert cores and all(c.last_report.checked for c in cores)
    assert all(not c.last_report.events for c in cores)


def test_vision_transformer_equals_eager():
    config = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, image_size=16, patch_size=4,
                                    attn_implementation="eager", num_labels=3)
    torch.manual_seed(0)
    eager = transformers.ViTForImageClassification(config).train()
    model = protect(copy.deepcopy(eager))
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    runs = []
    for m in (eager, model):
        logits = m(pixel_values=pixels).logits
        logits.pow(2).mean().backward()
        runs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert_same_step(runs[1], runs[0])
    assert {c.last_core for c in attention_cores(model).values()} == {"fused"}


SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
               decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2,
               attn_implementation="eager")


@pytest.mark.parametrize("name,config,model,options", [
    # its decoder's attention modules say is_causal=False: the causal triangle is in the mask
    ("pegasus-x", "PegasusXConfig", "PegasusXForConditionalGeneration",
     dict(block_size=4, num_global_tokens=2)),
    # its encoder's own attention adds the mask to its scores
    ("bigbird-pegasus", "BigBirdPegasusConfig", "BigBirdPegasusForConditionalGeneration",
     dict(attention_type="original_full")),
    # its router reads the padding from the mask
    ("nllb-moe", "NllbMoeConfig", "NllbMoeForConditionalGeneration",
     dict(num_experts=4, expert_capacity=64, encoder_sparse_step=2, decoder_sparse_step=2,
          router_dtype="float32")),
])
def test_models_written_for_eager_masks_get_them(name, config, model, options):
    """Models without sdpa support (``_supports_sdpa = False``) read transformers' masks as eager
    makes them: given sdpa's (boolean, or none for a causal product) they computed wrong values
    silently (PEGASUS-X's decoder saw future tokens; BigBirdPegasus's encoder added the boolean
    mask; NLLB-MoE routed the padding and dropped real tokens). They run on
    ``"abft_eager_masks"``, equal to eager with a padded batch, their decoder causal."""
    if not hasattr(transformers, model):
        pytest.skip(f"transformers {transformers.__version__} has no {model}")
    torch.manual_seed(0)
    eager = getattr(transformers, model)(getattr(transformers, config)(**SEQ2SEQ, **options))
    # PEGASUS-X's block attention and BigBirdPegasus's encoder compute theirs themselves
    with pytest.warns(UserWarning, match="run unprotected") if name != "nllb-moe" else \
            contextlib.nullcontext():
        protected = protect(copy.deepcopy(eager))
    assert protected.config._attn_implementation == EAGER_MASKS
    ids, mask = batch()
    later = ids.clone()
    later[:, -1] = 5  # only the last decoder token changes
    runs = []
    for m in (eager.eval(), protected.eval()):  # (NLLB-MoE's router draws noise in training)
        logits = m(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits
        logits.pow(2).mean().backward()
        runs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()
                                       if p.grad is not None}))
        if name != "nllb-moe":  # (its experts' capacity couples the positions)
            with torch.no_grad():
                moved = m(input_ids=ids, attention_mask=mask, decoder_input_ids=later).logits
            assert torch.equal(moved[:, :-1], logits[:, :-1].detach())
    assert_same_step(runs[1], runs[0])
    assert any(c.last_report.checked for c in attention_cores(protected).values())


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", ["ClapText", "AlignText"])
def test_eager_masks_of_text_encoders(name, padded, monkeypatch):
    """Without padding, transformers' eager mask builder hands the attention no mask. CLAP's and
    ALIGN's text encoders (no sdpa support, attention modules without an ``is_causal`` flag) ran
    causal there under ``"abft_eager_masks"``; eager attends to every key. A padded batch's
    eager masks (float, ``(B, 1, L, S)``, the same in every query row) reach the core as its
    per-key additive mask ``key_add`` ``(B * heads, S)``, not as an ``L x S`` array per head.
    Either way the step equals eager's."""
    if not hasattr(transformers, f"{name}Model"):
        pytest.skip(f"transformers {transformers.__version__} has no {name}Model")
    from attention import _torch_core_op
    calls = []
    real = _torch_core_op.core_forward

    def spy(q, k, v, ctx, **kw):
        keys = kw.get("key_add")
        calls.append((kw.get("attn_mask") is None, None if keys is None else keys.shape))
        return real(q, k, v, ctx, **kw)

    monkeypatch.setattr(_torch_core_op, "core_forward", spy)
    config = getattr(transformers, f"{name}Config")(vocab_size=VOCAB, **BERT_LIKE, **NO_DROPOUT,
                                                    attn_implementation="eager")
    torch.manual_seed(0)
    eager = getattr(transformers, f"{name}Model")(config).train()
    model = protect(copy.deepcopy(eager))
    assert model.config._attn_implementation == EAGER_MASKS
    ids, mask = batch()
    mask = mask if padded else torch.ones_like(ids)
    # (a squared layer norm's output would have a gradient of rounding noise alone)
    weights = torch.randn(*ids.shape, 32, generator=torch.Generator().manual_seed(2))
    runs = []
    for m in (eager, model):
        hidden = m(ids, attention_mask=mask).last_hidden_state * mask[..., None]
        (hidden * weights).sum().backward()
        runs.append((hidden.detach(), {n: p.grad for n, p in m.named_parameters()
                                       if p.grad is not None}))
    assert_same_step(runs[1], runs[0])
    rows = ids.shape[0] * config.num_attention_heads
    assert set(calls) == {(True, (rows, ids.shape[1]) if padded else None)}
    assert {c.last_core for c in attention_cores(model).values()} == {"fused"}


def _mllama_text_config():
    """A tiny Mllama text model's config, its layer 1 a cross-attention layer."""
    if not hasattr(transformers, "MllamaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Mllama")
    return transformers.MllamaTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1],
        pad_token_id=0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")


def test_an_attention_module_behind_a_decorator_is_found():
    """Mllama's text cross-attention names the attention function inside a decorated forward:
    it was missed (no core at protect, so a ``check="detect"`` model ran it with a default
    ``"correct"`` core made at first use, and its projections unprotected)."""
    config = _mllama_text_config()
    torch.manual_seed(0)
    model = protect(transformers.MllamaForCausalLM(config), check="detect")
    cores = attention_cores(model)
    assert "model.layers.1.cross_attn" in cores
    assert {c.check for c in cores.values()} == {"detect"}
    from attention.hf_linear import projection_cores
    assert any("cross_attn" in n for n in projection_cores(model))


def test_t5_trains_its_relative_position_bias_equal_to_eager():
    """T5 adds a learned relative position bias to the scores: its gradient (the core's checked
    dS, through the unfused core) equals eager's, as does a greedy generation."""
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2,
                                   num_heads=4, d_kv=8, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    eager = transformers.T5ForConditionalGeneration(config).train()
    try:
        model = protect(copy.deepcopy(eager))
    except ValueError as exc:  # older transformers keep T5's stacks on their own implementation
        if not re.search("left .* attention modules", str(exc)):
            raise
        pytest.skip(f"transformers {transformers.__version__}: {exc}")
    ids, mask = batch()
    runs = [seq2seq_step(m, ids, mask) for m in (eager, model)]
    assert_same_step(runs[1], runs[0])
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert runs[1][1][bias].abs().sum() > 0
    cores = attention_cores(model).values()
    assert "unfused" in {c.last_core for c in cores}  # where the bias wants its gradient
    assert all(c.last_report.checked and not c.last_report.events for c in cores)
    with torch.no_grad():
        generated = [m.eval().generate(ids, attention_mask=mask, max_new_tokens=4,
                                       do_sample=False) for m in (eager, model)]
    assert torch.equal(*generated)


@pytest.mark.parametrize("name,match", [
    ("gemma2", "softcap"),  # the scores' tanh cap is not part of the protected product
    ("bloom", "does not call the attention function"),  # ALiBi inside its own attention module
    # an indexer selects each query's keys (sparse attention); it was accepted, and every
    # forward of the switched model then raised
    ("deepseek-v3.2", "'indices'"),
])
def test_refused_with_a_clear_error(name, match):
    config_class, model_class, options = {
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
        "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_layer=2, n_head=4)),
        "deepseek-v3.2": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                          dict(ARCHITECTURES["deepseek-v3"][2], index_topk=4, index_head_dim=16,
                               index_n_heads=2)),
    }[name]
    if not hasattr(transformers, model_class):
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(
        vocab_size=VOCAB, attn_implementation="eager", **options))
    ids, mask = batch()
    inputs = dict(input_ids=ids, attention_mask=mask)
    try:
        protect(model)
    except ValueError as exc:  # refused at protect: nothing changed
        assert re.search(match, str(exc)), exc
        assert model.config._attn_implementation == "eager"
        return
    assert name not in ("gemma2", "deepseek-v3.2"), "seen in the modules: refused at protect"
    with pytest.raises(ValueError, match=match):  # refused at the first call
        model(**inputs)


def test_attention_the_model_computes_itself_is_named_in_a_warning():
    """LongT5's local attention computes its scores itself (no registered attention function):
    its model is protected where it can be (the decoder), and ``protect`` warns which attention
    modules run unprotected (it said nothing)."""
    if not hasattr(transformers, "LongT5ForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no LongT5")
    config = transformers.LongT5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        encoder_attention_type="local", local_radius=4, attn_implementation="eager")
    with pytest.warns(UserWarning, match=r"2 attention modules .* run unprotected "
                                         r"\('encoder\.block\.0\.layer\.0\.LocalSelfAttention'"):
        model = protect(transformers.LongT5ForConditionalGeneration(config))
    assert attention_cores(model) and not any(n.startswith("encoder") for n in
                                              attention_cores(model))


def test_attention_a_module_computes_with_sdpa_itself_is_named_in_a_warning():
    """AIMv2's attention pooling head (a class not named ``...Attention``) calls
    ``scaled_dot_product_attention`` in its own forward: it runs unprotected, and ``protect``
    said nothing."""
    if not hasattr(transformers, "Aimv2VisionModel"):
        pytest.skip(f"transformers {transformers.__version__} has no AIMv2")
    config = transformers.Aimv2VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=16, patch_size=4, use_head=True, attn_implementation="eager")
    with pytest.warns(UserWarning, match=r"1 attention modules .* run unprotected \('head'"):
        model = protect(transformers.Aimv2VisionModel(config))
    assert "encoder.layers.0.attention" in attention_cores(model)


@pytest.mark.parametrize("name,mlp,first", [
    # mixture of attention heads: its query and output projections are experts' weights
    ("jetmoe", False, "model.layers.0.self_attention.experts.input_linear"),
    # mixture of experts: the feed-forward experts and their router
    ("gpt-oss", True, "model.layers.0.mlp.router"),
    ("deepseek-v3", True, "model.layers.1.mlp.experts"),
])
def test_weights_protect_cannot_reach_are_named_in_a_warning(name, mlp, first):
    """Projections held as weights of modules other than ``nn.Linear`` (JetMoE's attention
    experts, the experts and routers of mixture-of-experts feed-forward layers) run
    unprotected: ``protect`` said nothing (JetMoE's query and output projections, every
    expert with ``mlp=True``). It warns, naming them; what it protects is unchanged."""
    eager = _build(name)
    with pytest.warns(UserWarning, match=r"\d+ modules .* hold weights that run unprotected "
                                         rf"\({re.escape(repr(first))} first"):
        model = protect(copy.deepcopy(eager), mlp=mlp)
    assert_same_step(step(model, *batch()), step(eager, *batch()))


@pytest.mark.parametrize("name", ["gpt-oss", "qwen2"])
def test_protect_warns_of_nothing_it_protects(name):
    """No warning where every weight in the protected scope is protected (gpt-oss's experts
    lie outside its attention blocks)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        protect(_build(name))


def test_a_sub_model_written_for_eager_masks_gets_them():
    """Gemma 4's audio tower does not support sdpa (its chunked attention reads eager's float
    mask), though the model around it does: ``protect`` switched it to ``"abft"`` with the rest,
    and its forward failed on sdpa's boolean mask (``TypeError``). Each sub-model gets the
    protected implementation it supports: the audio tower eager's masks, equal to eager."""
    if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    config = transformers.Gemma4Config(
        text_config=dict(LLAMA_LIKE, vocab_size=300, head_dim=8, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, head_dim=8),
        audio_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          subsampling_conv_channels=(8, 4), output_proj_dims=32,
                          attention_chunk_size=4, attention_context_left=5,
                          attention_context_right=0),
        attn_implementation="eager")
    torch.manual_seed(0)
    eager = transformers.Gemma4ForConditionalGeneration(config).eval()
    with pytest.warns(UserWarning, match="run unprotected"):  # the audio tower's attention
        model = protect(copy.deepcopy(eager))
    assert model.config._attn_implementation == "abft"
    assert model.config.audio_config._attn_implementation == EAGER_MASKS
    features = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, 30:] = False
    ids, mask = batch()
    with torch.no_grad():
        audio, logits = ([m.model.audio_tower(features, attention_mask=valid).last_hidden_state
                          for m in (eager, model)],
                         [m(input_ids=ids, attention_mask=mask).logits for m in (eager, model)])
    assert_close(audio[1], audio[0], name="audio tower")
    keep = mask.bool()
    assert_close(logits[1][keep], logits[0][keep], name="logits")


def test_an_attention_module_without_a_causal_flag_is_not_causal():
    """Mllama's text cross-attention has no ``is_causal`` flag and, without a cross-attention
    mask, gets no mask: it ran causal (sdpa's default for a module without the flag; each text
    token saw only the first image tokens), where eager attends to every key. A module without
    the flag is not causal: the step equals eager's."""
    config = _mllama_text_config()
    torch.manual_seed(0)
    eager = transformers.MllamaForCausalLM(config).train()
    with torch.no_grad():  # (zero at initialization: the cross-attention would add nothing)
        eager.model.layers[1].cross_attn_attn_gate.fill_(0.5)
    model = protect(copy.deepcopy(eager))
    ids, mask = batch()
    image = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(2))
    runs = []
    for m in (eager, model):
        logits = m(input_ids=ids, attention_mask=mask, cross_attention_states=image).logits
        logits[mask.bool()].pow(2).mean().backward()
        runs.append((logits[mask.bool()].detach(),
                     {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert_same_step(runs[1], runs[0])
