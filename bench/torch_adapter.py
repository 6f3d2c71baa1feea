"""What the PyTorch adapter costs: ``attention.torch.MultiheadAttention`` vs the bare layer.

Usage::

    python bench/torch_adapter.py [--device cpu|cuda] [--json PATH] [--repeats N] [--cases A,B]

Times forward + backward (self-attention, causal, ``need_weights=False``, gradients w.r.t. the
input and every parameter) of the adapter on torch tensors against the bare
:class:`attention.MultiHeadAttention` on NumPy/CuPy arrays holding the same weights and data, both
``check="correct"``, interleaved (:func:`bench.timing.time_many`). The adapter should add no
copies of activations: the target is ``ratio = adapter / bare <= 1.05``. PyTorch's own
``nn.MultiheadAttention`` on the same data is printed for reference. On CUDA every call ends with
a device synchronization (both sides), and wall time is measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from abftgemm.tensors import to_array  # noqa: E402
from attention import MultiHeadAttention  # noqa: E402
from attention.torch import MultiheadAttention  # noqa: E402
from bench import timing  # noqa: E402

#: (batch, heads, seq, head_dim)
CPU_CASES = {"small": (4, 4, 128, 32), "medium": (2, 8, 256, 64)}
GPU_CASES = {"bert-base": (8, 12, 512, 64), "bert-large": (8, 16, 512, 64)}


class Case:
    """The adapter, the bare layer and PyTorch's module on the same weights and data."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: str):
        b, h, s, hd = shape
        d = h * hd
        self.device = device
        torch.manual_seed(0)
        self.stock = torch.nn.MultiheadAttention(d, h, batch_first=True, dtype=dtype,
                                                 device=device)
        self.adapter = MultiheadAttention.from_torch(self.stock)
        xp = np if device == "cpu" else __import__("cupy")
        self.bare = MultiHeadAttention(d, h, causal=True, dtype=str(dtype).split(".")[1], xp=xp)
        w = to_array(self.stock.in_proj_weight.detach(), "w")
        bias = to_array(self.stock.in_proj_bias.detach(), "b")
        for i, name in enumerate("qkv"):  # the bare layer's own contiguous x @ w layout
            self.bare.params["w" + name] = xp.ascontiguousarray(w[i * d:(i + 1) * d].T)
            self.bare.params["b" + name] = bias[i * d:(i + 1) * d].copy()
        self.bare.params["wo"] = xp.ascontiguousarray(
            to_array(self.stock.out_proj.weight.detach(), "wo").T)
        self.bare.params["bo"] = to_array(self.stock.out_proj.bias.detach(), "bo").copy()
        self.x = torch.randn((b, s, d), dtype=dtype, device=device).requires_grad_()
        self.dy = torch.randn((b, s, d), dtype=dtype, device=device)
        self.x_array, self.dy_array = to_array(self.x.detach(), "x"), to_array(self.dy, "dy")
        self.causal = torch.ones((s, s), dtype=torch.bool, device=device).triu(1)

    def run_module(self, module: torch.nn.Module) -> None:
        for p in (*module.parameters(), self.x):
            p.grad = None
        # The adapter applies is_causal itself, as the bare layer does; PyTorch needs the mask.
        mask = None if module is self.adapter else self.causal
        y, _ = module(self.x, self.x, self.x, need_weights=False, attn_mask=mask,
                      is_causal=True)
        y.backward(self.dy)
        self._sync()

    def run_bare(self) -> None:
        _, cache = self.bare.forward(self.x_array)
        self.bare.backward(self.dy_array, cache)
        self._sync()

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            timing._synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", help="comma-separated case names")
    args = parser.parse_args(argv)
    cases = CPU_CASES if args.device == "cpu" else GPU_CASES
    if args.cases:
        cases = {k: cases[k] for k in args.cases.split(",")}
    if args.device == "cpu":
        # torch's OpenMP pool and NumPy's BLAS pool, both spin-waiting, fight over the cores when
        # their calls interleave (measured 8x slower on 2 cores); one torch thread avoids it.
        torch.set_num_threads(1)
    dtypes = [torch.float32] if args.device == "cpu" else [torch.float16]
    xp = np if args.device == "cpu" else __import__("cupy")
    records: list[dict[str, Any]] = []
    print(f"{timing.device_name(xp)}; torch threads {torch.get_num_threads()}; fwd+bwd, median "
          f"of {args.repeats} (ms)")
    print(f"{'case':8s} {'dtype':8s} {'adapter':>9s} {'bare':>9s} {'ratio':>6s} {'torch MHA':>10s}")
    for name, shape in cases.items():
        for dtype in dtypes:
            case = Case(shape, dtype, args.device)
            ms = timing.time_many({"adapter": lambda: case.run_module(case.adapter),
                                   "bare": case.run_bare,
                                   "torch": lambda: case.run_module(case.stock)},
                                  args.repeats, warmup=2, gpu=False)
            ratio = ms["adapter"] / ms["bare"]
            records.append({"case": name, "shape": list(shape), "dtype": str(dtype),
                            "adapter_ms": ms["adapter"], "bare_ms": ms["bare"], "ratio": ratio,
                            "torch_mha_ms": ms["torch"], "date": timing.now()})
            print(f"{name:8s} {str(dtype)[6:]:8s} {ms['adapter']:9.3f} {ms['bare']:9.3f} "
                  f"{ratio:6.3f} {ms['torch']:10.3f}", flush=True)
            if args.json:  # after every case, so that a run cut short keeps what it measured
                doc = {"device": timing.device_name(xp), "group": "torch-adapter",
                       "records": records}
                Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
