"""A model without sdpa support (here CLAP's and ALIGN's BERT-like text encoders) runs on
"abft_eager_masks". Without padding, transformers' eager mask builder hands the attention no
mask (nothing to hide); eager then attends to every key, but the protected attention took the
missing `is_causal` attribute of these modules as True and made the encoder causal."""
import copy

import torch
import transformers

from attention.torch import protect

for config_cls, model_cls in ((transformers.ClapTextConfig, transformers.ClapTextModel),
                              (transformers.AlignTextConfig, transformers.AlignTextModel)):
    torch.manual_seed(0)
    eager = model_cls(config_cls(vocab_size=100, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 attn_implementation="eager")).eval()
    model = protect(copy.deepcopy(eager))
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = (m(ids, attention_mask=torch.ones_like(ids)).last_hidden_state
                     for m in (eager, model))
    print(f"{model_cls.__name__}: {model.config._attn_implementation}, "
          f"max |protected - eager| = {(got - want).abs().max().item():.2e}")
