"""What checking each attention GEMM site costs, counted: bytes moved and FLOPs, per shape.

The inputs of :func:`attention.plan.adaptive_frequencies` must be reproducible, and timings of
one site's checks on a CPU are not (they sit inside the noise of a whole layer step).  So the cost
of a site is counted from the shape, following the checking plan (:mod:`attention.plan`): for
``C = A B`` (``m x k`` by ``k x n``, ``count`` such products per layer call)

- encoding an operand that is not passed in (``E^T A``: 2 weighted sums per column of ``A``;
  ``B E``: 2 per row of ``B``) reads it once: ``m k`` (``k n``) elements, ``4 m k`` (``4 k n``)
  FLOPs;
- predicting the column checksums ``(E^T A) B`` reads ``B`` once, ``4 k n`` FLOPs; the row
  checksums ``A (B E)`` read ``A`` once, ``4 m k`` FLOPs;
- observing ``C`` reads it once (except for the scores, whose row checksums the softmax observes
  on the read it makes anyway), 4 FLOPs per element and direction;
- the predicted and observed checksums (2 vectors per direction, float64) are written and read
  back once: ``32`` bytes per checksum entry.

Weights (``W``, ``count == 1``) are read once per call like any operand.  The layer input ``X``
is encoded once for the three projections; that pass is charged to ``q_proj``.  Each pass is
counted once, as a CPU or GPU kernel that streams the operand makes it; comparing the checksums
(``O(m + n)``) is left out.  :func:`model_ms` turns the counts into milliseconds with a nominal
bandwidth and FLOP rate: the same shape always gives the same costs.
"""
from __future__ import annotations

from dataclasses import dataclass

from attention.plan import SITES

#: Bytes of one predicted-and-observed checksum entry: 2 vectors (plain, weighted) x 2 (predicted,
#: observed) x 8 (float64).
CHECKSUM_ENTRY_BYTES = 32


@dataclass(frozen=True)
class SiteGemm:
    """One site's product and what its checks do.

    Attributes
    ----------
    count, m, k, n : int
        ``count`` products ``(m x k) @ (k x n)`` per layer call.
    encode_a, encode_b : bool
        Whether the checks encode ``A`` (``E^T A``) or ``B`` (``B E``) themselves (False: passed).
    rows_only : bool
        Only the row checksums are verified, observed by the consumer's own read of ``C``.
    """

    count: int
    m: int
    k: int
    n: int
    encode_a: bool = True
    encode_b: bool = True
    rows_only: bool = False


@dataclass(frozen=True)
class CheckCost:
    """Bytes moved and FLOPs of one site's checks, per layer call."""

    bytes: int
    flops: int


def site_gemms(batch: int, heads: int, seq: int, head_dim: int) -> dict[str, SiteGemm]:
    """The product of every site of :data:`attention.SITES` for one forward+backward."""
    t, d, bh = batch * seq, heads * head_dim, batch * heads
    s, hd = seq, head_dim
    proj = SiteGemm(1, t, d, d)
    return {
        "q_proj": proj,                                  # X's encoding, shared, charged here
        "k_proj": SiteGemm(1, t, d, d, encode_a=False),
        "v_proj": SiteGemm(1, t, d, d, encode_a=False),
        "scores": SiteGemm(bh, s, hd, s, encode_a=False, encode_b=False, rows_only=True),
        "context": SiteGemm(bh, s, s, hd),
        "out_proj": SiteGemm(1, t, d, d, encode_a=False),
        "d_wo": SiteGemm(1, d, t, d),
        "d_context": proj,
        "d_probs": SiteGemm(bh, s, hd, s, encode_a=False, encode_b=False),
        "d_v": SiteGemm(bh, s, s, hd),
        "d_q": SiteGemm(bh, s, s, hd),
        "d_k": SiteGemm(bh, s, s, hd),
        "d_wq": SiteGemm(1, d, t, d),
        "d_wk": SiteGemm(1, d, t, d),
        "d_wv": SiteGemm(1, d, t, d),
        "d_x": SiteGemm(1, t, 3 * d, d),
    }


def check_cost(g: SiteGemm, itemsize: int) -> CheckCost:
    """Bytes and FLOPs of the checks of ``g`` (module docstring), elements of ``itemsize``."""
    m, k, n = g.m, g.k, g.n
    elements = flops = 0
    if not g.rows_only:  # column checksums (E^T A) B, and the one read of C both directions use
        elements += k * n + (m * k if g.encode_a else 0) + m * n
        flops += 4 * k * n + (4 * m * k if g.encode_a else 0) + 4 * m * n
    elements += m * k + (k * n if g.encode_b else 0)   # row checksums A (B E)
    flops += 4 * m * k + (4 * k * n if g.encode_b else 0) + 4 * m * n
    entries = m if g.rows_only else m + n
    return CheckCost(bytes=g.count * (elements * itemsize + entries * CHECKSUM_ENTRY_BYTES),
                     flops=g.count * flops)


def check_costs(batch: int, heads: int, seq: int, head_dim: int,
                itemsize: int = 4) -> dict[str, CheckCost]:
    """Counted cost of checking each site of :data:`attention.SITES` once per forward+backward.

    Parameters
    ----------
    batch, heads, seq, head_dim : int
        Layer shape.
    itemsize : int
        Bytes per element of the layer's dtype (4 for float32).
    """
    if min(batch, heads, seq, head_dim, itemsize) < 1:
        raise ValueError("batch, heads, seq, head_dim and itemsize must be positive")
    gemms = site_gemms(batch, heads, seq, head_dim)
    return {site: check_cost(gemms[site], itemsize) for site in SITES}


def model_ms(cost: CheckCost, bandwidth_gbs: float, gflops: float) -> float:
    """Milliseconds of ``cost`` at ``bandwidth_gbs`` GB/s and ``gflops`` GFLOP/s (no overlap)."""
    if bandwidth_gbs <= 0 or gflops <= 0:
        raise ValueError("bandwidth and FLOP rate must be positive")
    return cost.bytes / (bandwidth_gbs * 1e6) + cost.flops / (gflops * 1e6)
