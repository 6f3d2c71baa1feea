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
"""
from __future__ import annotations

import torch

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
    mask (None; key visibility, bool ``(n, 1, S)``; ``(L, S)`` or ``(n, L, S)``: bool, True =
    not allowed, or float, added) with the sink of ``logits``
    ``(n,)`` as key 0 and a dummy query 0 (module docstring): ``(n, L + 1, d + 1)``, ``(n, S +
    1, d + 1)`` twice, and the mask with the sink visible to every query (the dummy query sees
    what query 0 sees)."""
    if scale == 0:
        raise ValueError("attention sinks need a non-zero scale")
    n, _, d = q.shape
    one = q.new_ones(n, q.shape[1], 1)
    q1 = torch.cat([q.new_zeros(n, 1, d + 1), torch.cat([q, one], dim=2)], dim=1)
    sink_key = torch.cat([k.new_zeros(n, d), (logits / scale).to(k.dtype)[:, None]], dim=1)
    k1 = torch.cat([sink_key[:, None], torch.nn.functional.pad(k, (0, 1))], dim=1)
    v1 = torch.nn.functional.pad(v, (0, 1, 1, 0))
    if mask is not None:
        visibility = mask.dtype == torch.bool and mask.dim() == 3 and mask.shape[1] == 1
        mask = torch.nn.functional.pad(mask, (1, 0), value=False if mask.dtype == torch.bool
                                       else 0.0)
        if not visibility:  # a row for the dummy query: query 0's
            mask = torch.cat([mask[..., :1, :], mask], dim=-2)
    return q1, k1, v1, mask


def without_sink(out: torch.Tensor, weights: torch.Tensor, d: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The product's ``out`` ``(n, L, d)`` and ``weights`` ``(n, L, S)`` (or empty) from those of
    :func:`with_sink`'s operands: the dummy query, the sink key and the appended column
    dropped."""
    if weights.numel():
        weights = weights[:, 1:, 1:]
    return out[:, 1:, :d], weights
