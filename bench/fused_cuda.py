"""The fused protected attention core on the GPU (CuPy, ``kernels/fused.cu``), fwd+bwd, causal, in
one run:

- ``fused``: :mod:`attention.fused` on CuPy arrays with its checks (``check="correct"``);
- ``fused_off``: the same kernels, ``check="off"``;
- ``core``: the unfused protected :mod:`attention.core` (today's GPU path);
- ``torch_flash``: ``torch.nn.functional.scaled_dot_product_attention`` with the flash backend
  forward and backward (float16/bfloat16 only; PyTorch on the same legacy default stream).

Timed in interleaved rounds of CUDA events (``bench.timing.time_many``); prints the medians and
the ratios to ``fused_off`` and to ``torch_flash``, with the device.

    PYTHONPATH=. python bench/fused_cuda.py [--shapes 8x12x512x64,1x32x2048x128]
        [--dtype float16] [--repeats 10]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention.context import Context  # noqa: E402
from attention.core import core_backward, core_forward  # noqa: E402
from attention.fused import fused_backward, fused_forward  # noqa: E402
from bench.timing import device_name, time_many  # noqa: E402


def _cases(batch: int, heads: int, seq: int, d: int, dtype: str
           ) -> dict[str, Callable[[], Any]]:
    import cupy

    rng = np.random.default_rng(0)
    n = batch * heads
    host = [rng.standard_normal((n, seq, d)).astype(dtype) for _ in range(4)]
    q, k, v, do = (cupy.asarray(x) for x in host)

    def fused(check: str) -> Callable[[], Any]:
        def run() -> Any:
            ctx = Context(check=check)
            _, saved = fused_forward(q, k, v, ctx, causal=True)
            return fused_backward(saved, do, ctx)
        return run

    def core() -> Any:
        ctx = Context()
        _, saved = core_forward(q, k, v, ctx, causal=True, core="unfused")
        return core_backward(saved, do, ctx)

    cases = {"fused": fused("correct"), "fused_off": fused("off"), "core": core}
    if dtype not in ("float16", "bfloat16"):
        return cases
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdt = getattr(torch, dtype)
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to("cuda", tdt)
                  .reshape(batch, heads, seq, d).requires_grad_() for x in host[:3])
    tdo = torch.from_numpy(host[3].astype(np.float32)).to("cuda", tdt).reshape(batch, heads, seq, d)

    def flash() -> Any:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        return torch.autograd.grad(out, (tq, tk, tv), tdo)

    cases["torch_flash"] = flash
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x12x512x64,1x32x2048x128",
                        help="comma-separated batch x heads x seq x head_dim (default: BERT-base, "
                             "Llama-like)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"device: {device_name()}")
    for shape in args.shapes.split(","):
        b, h, s, d = (int(x) for x in shape.split("x"))
        times = time_many(_cases(b, h, s, d, args.dtype), args.repeats, warmup=2, gpu=True)
        print(f"\n({b}, {h}, {s}, {d}) {args.dtype} causal fwd+bwd, median ms of "
              f"{args.repeats}:")
        for name, ms in times.items():
            line = f"  {name:11s} {ms:9.2f} ms   x{ms / times['fused_off']:.2f} vs fused_off"
            if "torch_flash" in times:
                line += f"   x{ms / times['torch_flash']:.2f} vs torch_flash"
            print(line)


if __name__ == "__main__":
    main()
