"""CUDA sources of the attention core and what NVRTC is asked to build from them.

Registered the way :mod:`abftgemm.kernels` registers its own (same options, dtype table and
checksum prelude), so that the runtime loader (:mod:`attention._cuda_softmax`) and the GPU-less
compile check (``scripts/compile_kernels.py``) compile exactly the same thing. No CuPy import.
"""
from __future__ import annotations

from pathlib import Path

from abftgemm import kernels as _abft

KERNEL_DIR = Path(__file__).resolve().parent

NVRTC_OPTIONS = _abft.NVRTC_OPTIONS
CUDA_TYPES = _abft.CUDA_TYPES
instance = _abft.instance

SOFTMAX_FILE = "softmax.cu"
#: Masked softmax + the raw scores' row checksums + the forward invariants, one warp per row.
SOFTMAX_FORWARD = "attn_softmax_forward"
#: dS + dP's row checksums + the backward invariants + scaling, one warp per row.
SOFTMAX_BACKWARD = "attn_softmax_backward"

FUSED_FILE = "fused.cu"
#: The fused protected attention core (attention/_cuda_fused.py): row encodings of an operand,
#: the forward per (head, query block), rowsum(dO * O), the backward's dK and dV per (head, key
#: block) and dQ per (head, query block).
FUSED_ENCODE = "attn_fused_encode_rows"
FUSED_FORWARD = "attn_fused_forward"
FUSED_DELTA = "attn_fused_delta"
FUSED_BACKWARD_KV = "attn_fused_backward_kv"
FUSED_BACKWARD_Q = "attn_fused_backward_q"
FUSED_KERNELS = (FUSED_ENCODE, FUSED_FORWARD, FUSED_DELTA, FUSED_BACKWARD_KV, FUSED_BACKWARD_Q)

#: Source file -> every name expression compiled from it.
MODULES: dict[str, tuple[str, ...]] = {
    SOFTMAX_FILE: tuple(instance(k, t) for k in (SOFTMAX_FORWARD, SOFTMAX_BACKWARD)
                        for t in CUDA_TYPES),
    FUSED_FILE: tuple(instance(k, t) for k in FUSED_KERNELS for t in CUDA_TYPES),
}


#: Element arithmetic both sources share (``Arith``, ``widen``, ``narrow``, infinities,
#: ``exp_of``, ``log_of``), prepended after abftgemm's prelude as that one is.
PRELUDE = "arith.cuh"


def source(filename: str) -> str:
    """The text NVRTC compiles for ``filename`` (a key of :data:`MODULES`): abftgemm's checksum
    prelude (the row checksums' accumulator), this package's :data:`PRELUDE`, then the file."""
    paths = (_abft.KERNEL_DIR / _abft.PRELUDE, KERNEL_DIR / PRELUDE, KERNEL_DIR / filename)
    return "\n".join(path.read_text() for path in paths)
