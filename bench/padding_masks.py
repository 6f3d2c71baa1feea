"""The protected attention product with a padded batch's boolean mask, through PyTorch.

Usage::

    PYTHONPATH=. python bench/padding_masks.py [--seq 1024] [--causal] [--window W] [--repeats 7]

``attention.torch_functional.attention_core`` on (8, 4, seq, 64) float32 tensors, forward and
backward, with the mask Hugging Face passes for a padded batch (item ``b`` holds ``seq - (seq //
2) b // 8`` tokens; ``--causal`` adds the causal triangle, as GPT-2's; ``--window W`` hides keys
``W`` or more positions from the query, a sliding window, as Mistral's or GPT-Neo's local layers:
then the mask is no longer key padding and goes on whole, one per batch item): the median wall
time of
``--repeats`` calls, NumPy's peak allocation in one more call (``tracemalloc``) and the core
that ran. Run it in two checkouts, one after the other and again, to compare commits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from attention.torch_functional import Protection, attention_core  # noqa: E402
from bench.timing import device_name  # noqa: E402

BATCH, HEADS, DIM = 8, 4, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, args.seq, DIM, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([args.seq - (args.seq // 2) * b // BATCH for b in range(BATCH)])
    hidden = (torch.arange(args.seq) >= lengths[:, None])[:, None, None, :]
    if args.causal:
        hidden = hidden | torch.ones(args.seq, args.seq, dtype=torch.bool).triu(1)
    else:
        hidden = hidden.expand(BATCH, 1, args.seq, args.seq)
    if args.window:
        position = torch.arange(args.seq)
        hidden = hidden | ((position[:, None] - position[None, :]).abs() >= args.window)
    protection = Protection()

    def run() -> None:
        out, _ = attention_core(q, k, v, protection=protection, attn_mask=hidden)
        out.sum().backward()

    run()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    tracemalloc.start()
    run()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    kind = ("causal" if args.causal else "bidirectional") + (
        f", window {args.window}" if args.window else "")
    print(f"{device_name()}: ({BATCH}, {HEADS}, {args.seq}, {DIM}) {kind}, padded: "
          f"{statistics.median(times):.1f} ms fwd+bwd (median of {args.repeats}), NumPy peak "
          f"{peak / 2 ** 20:.1f} MiB, core {protection.last_core}")


if __name__ == "__main__":
    main()
