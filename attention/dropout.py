"""Attention dropout between the checked softmax and the products that read the probabilities.

Training with attention dropout multiplies the probabilities by a random keep mask and rescales
them, ``P_d = P * keep / (1 - p)``, as ``torch.nn.MultiheadAttention`` does; the context
``P_d V`` and the gradient ``dV = P_d^T dCL`` read ``P_d``, and the backward takes the gradient of
the probabilities before dropout, ``dP = dP_d * keep / (1 - p)``. Every check stays exact:

- the softmax invariants are judged on ``P`` itself, before dropout;
- the products that read ``P_d`` encode ``P_d`` (their checksums are those of the operand they
  multiply);
- dropout itself is checked on its own site, ``"dropout"``: ``P_d`` is recomputed from ``P`` and
  the mask and compared bit for bit (the multiplication is one rounding per entry, so any
  difference is a fault); a mismatch recomputes it, as a failed softmax invariant does;
- the backward softmax kernels observe the row checksums of ``dP_d`` as they read it (the check
  of the product ``dCL V^T``), then apply the mask, and judge their invariants on ``dP``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from abftgemm.backend import array_module
from attention.dropout_hash import check_seed, draw_seed, keep_mask

#: The site of the dropout step (fault hook and report), present when dropout is active.
DROPOUT_SITE = "dropout"


@dataclass(frozen=True)
class Dropout:
    """Attention dropout of one forward call.

    Attributes
    ----------
    p : float
        Probability that an entry is dropped, ``0 < p <= 1``.
    keep : bool array (batch*heads, seq_q, seq_k)
        True where the probability is kept (C-contiguous, the array module of the layer).
    """

    p: float
    keep: Any

    @property
    def scale(self) -> float:
        """:func:`keep_scale` of ``p``."""
        return keep_scale(self.p)

    @classmethod
    def of(cls, xp: Any, p: float, keep: Any | None, shape: tuple[int, int, int],
           rng: Any | None) -> "Dropout | None":
        """The validated dropout of a call, or None for ``p == 0`` (``keep`` must then be None).

        ``keep`` given: it is used as is (so a caller can reproduce a draw or use PyTorch's
        generator); otherwise it is drawn from ``rng`` (a ``numpy.random.Generator``, or
        CuPy's for CuPy arrays; a new unseeded one when None).
        """
        p = probability(p)
        if p == 0.0:
            if keep is not None:
                raise ValueError("dropout_keep was given with dropout=0; give the dropout "
                                 "probability it was drawn with")
            return None
        if keep is None:
            keep = _draw(xp, p, shape, rng)
        if array_module(keep) is not xp:
            raise TypeError(f"dropout_keep must be a {xp.__name__} array like the inputs")
        if keep.shape != shape or keep.dtype != bool:
            raise ValueError(f"dropout_keep must be a boolean array of shape {shape} "
                             f"(batch*heads, seq_q, seq_k), got {keep.dtype} {keep.shape}")
        return cls(p, xp.ascontiguousarray(keep))


def for_core(xp: Any, p: float, keep: Any | None, seed: int | None,
             shape: tuple[int, int, int], rng: Any | None, fused: bool
             ) -> tuple[Dropout | None, tuple[float, int] | None]:
    """The dropout of a call, for the core that runs it: ``(Dropout or None, None)`` for the
    unfused core, ``(None, (p, seed) or None)`` for the fused core (:mod:`attention.fused`), which
    regenerates its keep decisions from a seed (:mod:`attention.dropout_hash`).

    ``seed`` given: the decisions of that seed, on either core (the unfused core's mask is
    materialized with :func:`attention.dropout_hash.keep_mask`). Otherwise the fused core draws
    its seed from ``rng`` (a ``numpy.random.Generator``; a new unseeded one when None) and the
    unfused core its mask (:meth:`Dropout.of`). ``keep`` and ``seed`` exclude each other; the
    fused core never takes ``keep`` (:func:`attention.fused_choice.static_reason`).
    """
    p = probability(p)
    if seed is not None:
        if keep is not None:
            raise ValueError("give dropout_keep or dropout_seed, not both")
        if p == 0.0:
            raise ValueError("dropout_seed was given with dropout=0; give the dropout "
                             "probability")
        seed = int(check_seed(seed))
    if fused:
        return None, (None if p == 0.0 else (p, draw_seed(rng) if seed is None else seed))
    if seed is not None:
        keep = xp.asarray(keep_mask(seed, p, shape))
    return Dropout.of(xp, p, keep, shape, rng), None


def probability(p: float) -> float:
    """A dropout probability ``p`` as a float, which must be in ``[0, 1]``."""
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1], got {p}")
    return p


def keep_scale(p: float) -> float:
    """The factor of a kept entry, ``1 / (1 - p)``; 0 for ``p == 1``, where every entry is
    dropped."""
    return 0.0 if p == 1 else 1.0 / (1.0 - p)


def _draw(xp: Any, p: float, shape: tuple[int, int, int], rng: Any | None) -> Any:
    """A keep mask drawn with probability ``1 - p`` per entry."""
    if rng is None:
        rng = np.random.default_rng() if xp is np else xp.random
    return rng.random(shape, dtype=np.float32) >= p


class DropoutStep:
    """Apply dropout to the probabilities into ``out``, let the fault hook see the result, check it.

    ``verdict`` is ``(ok, mismatching entries, 0)`` when called (None with ``check="off"``);
    ``recompute()`` applies the dropout again and returns the new verdict.
    """

    def __init__(self, probs: Any, dropout: Dropout, out: Any, ctx: Any):
        self.probs, self.dropout, self.out, self.ctx = probs, dropout, out, ctx
        self.verdict: Any | None = None
        self.run()

    def run(self) -> None:
        """Compute ``out``; the hook sees it; the check compares it with a recomputation."""
        self.out[...] = self._dropped()
        if self.ctx.fault_hook is not None:
            self.ctx.fault_hook(DROPOUT_SITE, self.out)
        if self.ctx.check != "off":
            self.verdict = self._judged()

    def recompute(self) -> Any:
        """Apply the dropout again (after a failed check); the new verdict."""
        self.out[...] = self._dropped()
        self.verdict = self._judged()
        return self.verdict

    def _dropped(self) -> Any:
        """``P * scale`` where kept, else 0, in P's dtype (on bfloat16 data CuPy 14.2 returned
        this in float32: rounded back here, one rounding of the exact product either way)."""
        xp, p = array_module(self.probs), self.probs
        kept = xp.where(self.dropout.keep, p * p.dtype.type(self.dropout.scale), p.dtype.type(0))
        return kept.astype(p.dtype, copy=False)

    def _judged(self) -> Any:
        """The number of entries whose bits differ from a recomputation (on the device until
        the verdict is read)."""
        xp = array_module(self.out)
        bits = np.dtype(f"u{self.out.dtype.itemsize}")
        bad = xp.count_nonzero(self.out.view(bits) != self._dropped().view(bits))

        def verdict() -> tuple[bool, float, float]:
            n = int(bad)
            return n == 0, float(n), 0.0

        return verdict
