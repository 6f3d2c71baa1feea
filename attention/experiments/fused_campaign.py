"""The campaign of the fused attention core (``abft campaign --core fused``): faults at its
internal sites, :data:`attention.fused.FUSED_SITES` (the score tiles ``S``, the probabilities
``P``, the output accumulator, the softmax denominators, ``dP``, ``dS`` and the ``dQ``, ``dK``,
``dV`` accumulators; :mod:`attention.fused` says what checks each), and at its final checks'
sites, :data:`attention.fused_final.FINAL_SITES` (the returned ``O``, ``dV`` and ``dK``;
:mod:`attention.fused_final`).

A trial runs one forward and one backward of the fused core (:func:`attention.fused.fused_forward`,
:func:`attention.fused.fused_backward`, with the masks of :data:`MASKS` and attention dropout as
the campaign's ``mask`` and ``dropout`` say; causal by default), each followed by its final check
(:func:`attention.fused_final.verify_output`, :func:`attention.fused_final.verify_grads`, as
:mod:`attention.core` runs them), on queries, keys, values and an
output gradient of shape ``(batch * heads, seq, d_model / heads)``, standard normal, seeded per
trial, in the data dtype (float16 and bfloat16 too: the core computes their tiles in float32);
its results ``out``, ``dq``, ``dk``, ``dv`` are compared with the unprotected fault-free run by
the tolerance of :mod:`attention.experiments.campaign` for the data dtype (the noise term against
a float64 reference).

Where a fault lands, "site, tile, element":

- NumPy: the core's fault hook sees every tile (or accumulator, after each tile) of a site as
  computed, and each final check the array it checks (once a pass). The trial's fault is a
  toolkit :class:`abftgemm.faults.Fault` with ``sites=site`` and ``skip`` drawn uniformly among
  the site's calls in a fault-free run, so the tile is any head, block and step, forward or
  backward; its pattern places the element(s) in that tile. Faults at internal sites hit the
  tiles' dtype (float32 for 16-bit data), at the final sites the data's (:func:`site_dtype`).
- CuPy, internal sites: the kernels inject (:func:`attention._cuda_fused.device_fault` converts
  the same Fault): one element (pattern ``"element"`` only) of the site's matrix of one head, the
  head, row, column and accumulator step drawn from the fault's seed; bit flips hit the element
  as the tiles hold it (float32 for 16-bit data). Final sites: as on NumPy (each is called once
  a pass).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from abftgemm import UncorrectableError
from abftgemm.checksums import SUPPORTED_DTYPES
from abftgemm.faults import Fault, Recorder
from attention.context import Context
from attention.dropout import keep_scale
from attention.dropout_hash import keep_mask
from attention.experiments.outcomes import Trial, absolute_tolerances, compare
from attention.fused import (DROPOUT_HOOK_SITE, FUSED_SITES, fused_backward, fused_forward,
                             work_dtype)
from attention.fused_final import FINAL_SITES, verify_grads, verify_output

#: The masks a campaign can give the fused core (``abft campaign --core fused --mask``), each
#: with what :func:`masks` makes of it:
#:
#: ``causal``  query ``i`` sees keys ``j <= i``;
#: ``full``    no mask;
#: ``alibi``   causal, plus ALiBi's additive biases ``-slope_h (i - j)`` (a slope per head,
#:             ``2^(-(h mod 8 + 1))``), as an ``(n, L, L)`` float64 ``attn_mask``;
#: ``padding`` causal, with left key padding as ``key_visible``: head ``h`` of ``n`` hides its
#:             first ``h L // (2 n)`` keys (so its first rows see no key, their output 0), and
#:             the last head (``n >= 2``) hides every key.
MASKS: dict[str, str] = {"causal": "causal", "full": "no mask", "alibi": "causal, ALiBi biases",
                         "padding": "causal, left key padding, a head without keys"}
#: The clean (fault-free, protected) record's site name.
CLEAN_TARGET = "fused"
#: The campaign's sites (its default): the kernels' internal sites, then the final checks'.
SITES: tuple[str, ...] = FUSED_SITES + FINAL_SITES
#: Every site a campaign can name: :data:`SITES` and the dropped probabilities (with dropout).
ALL_SITES: tuple[str, ...] = SITES + (DROPOUT_HOOK_SITE,)
_DTYPES = {d.name: d for d in SUPPORTED_DTYPES}


def sites_of(dropout: float) -> tuple[str, ...]:
    """The campaign's sites (its default) at attention dropout ``dropout``: :data:`SITES`, and
    with dropout the dropped probabilities too (:data:`attention.fused.DROPOUT_HOOK_SITE`, which
    the ``O_acc`` and ``dV_acc`` checks cover)."""
    return ALL_SITES if dropout else SITES


def site_dtype(dtype: str, site: str) -> np.dtype:
    """The dtype of the elements a fault at ``site`` hits, on either backend: at an internal site
    the tiles' (float64 for float64 data, float32 otherwise: 16-bit data are computed in float32
    tiles), at a final site the data's (the returned arrays)."""
    if site in FINAL_SITES:
        return _DTYPES[dtype]
    return work_dtype(_DTYPES[dtype])


def backend_problem(sites: tuple[str, ...], patterns: tuple[str, ...], xp: Any) -> str | None:
    """Why the fused core's campaign cannot run on ``xp`` with these flags, or None."""
    if xp is np or tuple(patterns) == ("element",) or set(sites) <= set(FINAL_SITES):
        return None
    return ("--core fused on cupy injects in the CUDA kernels, one element per fault: "
            "--patterns element (or --sites of the final checks alone)")


class FusedTestbed:
    """The fused core's inputs and fault-free references for one trial seed (the interface of the
    layer's testbed in :mod:`attention.experiments.campaign`: ``fault``, ``run``, ``compare``).

    Parameters
    ----------
    dtype : str
    shape : tuple of int
        ``(n, seq, head_dim)``.
    seed : int
        With ``trial``, seeds the inputs.
    xp : module
        numpy or cupy.
    trial : int
    mask : str
        One of :data:`MASKS`.
    dropout : float
        Attention dropout probability (0: none); the keep decisions' seed is drawn per trial
        from ``seed``, the same for every run of the trial.
    """

    def __init__(self, dtype: str, shape: tuple[int, int, int], seed: int, xp: Any, trial: int,
                 mask: str = "causal", dropout: float = 0.0):
        self.dtype, self.xp = dtype, xp
        rng = np.random.default_rng([seed, 7, trial])
        host = [rng.standard_normal(shape).astype(_DTYPES[dtype]) for _ in range(4)]
        self.q, self.k, self.v, self.do = (xp.asarray(x) for x in host)
        self.causal, visible, add = masks(mask, shape)
        self.visible, self.add = (None if x is None else xp.asarray(x) for x in (visible, add))
        self.dropout = dropout
        self.dropout_seed = int(np.random.default_rng([seed, 11, trial]).integers(2 ** 63))
        keep = None if dropout == 0 else \
            keep_mask(self.dropout_seed, dropout, (shape[0], shape[1], shape[1]))
        self.reference = self.run(CLEAN_TARGET, "off", None).results
        self.atol = absolute_tolerances(
            self.reference, exact(*host, causal=self.causal, visible=visible, add=add, keep=keep,
                                  scale_kept=keep_scale(dropout)), dtype)
        self.calls: Counter[str] = Counter(FINAL_SITES)  # each once a fault-free pass
        if xp is np:  # the hook's calls per site, for the tile a fault picks
            recorder = Recorder()
            self.run(CLEAN_TARGET, "correct", recorder)
            self.calls = Counter(call.site for call in recorder.calls)

    def fault(self, site: str, kind: dict[str, Any], pattern: str, seed: int) -> Any:
        """The trial's fault at ``site`` (module docstring): a :class:`Fault` on NumPy, its
        :class:`attention._cuda_fused.DeviceFault` for a kernel site on CuPy."""
        if self.xp is np or site in FINAL_SITES:
            skip = int(np.random.default_rng([seed, 1]).integers(self.calls[site]))
            return Fault(pattern=pattern, seed=seed, sites=site, skip=skip, **kind)
        from attention._cuda_fused import device_fault

        return device_fault(Fault(pattern=pattern, seed=seed, sites=site, **kind), self.q.shape,
                            self.k.shape[1], self.q.dtype, causal=self.causal)

    def run(self, site: str, check: str, hook: Any) -> Trial:
        """One forward and backward of the fused core with ``hook``, each followed by its final
        check (``site`` names the record only: the fault knows its site)."""
        ctx = Context(check=check, fault_hook=hook)
        # a DeviceFault acts in the kernels alone (it is no callable hook)
        final = ctx if hook is None or callable(hook) else replace(ctx, fault_hook=None)
        try:
            out, saved = verify_output(*fused_forward(
                self.q, self.k, self.v, ctx, causal=self.causal, key_visible=self.visible,
                attn_mask=self.add, dropout=self.dropout, dropout_seed=self.dropout_seed), final)
            dq, dk, dv = verify_grads(saved, self.do, fused_backward(saved, self.do, ctx), final)
        except UncorrectableError:
            return Trial(ctx.report, True, None, _injected(hook))
        return Trial(ctx.report, False, {"out": out, "dq": dq, "dk": dk, "dv": dv},
                     _injected(hook))

    def compare(self, site: str, results: dict[str, Any], faulted: bool = False) -> str:
        """``"equal"``, ``"within"`` or ``"beyond"`` the tolerance, against the fault-free run
        (``faulted``: ignored, the fused core computes the same with and without a hook)."""
        return compare(self.xp, results, self.reference, self.atol, self.dtype)


def _injected(hook: Any) -> bool:
    """Whether ``hook`` (a Fault, a DeviceFault or None) changed anything."""
    if hook is None:
        return False
    if isinstance(hook, Fault):
        return bool(hook.injected)
    return bool(getattr(hook, "hits", 0))


def masks(mask: str, shape: tuple[int, int, int]
          ) -> tuple[bool, np.ndarray | None, np.ndarray | None]:
    """``(causal, key_visible, attn_mask)`` of :data:`MASKS`' ``mask`` for ``shape`` ``(n, L,
    d)``: host arrays, or None where the mask has none."""
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {', '.join(MASKS)}, got {mask!r}")
    n, length = shape[0], shape[1]
    visible = add = None
    if mask == "alibi":
        slopes = 2.0 ** -(np.arange(n) % 8 + 1.0)
        offsets = np.arange(length)[None, :] - np.arange(length)[:, None]  # j - i
        add = slopes[:, None, None] * np.minimum(offsets, 0)[None]
    elif mask == "padding":
        visible = np.arange(length)[None, :] >= (np.arange(n) * length // (2 * n))[:, None]
        if n >= 2:
            visible[-1] = False
    return mask != "full", visible, add


def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, *, causal: bool = True,
          visible: np.ndarray | None = None, add: np.ndarray | None = None,
          keep: np.ndarray | None = None, scale_kept: float = 1.0) -> dict[str, np.ndarray]:
    """Attention forward and gradients in float64 (host arrays ``(n, L, d)``), with the fused
    core's masks (``causal``; ``visible`` ``(n, L)`` bool, ``add`` ``(n, L, L)``; a row that sees
    no key gives 0) and dropout (``keep`` ``(n, L, L)`` bool, kept entries scaled by
    ``scale_kept``)."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    scale = 1 / math.sqrt(q.shape[2])
    s = scale * q @ k.transpose(0, 2, 1)
    if add is not None:
        s = s + add
    allowed = np.ones(s.shape, bool)
    if causal:
        allowed &= np.tril(np.ones(s.shape[1:], bool))
    if visible is not None:
        allowed &= visible[:, None, :]
    s = np.where(allowed, s, -np.inf)
    top = s.max(-1, keepdims=True)
    p = np.where(allowed, np.exp(s - np.where(np.isfinite(top), top, 0)), 0.0)
    total = p.sum(-1, keepdims=True)
    p = np.divide(p, total, out=np.zeros_like(p), where=total > 0)
    drop = np.ones_like(p) if keep is None else keep * scale_kept
    pd = p * drop
    out = pd @ v
    dp = (do @ v.transpose(0, 2, 1)) * drop
    ds = p * (dp - (do * out).sum(-1, keepdims=True))
    return {"out": out, "dq": scale * ds @ k, "dk": scale * ds.transpose(0, 2, 1) @ q,
            "dv": pd.transpose(0, 2, 1) @ do}
