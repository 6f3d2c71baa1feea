"""Training step of a tiny Hugging Face GPT-2 and BERT (and Llama): protected against "sdpa" and
"eager".

Usage::

    python bench/hf_step.py [--layers 4] [--width 256] [--heads 4] [--seq 128] [--batch 8]
                            [--repeats 5] [--padded] [--cpu-time] [--families gpt2,bert,llama]
                            [--json PATH]

Models are built from configs in code (random weights and token ids, dropout 0, fp32, CPU;
Llama with ``heads // 2`` key/value heads and a gated feed-forward layer of ``8 width / 3``). Each
implementation's forward + backward + SGD step is timed in interleaved rounds (load that comes and
goes hits each alike); the median of ``--repeats`` rounds is printed with the ratios, the CPU and
``/proc/loadavg`` (other work on the machine shows there). Protected variants, each against
"sdpa": ``attention`` (the attention products only: ``protect(model, projections=False)``),
``projections`` (those and the Q, K, V and output projections: ``protect(model)``) and ``mlp``
(the feed-forward layers too: ``protect(model, mlp=True)``). ``--padded`` passes a padding mask:
item ``b`` of the batch holds ``seq - (seq // 2) b // batch`` tokens, the rest padding (a padded
batch of sentences of different lengths). ``--cpu-time`` runs PyTorch and the
library on one thread (``abftgemm.set_threads(1)``) and times the CPU time of that thread
(``time.thread_time``): the work a step does, which other load on the machine inflates far less
than wall time, but without what a second thread gains. ``--json`` also writes the settings, the
CPU, the load before and after, every round's time and the medians to a file.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _models(family: str, args: argparse.Namespace) -> dict:
    import transformers as t

    from attention.hf import core_of
    from attention.torch import protect

    if family == "gpt2":
        cfg = t.GPT2Config(vocab_size=1000, n_embd=args.width, n_layer=args.layers,
                           n_head=args.heads, n_positions=args.seq, attn_pdrop=0.0,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="sdpa")
        base = t.GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = t.LlamaConfig(vocab_size=1000, hidden_size=args.width, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads,
                            num_key_value_heads=max(1, args.heads // 2),
                            intermediate_size=8 * args.width // 3,
                            max_position_embeddings=args.seq, attn_implementation="sdpa")
        base = t.LlamaForCausalLM(cfg)
    else:
        cfg = t.BertConfig(vocab_size=1000, hidden_size=args.width, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, intermediate_size=4 * args.width,
                           max_position_embeddings=args.seq, attention_probs_dropout_prob=0.0,
                           hidden_dropout_prob=0.0, attn_implementation="sdpa")
        base = t.BertForMaskedLM(cfg)
    eager = copy.deepcopy(base)
    eager.set_attn_implementation("eager")
    unfused = protect(copy.deepcopy(base))
    for module in unfused.modules():
        if "abft_core" in module.__dict__:
            core_of(module).core = "unfused"
    return {"sdpa": base, "eager": eager,
            "attention": protect(copy.deepcopy(base), projections=False),
            "projections": protect(copy.deepcopy(base)), "unfused": unfused,
            "mlp": protect(copy.deepcopy(base), mlp=True)}


def main() -> None:
    import torch

    import abftgemm

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 4), ("width", 256), ("heads", 4), ("seq", 128),
                          ("batch", 8), ("repeats", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--padded", action="store_true",
                   help="a padding mask: the batch's items right-padded to lengths seq .. seq/2")
    p.add_argument("--cpu-time", action="store_true",
                   help="one PyTorch thread, timed by its CPU time (time.thread_time)")
    p.add_argument("--families", default="gpt2,bert",
                   help="comma-separated, of gpt2, bert and llama (default: gpt2,bert)")
    p.add_argument("--json", type=Path, help="also write the results to this file")
    args = p.parse_args()
    families = args.families.split(",")
    if not families or set(families) - {"gpt2", "bert", "llama"}:
        p.error(f"--families takes gpt2, bert and llama, got {args.families!r}")
    if args.cpu_time:  # every thread's work on the timed one: PyTorch's and the library's
        torch.set_num_threads(1)
        abftgemm.set_threads(1)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (args.batch, args.seq))
    lengths = [args.seq - (args.seq // 2) * b // args.batch for b in range(args.batch)]
    mask = (torch.arange(args.seq) < torch.tensor(lengths)[:, None]).long() \
        if args.padded else None
    result = {"settings": {k: v for k, v in vars(args).items() if k != "json"},
              "cpu": _cpu_model(), "torch_threads": torch.get_num_threads(),
              "load_before": _load(), "families": {}}
    print(f"{result['cpu']}, torch threads {result['torch_threads']}, "
          f"load {result['load_before']}")
    for family in families:
        models = _models(family, args)
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        for round_ in range(args.repeats + 1):  # the first round warms up
            for k, m in models.items():
                start = clock()
                opts[k].zero_grad()
                m(ids, attention_mask=mask).logits.float().pow(2).mean().backward()
                opts[k].step()
                if round_:
                    times[k].append(clock() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{family}: " + ", ".join(f"{k} {1e3 * v:.0f} ms ({v / med['sdpa']:.2f}x)"
                                        for k, v in med.items()))
        result["families"][family] = {
            "seconds": times, "median_s": med,
            "ratio_to_sdpa": {k: v / med["sdpa"] for k, v in med.items()}}
    result["load_after"] = _load()
    print(f"load after {result['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


def _load() -> list[str]:
    """The load averages of ``/proc/loadavg`` (1, 5 and 15 minutes)."""
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
