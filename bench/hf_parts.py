"""The parts of a protected Hugging Face training step, each against its unprotected PyTorch
counterpart: one projection and one attention product at the tiny models' shapes of
``bench/hf_step.py`` (width 256, 4 heads, sequence 128, batch 8), forward + backward.

- ``linear``: ``nn.Linear(width, width)`` on ``(batch, seq, width)``: ``plain`` (PyTorch),
  ``off`` (the protected layer with ``check="off"``: the wrapper alone) and ``checked``;
- ``attention``: the attention product ``(batch, heads, seq, width / heads)``, causal (GPT-2) and
  not (BERT): ``sdpa`` (PyTorch's ``scaled_dot_product_attention``), the protected core
  (:class:`attention.torch_core.ProtectedCore`, what the ``"abft"`` attention calls) on the fused
  core checked and with ``check="off"``, and on the unfused core checked.

One thread (PyTorch's and the library's), timed by that thread's CPU time in interleaved rounds
(``bench.timing.time_many``); prints the medians, the ratio to the unprotected part and the
load. A step of ``bench/hf_step.py`` runs, per layer, four projections (BERT; GPT-2: a fused
QKV projection three times as wide and one) and one attention product.

    PYTHONPATH=. python bench/hf_parts.py [--repeats 15] [--width 256] [--heads 4] [--seq 128]
                                          [--batch 8]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import abftgemm  # noqa: E402
from attention.torch_core import ProtectedCore  # noqa: E402
from attention.torch_linear import ProtectedLinearCore  # noqa: E402
from bench.timing import device_name, time_many  # noqa: E402


def _linear_cases(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    plain = torch.nn.Linear(args.width, args.width)
    x = torch.randn(args.batch, args.seq, args.width, requires_grad=True)
    dy = torch.randn(args.batch, args.seq, args.width)

    def protected(check: str) -> Callable[[], None]:  # what a protected nn.Linear runs
        core = ProtectedLinearCore(check)
        return lambda: core(x, plain.weight, plain.bias, weight_in_out=False).backward(dy)

    return {"plain": lambda: plain(x).backward(dy), "off": protected("off"),
            "checked": protected("correct")}


def _attention_cases(args: argparse.Namespace, causal: bool) -> dict[str, Callable[[], None]]:
    shape = (args.batch, args.heads, args.seq, args.width // args.heads)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    do = torch.randn(shape)

    def sdpa() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(do)

    def protected(core: ProtectedCore) -> Callable[[], None]:
        return lambda: core(q, k, v, None, None, causal)[0].backward(do)

    return {"sdpa": sdpa,
            "fused checked": protected(ProtectedCore(core="fused")),
            "fused off": protected(ProtectedCore(core="fused", check="off")),
            "unfused checked": protected(ProtectedCore(core="unfused"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("repeats", 15), ("width", 256), ("heads", 4), ("seq", 128),
                          ("batch", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    torch.set_num_threads(1)
    abftgemm.set_threads(1)
    torch.manual_seed(0)
    with open("/proc/loadavg") as f:
        print(f"{device_name()}, one thread's CPU time (ms, median of {args.repeats}), "
              f"load {f.read().split()[:3]}")
    for title, cases in (("linear", _linear_cases(args)),
                         ("attention, causal", _attention_cases(args, True)),
                         ("attention, not causal", _attention_cases(args, False))):
        ms = time_many(cases, args.repeats, 2, gpu=False, clock=time.thread_time)
        base = next(iter(ms.values()))
        print(f"{title}: " + ", ".join(f"{k} {v:.2f} ({v / base:.2f}x)" for k, v in ms.items()))


if __name__ == "__main__":
    main()
