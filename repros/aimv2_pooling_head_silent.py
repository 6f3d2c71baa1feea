"""AIMv2's attention pooling head computes its attention with F.scaled_dot_product_attention in
its own forward: protect() leaves it unprotected (it cannot reach it) and said nothing, though
the docs promise a warning naming such modules (its class name does not end in "Attention")."""
import warnings, copy, torch, transformers as t
from attention.torch import protect, protected_cores
cfg = t.Aimv2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4, use_head=True, attn_implementation="eager")
torch.manual_seed(0)
m = t.Aimv2VisionModel(cfg)
print([n for n, x in m.named_modules() if "head" in n][:5])
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    p = protect(copy.deepcopy(m))
print("warnings:", [str(x.message) for x in w])
print(sorted(protected_cores(p))[:20])
