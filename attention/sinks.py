"""Attention sinks as one more key: ``softmax([scale Q K^T + mask, s])`` with a learned logit ``s``
per head that every query sees and whose probability multiplies no value (gpt-oss and its kin:
transformers' ``s_aux``).

The protected cores take no sink of their own; the sink is made of what they do take, exactly:
a key ``k_s = [0, ..., 0, s / scale]`` and a zero value row, prepended to each head's keys and
values, with a column of ones appended to the queries (and zeros to the keys and values), so that
``scale q' . k_j' = scale q . k_j`` and ``scale q' . k_s = s``. A dummy query, prepended too, keeps
the causal triangle the core's (query ``i + 1`` sees the sink and keys ``0..i``; the dummy sees
the sink) and the key padding an ``O(L)`` mask; its output is dropped. The gradient of ``s`` is
that of the sink key's last entry, which the core's checked ``dK`` gives, times ``1 / scale``.
The core's reports and fault hooks see this larger product: query 0 and key 0 are the dummy
query and the sink, and the caller's query ``i`` and key ``j`` are ``i + 1`` and ``j + 1``.
"""
from __future__ import annotations

import torch

from attention._torch_arrays import eager

__all__ = ["sink_logits", "with_sink", "without_sink"]


def sink_logits(sinks: torch.Tensor, lead: torch.Size, n: int) -> torch.Tensor:
    """``sinks`` broadcast to the leading dimensions ``lead`` (batch, heads, ...) of the
    product's ``n`` heads, flattened to ``(n,)``."""
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a float tensor, got {sinks.dtype}")
    try:
        return sinks.expand(lead).reshape(n)
    except RuntimeError:
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} does not broadcast to the "
                         f"leading dimensions {tuple(lead)}") from None


def with_sink(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              logits: torch.Tensor, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q', k', v', mask')`` of ``q`` ``(n, L, d)``, ``k`` and ``v`` ``(n, S, d)`` and a core
    mask (None; per key ``(n, 1, S)``: key visibility, bool, or float added, not requiring grad;
    ``(L, S)`` or ``(n, L, S)``: bool, True = not allowed, or float, added) with the sink of
    ``logits`` ``(n,)`` as key 0 and a dummy query 0 (module docstring): ``(n, L + 1, d +
    1)``, ``(n, S + 1, d + 1)`` twice, and the mask with the sink visible to every query (the
    dummy query sees what query 0 sees). A head whose
    sink is ``-inf``, or so low that ``s / scale`` rounds to ``-inf`` in the data's dtype, has
    no sink (its probability is 0): its sink key is hidden by the mask, and its logit's gradient
    is 0.

    Raises
    ------
    ValueError
        For a NaN or ``+inf`` sink, one whose ``s / scale`` overflows the data's dtype, or
        ``scale == 0``.
    """
    if scale == 0:
        raise ValueError("attention sinks need a non-zero scale")
    n, _, d = q.shape
    entry = (logits / scale).to(k.dtype)
    hidden = entry == -torch.inf
    known = eager(logits)  # values may be read: not while torch.compile records the call
    if known and not torch.isfinite(entry[~hidden]).all():
        raise ValueError(f"sinks must be finite or -inf, and sinks / scale must fit {k.dtype}; "
                         f"got sinks in [{float(logits.min())}, {float(logits.max())}] at scale "
                         f"{scale}")
    entry = entry.masked_fill(hidden, 0)  # no INF in k: its checksums and the fused core
    one = q.new_ones(n, q.shape[1], 1)
    q1 = torch.cat([q.new_zeros(n, 1, d + 1), torch.cat([q, one], dim=2)], dim=1)
    sink_key = torch.cat([k.new_zeros(n, d), entry[:, None]], dim=1)
    k1 = torch.cat([sink_key[:, None], torch.nn.functional.pad(k, (0, 1))], dim=1)
    v1 = torch.nn.functional.pad(v, (0, 1, 1, 0))
    return q1, k1, v1, _sink_mask(mask, hidden, n, k.shape[1], known)


def _sink_mask(mask: torch.Tensor | None, hidden: torch.Tensor, n: int, seq_k: int,
               known: bool) -> torch.Tensor | None:
    """:func:`with_sink`'s mask: a column for the sink key (visible, but hidden for the heads
    ``hidden`` ``(n,)``), and for a mask with rows, a row for the dummy query (query 0's), in
    one new tensor. Unless ``known`` (``hidden``'s values may be read), a column per head,
    whatever ``hidden`` holds."""
    some = bool(hidden.any()) if known else True
    if mask is None:
        if not some:
            return None
        mask = torch.zeros(n, 1, seq_k, dtype=torch.bool, device=hidden.device)
    visibility = mask.dim() == 3 and mask.shape[1] == 1 and (mask.dtype == torch.bool
                                                             or not mask.requires_grad)
    rows = mask.shape[-2] + (0 if visibility else 1)
    lead = (n,) if some or mask.dim() == 3 else ()
    new = mask.new_zeros(*lead, rows, seq_k + 1)
    new[..., rows - mask.shape[-2]:, 1:] = mask
    if not visibility:
        new[..., 0, 1:] = mask[..., 0, :]
    if some:
        new[:, :, 0] = (hidden if mask.dtype == torch.bool else
                        torch.zeros(n, dtype=mask.dtype, device=mask.device).masked_fill(
                            hidden, -torch.inf))[:, None]
    return new


def without_sink(out: torch.Tensor, weights: torch.Tensor, d: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The product's ``out`` ``(n, L, d)`` and ``weights`` ``(n, L, S)`` (or empty) from those of
    :func:`with_sink`'s operands: the dummy query, the sink key and the appended column
    dropped."""
    if weights.numel():
        weights = weights[:, 1:, 1:]
    return out[:, 1:, :d], weights
