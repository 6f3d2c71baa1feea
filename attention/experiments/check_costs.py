"""What checking each attention GEMM site costs, counted: bytes moved and FLOPs, per shape.

The inputs of :func:`attention.plan.adaptive_frequencies` must be reproducible, and timings of
one site's checks on a CPU are not (they sit inside the noise of a whole layer step).  So the cost
of a site is counted from the shape, following the checking plan (:mod:`attention.plan`) on its
clean path.  For ``C = A B`` (``m x k`` by ``k x n``, ``count`` such products per layer call) a
site verified by its column checksums (a ``"gemm"`` step of :mod:`attention.passes`)

1. encodes ``A`` (``E^T A``: plain, location-weighted and absolute column sums), reading it once
   (``m k`` elements), unless an earlier step hands that encoding on (``Step.sums``, as
   :func:`attention.passes.checksums` follows the table: observed by an earlier product, or made
   by the softmax kernel that wrote ``A``);
2. predicts the column checksums ``(E^T A) B``, reading ``B`` once (``k n`` elements);
3. observes ``C``'s column checksums and judges every column, reading ``C`` once (``m n``).

A site whose rows are verified by their consumer (a ``"gemm rows"`` step: the scores and ``dP``)
predicts its row checksums ``A (B E)`` only, with ``B E`` passed in (``Step.rows``),
reading ``A`` once (``m k``); the softmax kernel observes them on the read of ``C`` it makes
anyway, so no read of ``C`` is charged, only its sums.  The row direction of the other sites is
computed on the rare path, after a column flags, and is not charged.

The counting rule, the same for every pass:

- bytes: the elements a pass reads times ``itemsize``, plus :data:`CHECKSUM_ENTRY_BYTES` per
  vector checked (each column of ``C``; each row for a site verified by its consumer);
- FLOPs: each element a pass reads (or, for a consumer-verified ``C``, sums) enters 3 sums, each
  a multiply-add by a coefficient (a weight of the encoding, or an entry of an encoding the pass
  carries through, as the kernels compute them): :data:`FLOPS_PER_ELEMENT` = 3 x 2 FLOPs.

Weights (``W``, ``count == 1``) are read once per call like any operand.  Whether ``A`` is
encoded is read from the pass tables resolved for a :class:`attention.passes.Variant` (default:
self-attention on NumPy, weight gradients in the ``x @ w`` layout), which count the encodings of
``P``, ``dS`` and their transposes as passed (the CPU softmax kernels make them; with
``Variant(gpu=True)`` those four products read their operand), and so is an encoding an earlier
step of the pass made of the same operand (``X`` for ``K`` and ``V``, ``X^T`` for their weight
gradients: charged to ``q_proj`` and ``d_wq``, which make it when they are checked).  In
PyTorch's ``W`` layout (``Variant(w_layout=True)``) the four weight gradients are written
transposed and each encodes its own ``A``.  Comparing the
checksums (``O(m + n)``) and adding a bias's share to the prediction
(``O(n)``) are left out.  :func:`model_ms` turns the counts into milliseconds with a nominal
bandwidth and FLOP rate: the same shape always gives the same costs.
"""
from __future__ import annotations

from dataclasses import dataclass

from attention.passes import BACKWARD, FORWARD, Variant, carried, checksums, steps
from attention.plan import SITES

#: Bytes of one checked vector's checksum entry: its 3 checksums (plain, weighted, absolute),
#: predicted and observed, in float64: 3 x 2 x 8.  Each is written by the pass that makes it and
#: read back once by the judgement; the round trip is charged once.
CHECKSUM_ENTRY_BYTES = 48

#: FLOPs per element entering a pass: 3 sums, each a multiply-add (2 FLOPs).
FLOPS_PER_ELEMENT = 6


@dataclass(frozen=True)
class SiteGemm:
    """One site's product and what its checks do.

    Attributes
    ----------
    count, m, k, n : int
        ``count`` products ``(m x k) @ (k x n)`` per layer call.
    encode_a : bool
        The column checks encode ``A`` themselves (False: its encoding is passed in, or the site
        is verified by its consumer).
    rows_by_consumer : bool
        Only the row checksums are predicted (reading ``A``); the consumer observes them on its
        own read of ``C``.
    """

    count: int
    m: int
    k: int
    n: int
    encode_a: bool = True
    rows_by_consumer: bool = False


@dataclass(frozen=True)
class CheckCost:
    """Bytes moved and FLOPs of one site's checks, per layer call."""

    bytes: int
    flops: int


def site_gemms(batch: int, heads: int, seq: int, head_dim: int,
               variant: Variant = Variant()) -> dict[str, SiteGemm]:
    """The product of every site of :data:`attention.SITES` for one forward+backward
    (self-attention), with what its checks do as the pass tables say in ``variant`` (not
    ``fused``: the fused core checks inside its kernel, not per site)."""
    if variant.fused:
        raise ValueError("check_costs counts the unfused sites; Variant(fused=True) runs the "
                         "fused core, which checks every tile inside its kernel")
    t, d, bh = batch * seq, heads * head_dim, batch * heads
    proj, weight_grad = (1, t, d, d), (1, d, t, d)
    qk, pv = (bh, seq, head_dim, seq), (bh, seq, seq, head_dim)  # like Q K^T, like P V
    shapes = {
        "q_proj": proj, "k_proj": proj, "v_proj": proj, "scores": qk, "context": pv,
        "out_proj": proj, "d_wo": weight_grad, "d_context": proj, "d_probs": qk, "d_v": pv,
        "d_q": pv, "d_k": pv, "d_wq": weight_grad, "d_wk": weight_grad, "d_wv": weight_grad,
        "d_x": (1, t, 3 * d, d),
    }
    fwd, bwd = steps(FORWARD, variant), steps(BACKWARD, variant)
    given = carried(fwd, bwd, variant.gpu)[1]
    taken = [*zip(fwd, checksums(fwd, variant.gpu)), *zip(bwd, checksums(bwd, variant.gpu, given))]
    return {s.site: SiteGemm(*shapes[s.site], encode_a=s.op == "gemm" and t is None,
                             rows_by_consumer=s.op == "gemm rows")
            for s, t in taken if s.site in shapes}


def check_cost(g: SiteGemm, itemsize: int) -> CheckCost:
    """Bytes and FLOPs of the checks of ``g`` (module docstring), elements of ``itemsize``."""
    m, k, n = g.m, g.k, g.n
    if g.rows_by_consumer:  # predict A (B E); the consumer sums C on its own read
        read, summed, vectors = m * k, m * k + m * n, m
    else:  # encode A (unless passed), predict (E^T A) B, observe C
        read = (m * k if g.encode_a else 0) + k * n + m * n
        summed, vectors = read, n
    return CheckCost(bytes=g.count * (read * itemsize + vectors * CHECKSUM_ENTRY_BYTES),
                     flops=g.count * FLOPS_PER_ELEMENT * summed)


def check_costs(batch: int, heads: int, seq: int, head_dim: int, itemsize: int = 4,
                variant: Variant = Variant()) -> dict[str, CheckCost]:
    """Counted cost of checking each site of :data:`attention.SITES` once per forward+backward.

    Parameters
    ----------
    batch, heads, seq, head_dim : int
        Layer shape.
    itemsize : int
        Bytes per element of the layer's dtype (4 for float32).
    variant : Variant
        The call whose steps are counted (self-attention only: ``cross`` is not counted).
    """
    if min(batch, heads, seq, head_dim, itemsize) < 1:
        raise ValueError("batch, heads, seq, head_dim and itemsize must be positive")
    if variant.cross:
        raise ValueError("check_costs counts self-attention")
    gemms = site_gemms(batch, heads, seq, head_dim, variant)
    return {site: check_cost(gemms[site], itemsize) for site in SITES}


def model_ms(cost: CheckCost, bandwidth_gbs: float, gflops: float) -> float:
    """Milliseconds of ``cost`` at ``bandwidth_gbs`` GB/s and ``gflops`` GFLOP/s (no overlap)."""
    if bandwidth_gbs <= 0 or gflops <= 0:
        raise ValueError("bandwidth and FLOP rate must be positive")
    return cost.bytes / (bandwidth_gbs * 1e6) + cost.flops / (gflops * 1e6)
