"""Training step of a tiny Hugging Face GPT-2 and BERT: protected against "sdpa" and "eager".

Usage::

    python bench/hf_step.py [--layers 4] [--width 256] [--heads 4] [--seq 128] [--batch 8]
                            [--repeats 5]

Models are built from configs in code (random weights and token ids, dropout 0, fp32, CPU). Each
implementation's forward + backward + SGD step is timed in interleaved rounds (load that comes and
goes hits each alike); the median of ``--repeats`` rounds is printed with the ratios, the CPU and
``/proc/loadavg`` (other work on the machine shows there). Protected variants, each against
"sdpa": ``attention`` (the attention products only: ``protect(model, projections=False)``),
``projections`` (those and the Q, K, V and output projections: ``protect(model)``) and ``mlp``
(the feed-forward layers too: ``protect(model, mlp=True)``).
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _models(family: str, args: argparse.Namespace) -> dict:
    import transformers as t

    from attention.torch import protect

    if family == "gpt2":
        cfg = t.GPT2Config(vocab_size=1000, n_embd=args.width, n_layer=args.layers,
                           n_head=args.heads, n_positions=args.seq, attn_pdrop=0.0,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="sdpa")
        base = t.GPT2LMHeadModel(cfg)
    else:
        cfg = t.BertConfig(vocab_size=1000, hidden_size=args.width, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, intermediate_size=4 * args.width,
                           max_position_embeddings=args.seq, attention_probs_dropout_prob=0.0,
                           hidden_dropout_prob=0.0, attn_implementation="sdpa")
        base = t.BertForMaskedLM(cfg)
    eager = copy.deepcopy(base)
    eager.set_attn_implementation("eager")
    return {"sdpa": base, "eager": eager,
            "attention": protect(copy.deepcopy(base), projections=False),
            "projections": protect(copy.deepcopy(base)),
            "mlp": protect(copy.deepcopy(base), mlp=True)}


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 4), ("width", 256), ("heads", 4), ("seq", 128),
                          ("batch", 8), ("repeats", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (args.batch, args.seq))
    print(f"{platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, load {open('/proc/loadavg').read().split()[:3]}")
    for family in ("gpt2", "bert"):
        models = _models(family, args)
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        for round_ in range(args.repeats + 1):  # the first round warms up
            for k, m in models.items():
                start = time.perf_counter()
                opts[k].zero_grad()
                m(ids).logits.float().pow(2).mean().backward()
                opts[k].step()
                if round_:
                    times[k].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{family}: " + ", ".join(f"{k} {1e3 * v:.0f} ms ({v / med['sdpa']:.2f}x)"
                                        for k, v in med.items()))
    print(f"load after {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
