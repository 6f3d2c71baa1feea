"""``protect`` on transformers models inside other modules: a training wrapper's and a PEFT
``PeftModel``'s (LoRA, the usual way to fine-tune one), either order of protect and LoRA, a
wrapper that also holds an ``nn.MultiheadAttention``, and modules under accelerate's hooks; and
a model with nothing to protect refused with a clear error."""
import copy

import pytest

from hf_models import torch, transformers  # noqa: F401  (skips this module without them)

from attention.hf_protect import attention_cores  # noqa: E402
from attention.torch import MultiheadAttention, protect, protected_cores  # noqa: E402
from hf_models import assert_fault_repaired, assert_same_step, batch, build, step  # noqa: E402


class Wrapper(torch.nn.Module):
    """A training wrapper holding a transformers model (as Lightning modules do)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, attention_mask=None):
        return self.lm(ids, attention_mask=attention_mask)


def test_a_wrapped_transformers_model_is_protected():
    eager = Wrapper(build("llama"))
    want = step(eager, *batch())
    model = protect(copy.deepcopy(eager), mlp=True)
    assert model.lm.config._attn_implementation == "abft"
    assert_same_step(step(model, *batch()), want)
    name = "lm.model.layers.0.self_attn"
    assert_fault_repaired(model, attention_cores, name, "scores", want, want)


class Pooled(torch.nn.Module):
    """A transformers encoder with an attention-pooling head of PyTorch's own."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.pool = lm, torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, ids, attention_mask=None):
        h = self.lm(ids, attention_mask=attention_mask).last_hidden_state
        return self.pool(h[:, :1], h, h, need_weights=False)[0]


def test_a_wrapper_of_a_transformers_model_and_an_attention_head_is_protected_whole():
    model = protect(Pooled(build("bert").bert))
    assert isinstance(model.pool, MultiheadAttention)
    assert model.lm.config._attn_implementation == "abft"
    model(*batch()).sum().backward()
    assert model.pool.last_report.checked and "pool" in protected_cores(model)


def test_modules_under_accelerate_hooks_run_protected():
    """accelerate's hooks (``device_map`` offloading, ``cpu_offload``) wrap a module's forward
    around the one saved before: after protect, that is the protected forward."""
    hooks = pytest.importorskip("accelerate.hooks", reason="accelerate is not installed")
    eager = build("gpt2")
    want = step(eager, *batch())
    model = copy.deepcopy(eager)
    for module in model.modules():
        hooks.add_hook_to_module(module, hooks.ModelHook())
    protect(model)
    assert_same_step(step(model, *batch()), want)
    cores = protected_cores(model)
    assert "transformer.h.0.attn.c_attn" in cores
    assert all(c.last_report.checked for c in cores.values())


def test_a_forward_set_on_a_module_is_refused():
    """A projection whose forward is set on the instance is refused, and the model is left as
    it was (the attention had been switched to "abft" before the projections were checked)."""
    model = build("gpt2")
    c_attn = model.transformer.h[0].attn.c_attn
    c_attn.forward = c_attn.forward  # the class's forward, frozen on the instance
    implementation, config = model.config._attn_implementation, model.config
    with pytest.raises(ValueError, match="forward set on the module itself"):
        protect(model)
    assert model.config is config and config._attn_implementation == implementation
    assert not protected_cores(model)


def test_a_refused_model_in_a_wrapper_leaves_every_model_as_it_was():
    """A wrapper holding two transformers models, one that ``protect`` refuses (BLOOM calls no
    registered attention function): nothing is protected (the first model was)."""
    gpt2 = build("gpt2")
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(
        n_layer=1, hidden_size=32, n_head=4, vocab_size=100))
    pair = torch.nn.ModuleDict({"student": gpt2, "teacher": bloom})
    implementation = gpt2.config._attn_implementation
    with pytest.raises(ValueError, match="BloomForCausalLM"):
        protect(pair)
    assert gpt2.config._attn_implementation == implementation and not protected_cores(pair)
    assert type(gpt2.transformer.h[0].attn.c_attn).__name__ == "Conv1D"


def test_nothing_to_protect_is_refused():
    with pytest.raises(ValueError, match="no nn.MultiheadAttention and no transformers model"):
        protect(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft's call
@pytest.mark.parametrize("order", ["protect, then LoRA", "LoRA, then protect"])
def test_lora_fine_tuning_equals_eager(order):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(5)
    eager = peft.get_peft_model(build("llama"), config)
    want = step(eager, *batch())
    torch.manual_seed(5)
    if order == "protect, then LoRA":
        model = peft.get_peft_model(protect(build("llama")), config)
    else:
        model = protect(peft.get_peft_model(build("llama"), config))
    got = step(model, *batch())
    assert_same_step(got, want)
    assert set(got[1]) == set(want[1])  # the LoRA weights alone train
    assert all("lora_" in name for name in got[1])
    cores = protected_cores(model)
    base = "base_model.model.model.layers.0.self_attn"
    assert f"{base}.q_proj.base_layer" in cores or f"{base}.q_proj" in cores
    if order == "LoRA, then protect":  # the adapters' own products are protected too
        assert f"{base}.q_proj.lora_A.default" in cores
    name = f"{base}"
    assert_fault_repaired(model, attention_cores, name, "d_q", want, want)


def test_copies_made_in_a_fault_hook_block_do_not_keep_the_hook(tmp_path):
    """``copy.deepcopy`` and ``torch.save`` of a protected model inside ``fault_hook``'s block
    (a snapshot, an EMA copy, a checkpoint): the save works with a hook defined in a function
    (it could not pickle it), and the copy runs without the hook after the block (it kept
    calling it)."""
    from attention.torch import fault_hook

    model = protect(build("gpt2"))
    seen = []
    with fault_hook(model, lambda site, c: seen.append(site)):
        twin = copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
    assert not any(core.fault_hook for core in protected_cores(twin).values())
    step(twin, *batch())
    assert not seen
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    step(loaded, *batch())
    assert not seen and all(c.last_report.checked for c in protected_cores(loaded).values())
