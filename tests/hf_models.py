"""Tiny Hugging Face transformers models of the four families the seed paper used (BERT,
RoBERTa, GPT-2, GPT-Neo) and of Llama, a padded batch, one training step's outputs, and the
comparisons and fault injector the transformers tests share. Importing it skips the importing test module
without PyTorch, or without a transformers that has ``AttentionInterface`` (the [hf] extra)."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]')")
if not hasattr(transformers, "AttentionInterface"):
    pytest.skip(f"transformers {transformers.__version__} has no AttentionInterface "
                "(the [hf] extra needs >= 5.17)", allow_module_level=True)

from abftgemm.faults import Fault  # noqa: E402
from attention.experiments import hf_models  # noqa: E402

FAMILIES = hf_models.FAMILIES
VOCAB, WIDTH, HEADS, SEQ = 100, 32, 4, 12
#: fp32 models: worst |protected - eager| over a tensor, relative to its largest |eager| element
#: (reassociated sums through two layers; measured up to ~1e-6).
RTOL32 = 1e-5
#: 16-bit autocast: a few units of the dtype's roundoff (bfloat16 2^-8, float16 2^-11) of the
#: largest element (both models round every product and activation to the dtype, in different
#: orders; GPT-Neo's float16 out_proj.bias gradient, a sum over the batch's tokens, reached 5.5
#: units with an Intel Xeon's AVX-512 BLAS kernels).
RTOL_16 = {torch.bfloat16: 5 * 2.0 ** -8, torch.float16: 8 * 2.0 ** -11}
#: float16 gradients of tiny models fall below its smallest normal number (2^-14), where it keeps
#: an absolute spacing of 2^-24: a few of those spacings per element, summed over the batch's
#: tokens (measured up to 9 x 2^-24). bfloat16 has float32's range.
ATOL_16 = {torch.bfloat16: 0.0, torch.float16: 16 * 2.0 ** -24}


def build(family, attn_dropout=0.0):
    """A 2-layer, width-32 model of ``family`` with random weights, eager attention, dropout 0
    (attention dropout ``attn_dropout``), built as the ``abft`` experiments build theirs."""
    return hf_models.build(family, vocab=VOCAB, seq=SEQ, d_model=WIDTH, n_heads=HEADS,
                           n_layers=2, d_ff=2 * WIDTH, seed=0, dropout=attn_dropout)


def batch():
    """Token ids (3, SEQ) and a padding mask: item 0 full, items 1 and 2 right-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 5:] = 0
    return ids, mask


def step(model, ids, mask):
    """Logits at the real tokens and every parameter's gradient of a loss over them."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    logits[keep].pow(2).mean().backward()
    return logits[keep].detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                                   for n, p in model.named_parameters() if p.grad is not None}


def seq2seq_step(model, ids, mask):
    """Logits and every parameter's gradient of an encoder-decoder model's loss, its decoder fed
    the input ids."""
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits
    logits.pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()
                             if p.grad is not None}


def assert_close(actual, expected, rtol=RTOL32, floor=0.0, atol=0.0, name=""):
    """``|actual - expected| <= rtol * (max |expected| + floor) + atol`` element-wise at worst."""
    assert torch.isfinite(actual).all(), name
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item() + floor
    assert err <= rtol * scale + atol, \
        f"{name}: max error {err:.3g} > {rtol:.1g} * {scale:.3g} + {atol:.1g}"


def assert_same_step(got, want, rtol=RTOL32, atol=0.0):
    """Logits and gradients close; a gradient that is zero in exact arithmetic (the key bias's:
    softmax ignores a constant added to a row) is rounding noise, judged against 1e-3 of the
    model's largest gradient; ``atol``: an absolute error allowed besides (see ATOL_16)."""
    assert_close(got[0], want[0], rtol, name="logits")
    assert got[1].keys() == want[1].keys()
    largest = max(g.abs().max().item() for g in want[1].values())
    for name in want[1]:
        assert_close(got[1][name], want[1][name], rtol, floor=1e-3 * largest, atol=atol,
                     name=name)


@pytest.fixture(scope="module")
def eager_runs():
    """Each family's eager model and its step on the padded batch."""
    return {f: (m, step(m, *batch())) for f in FAMILIES for m in [build(f)]}


def layer0(family):
    """The name of layer 0's attention module (the one computing the attention product)."""
    return {"bert": "bert.encoder.layer.0.attention.self",
            "roberta": "roberta.encoder.layer.0.attention.self",
            "gpt2": "transformer.h.0.attn",
            "gpt-neo": "transformer.h.0.attn.attention",
            "llama": "model.layers.0.self_attn"}[family]


class OncePerSite:
    """Injects one ``kind`` fault (with ``Fault`` options such as ``magnitude``) into the first
    product of the site ``target`` names, or of every site of a module for a ``target`` ending
    in ``":"`` (transient faults)."""

    def __init__(self, target, kind="inf", **options):
        self.target, self.kind, self.options, self.hit = target, kind, options, []

    def __call__(self, site, c):
        match = site.startswith(self.target) if self.target.endswith(":") else \
            site == self.target
        if match and site not in self.hit:
            self.hit.append(site)
            Fault(self.kind, "element", seed=len(self.hit), **self.options)(site, c)


def assert_fault_repaired(model, cores, name, site, clean, want, kind="inf", **options):
    """A step with one ``kind`` fault (:class:`OncePerSite`) at ``site`` of the module ``name``:
    the hook hits it once, the module's core (``cores(model)[name]``) reports that site alone,
    corrected or recomputed, and the step equals the fault-free one, ``clean``, and eager's,
    ``want``."""
    from attention.torch import fault_hook

    inject = OncePerSite(f"{name}:{site}", kind, **options)
    with fault_hook(model, inject):
        got = step(model, *batch())
    assert inject.hit == [f"{name}:{site}"]
    report = cores(model)[name].last_report
    assert [e.site for e in report.events] == [site], report.summary()
    assert report.events[0].action in ("corrected", "recomputed"), report.summary()
    assert_same_step(got, clean)
    assert_same_step(got, want)
