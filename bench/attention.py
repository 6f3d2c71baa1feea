"""Attention benchmark: the protected layer vs the same layer unprotected, forward/backward/both.

Usage::

    python bench/attention.py [--backend numpy|cupy] [--json PATH] [--quick] [--sites] [--cases A,B]

Cases (``(batch, heads, seq, head_dim)``): on the CPU small shapes in float32 (and, with
``--cases long,longer``, (1, 8, 1024, 64) and (1, 8, 4096, 64)); on the GPU
BERT-base (8, 12, 512, 64), BERT-large (8, 16, 512, 64), GPT-2 (8, 12, 1024, 64) and Llama-7B-like
(4, 32, 2048, 128) in float16 and bfloat16. Peers where PyTorch imports, on the same device:
``nn.MultiheadAttention`` (projections + attention, causal, forward + backward; PyTorch's default
threads on the CPU) and scaled_dot_product_attention with the flash and math backends (the
attention core, forward + backward), timed after the layer, not interleaved with it (PyTorch's
and NumPy's thread pools slow each other down when their calls alternate). ``--sites`` also
measures the cost of checking each site alone (the layer with only that site checked minus the
layer with no GEMM site checked) and of the softmax invariants.
``floor_ms`` is one read of the scores (batch*heads*seq*seq elements) at the measured copy
bandwidth.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import SITES, CheckingPlan, MultiHeadAttention, SitePlan  # noqa: E402
from bench import timing  # noqa: E402

GPU_CASES = {"bert-base": (8, 12, 512, 64), "bert-large": (8, 16, 512, 64),
             "gpt2": (8, 12, 1024, 64), "llama": (4, 32, 2048, 128)}
CPU_CASES = {"small": (4, 4, 128, 32), "medium": (2, 8, 256, 64)}
#: On request only (``--cases long,longer``): longer causal sequences, where skipping the zero
#: blocks of ``P`` and ``dS`` matters more.
LONG_CPU = {"long": (1, 8, 1024, 64), "longer": (1, 8, 4096, 64)}
QUICK_GPU = {"bert-large": (8, 16, 512, 64)}
QUICK_CPU = {"tiny": (2, 2, 32, 16)}


class Case:
    """One layer configuration with inputs, ready to time."""

    def __init__(self, xp: Any, shape: tuple[int, int, int, int], dtype: str, seed: int = 0):
        b, h, s, hd = shape
        self.xp, self.shape, self.dtype = xp, shape, dtype
        self.layer = MultiHeadAttention(h * hd, h, causal=True, dtype=dtype, xp=xp, seed=seed)
        rng = np.random.default_rng(seed)
        self.x = xp.asarray(rng.standard_normal((b, s, h * hd)).astype(self.layer.dtype))
        self.dy = xp.asarray(rng.standard_normal((b, s, h * hd)).astype(self.layer.dtype))
        self.cache: dict[str, Any] = {}

    def forward(self, check: str) -> None:
        self.layer.check = check
        _, self.cache[check] = self.layer.forward(self.x)

    def backward(self, check: str) -> None:
        self.layer.check = check
        self.layer.backward(self.dy, self.cache[check])

    def both(self, check: str) -> None:
        self.forward(check)
        self.backward(check)


def time_case(case: Case, repeats: int, warmup: int, gpu: bool) -> dict[str, dict[str, float]]:
    """Protected and unprotected ms of forward, backward and both."""
    case.forward("correct")
    case.forward("off")
    out = {}
    for step in ("forward", "backward", "both"):
        fn = getattr(case, step)
        t = timing.time_many({"protected": lambda: fn("correct"), "unprotected": lambda: fn("off")},
                             repeats, warmup, gpu=gpu)
        out[step] = t
    return out


def site_costs(case: Case, repeats: int, warmup: int, gpu: bool) -> dict[str, float]:
    """Per site: ms added to forward+backward by checking that GEMM site alone.

    The baseline checks no GEMM site but still runs what ``check="correct"`` always runs (the
    softmax invariants, the layer input's encoding); its own cost over ``check="off"`` is
    reported as ``"invariants"``.
    """
    layer = case.layer
    base_plan = layer.plan

    def only(site: str | None) -> CheckingPlan:
        return CheckingPlan({s: SitePlan(probability=1.0 if s == site else 0.0)
                             for s in base_plan.sites})

    def run(plan: CheckingPlan, check: str) -> Callable[[], object]:
        def call() -> object:
            layer.plan = plan
            return case.both(check)
        return call

    # One interleaved series (every configuration once per round), so drift in the machine's
    # speed during the measurement hits every configuration alike.
    configs = {"off": run(base_plan, "off"), "none": run(only(None), "correct")}
    configs.update({site: run(only(site), "correct") for site in SITES})
    ms = timing.time_many(configs, repeats, warmup, gpu=gpu)
    layer.plan = base_plan
    costs = {"invariants": ms["none"] - ms["off"]}
    costs.update({site: ms[site] - ms["none"] for site in SITES})
    return costs


def torch_peers(shape: tuple[int, int, int, int], dtype: str, repeats: int,
                warmup: int) -> dict[str, float]:
    """PyTorch fwd+bwd ms: nn.MultiheadAttention, and SDPA (flash, math) for the core."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {}
    gpu = torch.cuda.is_available()
    b, h, s, hd = shape
    d = h * hd
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    dev = "cuda" if gpu else "cpu"
    mha = torch.nn.MultiheadAttention(d, h, batch_first=True, device=dev, dtype=tdtype)
    x = torch.randn(b, s, d, device=dev, dtype=tdtype, requires_grad=True)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=dev), 1)

    def layer() -> None:
        y, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
        y.backward(torch.ones_like(y))

    q, k, v = (torch.randn(b, h, s, hd, device=dev, dtype=tdtype, requires_grad=True)
               for _ in range(3))

    def core(backend: Any) -> Any:
        def run() -> None:
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(torch.ones_like(o))
        return run

    fns = {"torch_mha": layer, "sdpa_flash": core(SDPBackend.FLASH_ATTENTION),
           "sdpa_math": core(SDPBackend.MATH)}
    out = {}
    for name, fn in fns.items():
        try:
            out[name] = timing.time_many({name: fn}, repeats, warmup, gpu=gpu,
                                         events=timing.torch_events if gpu else None)[name]
        except RuntimeError as exc:  # e.g. flash not available for this dtype/shape
            out[name] = f"unavailable: {str(exc).splitlines()[0][:80]}"
    return out


def peak_memory(case: Case) -> dict[str, Any]:
    """Peak device memory (bytes) of fwd+bwd, protected and unprotected (GPU only)."""
    if not timing._is_cupy(case.xp):
        return {}
    return {"protected": timing.peak_memory_bytes(lambda: case.both("correct")),
            "unprotected": timing.peak_memory_bytes(lambda: case.both("off"))}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    xp = __import__(args.backend)
    gpu = args.backend == "cupy"
    cases = (QUICK_GPU if args.quick else GPU_CASES) if gpu else \
        (QUICK_CPU if args.quick else CPU_CASES)
    if args.cases:
        known = {**GPU_CASES, **CPU_CASES, **LONG_CPU, **QUICK_GPU, **QUICK_CPU}
        unknown = sorted(set(args.cases.split(",")) - known.keys())
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(known)}")
        cases = {name: known[name] for name in args.cases.split(",")}
    dtypes = ["float16", "bfloat16"] if gpu else ["float32"]
    repeats = args.repeats or (3 if args.quick else (10 if gpu else 5))
    warmup = 1 if args.quick else 2
    bandwidth = timing.copy_bandwidth_TBps(xp)
    records = []
    path = Path(args.json) if args.json else None
    for name, shape in cases.items():
        for dtype in dtypes:
            case = Case(xp, shape, dtype)
            b, h, s, hd = shape
            itemsize = np.dtype(case.layer.dtype).itemsize
            floor = timing.floor_ms(b * h * s * s * itemsize, bandwidth)
            times = time_case(case, repeats, warmup, gpu)
            peers = torch_peers(shape, dtype, repeats, warmup)
            memory = peak_memory(case)
            for step, t in times.items():
                records.append(timing.make_record(
                    "attention-fwdbwd", f"layer-{name}-{step}", dtype, shape, t["protected"],
                    t["unprotected"], floor, peers if step == "both" else {},
                    **({"peak_memory": memory} if step == "both" and memory else {})))
            if args.sites:
                costs = site_costs(case, repeats, warmup, gpu)
                records.append({"group": "attention-sites", "case": f"layer-{name}", "dtype": dtype,
                                "shape": list(shape), "site_ms": costs,
                                "unprotected_ms": times["both"]["unprotected"]})
            print(timing.format_table([r for r in records if "protected_ms" in r][-3:]), flush=True)
            if args.sites:
                print("per-site cost (ms):",
                      {k: round(v, 4) for k, v in records[-1]["site_ms"].items()}, flush=True)
            if path:
                timing.write_results(path, timing.device_name(xp), records, bandwidth)
            del case
            if gpu:
                timing.free_gpu_memory()
    return records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    parser.add_argument("--json", default=None, help="results file to write")
    parser.add_argument("--quick", action="store_true", help="one small case, few repeats")
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--sites", action="store_true", help="also measure per-site costs")
    parser.add_argument("--cases", default="",
                        help="comma-separated case names (default: the backend's set)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
