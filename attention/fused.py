"""The fused protected attention core on the CPU: ``softmax(scale Q K^T + mask) V`` in tiles,
forward and backward, with O(L) extra memory and every tile checked.

:func:`fused_forward` saves only the output and the row log-sum-exp; :func:`fused_backward`
recomputes ``P`` tile by tile from them (FlashAttention-2). The log-sum-exp ``m + log l`` is
kept as two numbers, ``lse`` (rounded) and ``lse_lo`` (the rest), and ``P = exp((z - lse) -
lse_lo)``: where an additive mask lowers every key of a row by far more than ``log l`` (a row
padded with -1e9), ``lse`` alone has lost ``log l``. Heads are the leading axis: ``(n,
L, d)`` with ``n`` = batch * heads, as :mod:`attention.core` takes them. No ``L x L`` buffer is
ever made (an additive mask is the caller's, read tile by tile; one not in float64 is converted
once; a per-key mask ``key_add``, a float key padding mask, is one row of keys per batch item);
the tiles are ``BR x BC`` = 128 x 128 (:mod:`attention._cpu_fused`, numba kernels in
parallel over (head, query block) forward and over heads backward, so no two threads write one
accumulator; the tile products call BLAS, single-threaded, in place and in the pieces
:func:`attention._cpu_tile_gemm.gemm_rows` measured fastest here). Tiles above the causal
diagonal, those an additive mask holds at ``-inf`` throughout (a sliding window, packed
sequences: :func:`attention._cpu_fused.hidden_tiles`) and those whose keys key padding hides
throughout are skipped: they add nothing.
CuPy arrays run the same algorithm and checks in CUDA kernels (:mod:`attention._cuda_fused`,
16-bit data too). :func:`attention.core.core_forward` runs this core by default where it applies
(and the PyTorch :class:`attention.torch_core.ProtectedCore` through it), and so do the layers
between their projections (:func:`attention.functional.attention_forward`, so
:class:`attention.MultiHeadAttention` and :class:`attention.torch.MultiheadAttention`); the
unfused core stays the reference and the path for what this one does not support (an explicit
dropout mask, the attention weights), and, under ``core="auto"``, for GPU data: the CUDA kernels
are slower than the unfused core on a GPU (bench/NOTES.md), so
:func:`attention.core.core_forward` and the layers run CuPy data on them, their final checks
included, with ``core="fused"`` only. float16 and bfloat16 data
(``ml_dtypes.bfloat16``, as :func:`abftgemm.tensors.to_array` hands PyTorch's bfloat16 over) are
converted to float32 at the entry (Q, K, V, and backward dO and O: O(L d) per head, exact),
every tile is computed, accumulated and checked in float32 with float32's thresholds, and the
results are rounded to the data's dtype on the way out.

Attention dropout (``dropout=p``; the CUDA kernels alike, with bit for bit the same keep decisions),
FlashAttention style, no ``L x L`` mask: the keep decision of element ``(b, i, j)`` comes from a
counter-based hash of ``(seed, b, i, j)`` (:mod:`attention.dropout_hash`;
:func:`attention.dropout_hash.keep_mask` materializes the same decisions), regenerated per tile
forward and again backward; a kept entry is scaled by ``ks = 1 / (1 - p)`` in the data's dtype (0
for ``p = 1``, as :mod:`attention.dropout`). Forward: the ``P`` check and the denominator ``l`` read
``P`` before dropout; the product reads the dropped tile ``P_d = fl(P ks) keep`` (hook site
``fused:dropout``). Backward (FlashAttention-2's): ``dV += P_d^T dO``, ``dP' = dO V^T`` (checked as
``dP``), ``dP = fl(dP' ks) keep``, ``dS = P (dP - D)`` with ``D = rowsum(dO O)``.

What replaces the unfused core's ``dropout`` check (a recomputation compared bit for bit): the
dropped tile is no check site of its own, it is covered by the accumulators that read it. The
carried checksums of ``O`` (forward) and ``dV`` (backward) are made from ``P`` and the keep tile,
entry by entry as the dropped tile is made, not read from that tile: a fault in ``P_d`` changes the
accumulator and not its checksums, and shows at ``fused:O_acc`` or ``fused:dV_acc`` (which
recompute the block). ``dP`` after dropout is never stored: ``dS`` and its invariant each make it
from ``dP'`` and the keep tile. The keep decisions themselves, like the unfused core's given mask,
are an input and not checked; a fault in them would change the draw, not break the algebra.

What is checked, per tile (sites of the fault hook, ``ctx.fault_hook(site, tile)``, which sees
each tile array as computed and before it is checked):

``fused:S``
    ``S = Q_blk K_blk^T``. Forward: the query block is encoded once, ``(E^T Q_blk)`` with ``E =
    [1 | w]`` (location weights over its rows) and ``1^T |Q_blk|``; each tile's column checksums
    ``E^T S`` are predicted as ``(E^T Q_blk) K_blk^T`` and observed on the tile, so a bad element
    is located in its column. Backward (key blocks outside): ``E^T K_blk`` is encoded once per
    key block and the tile's row checksums are predicted as ``Q_blk (K_blk^T E)``.
``fused:P``
    ``P = exp(z - m)`` (``z`` the scaled scores plus the additive mask, if any: the mask is
    added after the ``S`` check, and ``z`` as stored is what the invariant reads; ``m`` the
    running row max forward; backward ``z - lse`` is stored and ``m`` is ``lse_lo``), judged
    on what was stored, entry by entry. On the CPU the exponential is made again at half the
    argument and squared, ``e_ij = exp((z_ij - m_i) / 2)^2`` (the same polynomial at another
    argument: no intermediate value is shared with the exponential it checks), and each entry
    must lie within ``8 u e_ij`` plus the smallest normal number of it (the two agree within 4 u
    for every float32 argument); the CUDA kernels judge ``log P_ij = z_ij - m_i`` within ``8 u
    + 8 u |z_ij - m_i|`` per entry. A fault in ``P`` that would feed the
    output and its carried checksum alike (common mode) is seen here; an error this misses
    changes one entry by less than its own rounding tolerance.
``fused:O_acc``
    The output accumulator. V's row checksums ``V 1``, ``V w`` and ``|V| 1`` (``w`` over the
    head dimension) are accumulated beside it, ``oc = alpha oc + P [V1, Vw, |V|1]`` in float64
    with the same rescaling factors ``alpha``, and divided by the same ``l``; each output row's
    checksums are then compared with the prediction.
``fused:rowsum``
    The softmax denominators: the running ``l`` (tile row sums rescaled in the data's dtype)
    against ``sum P`` carried in float64 beside the output's checksums (the hook sees ``l`` after
    each tile as a ``(rows, 1)`` column).
``fused:dP``
    ``dP = dO_blk V_blk^T``, row checksums predicted as ``dO_blk (V_blk^T E)``, ``E^T V_blk``
    encoded once per key block.
``fused:dS``
    ``dS = P (dP - D)``, ``D = rowsum(dO O)``. On the CPU, entry by entry against ``P dP - P D``
    (made again from ``P``, ``dP`` and ``D`` with other roundings) within ``8 u (|P dP| + |P
    D|)``; in the CUDA kernels, per tile row, ``sum_j dS = sum P dP - D sum P`` and ``sum_j dS
    dP = sum P dP^2 - D sum P dP`` from ``P`` and ``dP`` in float64 (the invariants of
    :mod:`attention.softmax`, per tile).
``fused:dV_acc``, ``fused:dK_acc``, ``fused:dQ_acc``
    ``dV += P^T dO``, ``dK += dS^T Q``, ``dQ += dS K``: the row encodings of the other operand
    (``dO E``, ``Q E``, ``K E``, over the head dimension, made once per call) are carried through
    the same products in float64 and compared with the accumulated rows at the end of the block.

After the kernels, :mod:`attention.fused_final` checks what they return (``fused:out``: O's row
checksums against those the forward carried, ``saved["sums"]``, which the CUDA kernels carry out
too; ``fused:dV_out``: dV's column sums against dO's; ``fused:dK_out``: dK's column sums against
0), on NumPy and CuPy data alike; :mod:`attention.core` and the layers run it.

A flag recomputes: the S, P, dP or dS tile (once), the query block forward (``O_acc``,
``rowsum``), the key block's dK and dV or the query block's dQ backward. If the recomputation
does not verify, :class:`abftgemm.UncorrectableError` is raised with the report. Findings go to
``ctx.report`` as :class:`abftgemm.Event` s (``check="detect"`` reports and warns, changing
nothing; ``check="off"`` runs the same tiles without any check).

Thresholds (rounding model of :mod:`abftgemm.thresholds`, unit roundoff ``u`` of the data's
dtype, float64 checksums):

- tile products (``S``, ``dP``: inner dimension ``d``, vectors of at most 64):
  :func:`abftgemm.thresholds.threshold_coefficients` ``(d, 64)`` as for any product, with the
  magnitude bound and the safe magnitude of non-finite values, the accumulation term at least
  its rigorous ``1.01 d u`` (below);
- accumulated products (``O``, ``dK``, ``dV``, ``dQ``; inner dimension ``K`` = the keys or
  queries summed over, vectors of length ``d``): the same coefficients for ``K``, plus ``R u``
  times ``S`` for the ``R`` roundings the tiling adds to every element (one addition of a tile's
  partial sum per tile; forward also one rescaling by ``alpha`` per tile: ``R = 2 T``, ``T``
  tiles), and ``R`` more factors ``(1 + u)`` in the magnitude bound. The statistical
  ``KAPPA sqrt(K) u`` is raised to at least ``1.01 B u``, ``B`` the tile products' inner length
  (at most 128): within one BLAS tile product rounding can be one-sided (one dominant key, the
  others' probabilities near ``u``: every addend lost to ties to even), rigorously below
  ``gamma_B``, which for ``K`` under about 256 exceeds the statistical term (a clean row at
  ``K = 128`` reached 1.36 of it). The division by ``l`` is an
  output rounding (the ``c_obs`` term); ``oc`` is divided by the same ``l``;
- ``rowsum``: ``l`` is a sum of positive terms, so ``S = sum P`` and the same rule applies with
  ``K`` = the keys, ``R = 2 T``;
- ``P``, per entry: on the CPU ``|P_ij - e_ij| <= 8u e_ij`` plus the smallest normal number,
  ``e_ij`` made again from the same ``x = z_ij - m_i``: the two exponentials agree within 4 u
  for every float32 ``x`` (all of them run; ``math.exp`` for float64: 2.5 u), half the
  tolerance. The CUDA kernels judge ``|log P_ij - x| <= 8u + 8u |x|``;
- ``dS``: on the CPU per entry, ``|dS - (P g - P D)| <= 8u (|P g| + |P D|)`` plus the smallest
  normal number (``g = dP``; both roundings lie within ``2u`` of that magnitude). The CUDA
  kernels' row invariants: ``fl(P fl(dP - D))`` errs by at most ``2.01 u P (|dP| + |D|)`` per
  element; the float64 sums of at most 64 terms add ``64 u64`` each; the tolerance is twice
  the sum, ``(4u + 4 * 64 u64) * sum_j P (|dP| + |D|)`` (times ``|dP|`` for the weighted
  invariant) plus the smallest normal number per term for underflow.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from abftgemm.backend import is_cupy_array
from abftgemm.checksums import SUPPORTED_DTYPES
from abftgemm.cpu_kernels import all_finite
from abftgemm.threads import one_blas_thread, pool_kernels
from attention import _cpu_fused as K
from attention._cpu_tile_gemm import gemm_rows
from attention.context import Context
from attention.fused_deferred import Deferred
from attention.fused_rules import (BACKWARD_SITES, FORWARD_SITES, FUSED_SITES,  # noqa: F401
                                   coefficients, dscores_entry_tolerance, probs_tolerance)
from attention.fused_rules import book as _book
from attention.fused_rules import (additive_of, check_gradient, check_inputs, dropout_of,
                                   kernel_dropout, key_additive_of, key_visible_of, trusted)
from attention.workspace import Workspace

#: The data dtypes: float16 and bfloat16 (``ml_dtypes``, as :mod:`abftgemm.tensors` hands PyTorch's
#: bfloat16 over) run their tiles in float32 (:func:`work_dtype`).
SUPPORTED = SUPPORTED_DTYPES
#: The fault hook's site of the dropped probabilities (forward and backward), covered by the
#: ``fused:O_acc`` and ``fused:dV_acc`` checks (module docstring).
DROPOUT_HOOK_SITE = K.HOOK_SITES[K.DROP_]
#: The kernels' "no additive mask": an empty (1, 0, 0) float64 array.
_NO_ADD = np.zeros((1, 0, 0))
#: The kernels' "no hidden tiles": an empty (1, 0, 0) bool array.
_NO_HIDDEN = np.zeros((1, 0, 0), bool)
#: The kernels' "no per-key additive mask": an empty (1, 0) float64 array.
_NO_KEYS = np.zeros((1, 0))


def fused_forward(q: Any, k: Any, v: Any, ctx: Context, *, scale: float | None = None,
                  causal: bool = False, key_visible: Any | None = None,
                  attn_mask: Any | None = None, dropout: float = 0.0,
                  dropout_seed: int | None = None, workspace: Workspace | None = None,
                  defer: Deferred | None = None, key_add: Any | None = None,
                  check_finite: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
    """``softmax(scale q k^T + mask) v`` in tiles, every tile checked (module docstring).

    Parameters
    ----------
    q : ndarray (n, seq_q, d)
        Queries, ``n`` = batch * heads; C-contiguous float16, bfloat16, float32 or float64 NumPy
        array, finite (16-bit data computed in float32).
    k, v : ndarray (n, seq_k, d)
        Keys and values, same dtype, C-contiguous, finite.
    ctx : Context
        Check mode (``ctx.check``; the plan's per-site frequencies do not apply to this core),
        fault hook (sites :data:`FORWARD_SITES`) and the report the findings go to.
    scale : float, optional
        Positive factor of the scores (default ``1 / sqrt(d)``).
    causal : bool
        Query ``i`` sees keys ``j <= i`` only (``seq_q`` must equal ``seq_k``).
    key_visible : ndarray (n, seq_k) of bool, optional
        True = the key may be attended to. A query that sees no key gets output 0.
    attn_mask : ndarray (seq_q, seq_k) or (m, seq_q, seq_k), optional
        Float mask added to the scaled scores after the scores' check (``-inf``: not allowed;
        NaN and ``+inf`` are refused); ``m`` divides ``n``: heads ``b`` with ``b // (n / m) =
        i`` read mask ``i`` (``m`` = batch: a mask per batch item, which its heads share, read
        in place, not copied per head, on the CPU). Added in float64, the sum rounded to the
        data's dtype.
        The softmax invariant is judged on these masked scores (module docstring). Combines
        with ``causal``, ``key_visible`` and ``key_add``.
    dropout : float
        Attention dropout probability in ``[0, 1]`` (0: none): the output is
        ``(P * keep / (1 - p)) v``, ``keep`` regenerated per tile from ``dropout_seed``
        (:func:`attention.dropout_hash.keep_mask` materializes it); ``p = 1`` drops every
        entry (output 0), as :mod:`attention.dropout` does.
    dropout_seed : int, optional
        Seed of the keep decisions, in ``[0, 2^64)``; drawn from a new unseeded generator when
        None (with ``dropout`` > 0).
    workspace : Workspace, optional
        Where the call's scratch arrays (the keys' transposed blocks) are kept for the next call
        at the same shape, and whose recycled outputs ``out`` comes from (NumPy data); new
        arrays every call when None.
    defer : Deferred, optional
        An attention pass's (:mod:`attention.fused_deferred`): CuPy data's checks are read at
        the pass's settle, not here. NumPy data's are host memory, read here at no cost.
    key_add : ndarray (m, seq_k), optional
        Float per-key mask added to every query row's scaled scores, ``m`` dividing ``n``: heads
        ``b`` with ``b // (n / m) = h`` read row ``h`` (a float key padding mask ``(batch,
        seq_k)``, shared by a batch item's heads; O(seq_k) per item, never expanded to the
        scores' shape). Refused as ``attn_mask`` is, alone and summed with it. Where both are
        given, their float64 sum ``attn_mask + key_add`` is added to the scaled score and the
        result rounded once: the scores, and so every result, equal bit for bit those of one
        ``attn_mask`` holding that sum (a folded mask).
    check_finite : bool
        Scan ``q``, ``k`` and ``v`` for INF and NaN (``ValueError``), or, False, trust a caller
        that just did (:func:`attention.core.core_forward` and the layers, which run the unfused
        core on such data). Unscanned, a non-finite ``q`` or ``k`` fails the scores' checks
        (``UncorrectableError``), a non-finite ``v`` gives non-finite outputs, as plain math
        would.

    Returns
    -------
    out : ndarray (n, seq_q, d)
        A new array, or one recycled from ``workspace`` that nothing else references.
    saved : dict
        What :func:`fused_backward` needs: the inputs (not copied), ``out`` and ``lse``, the row
        log-sum-exp ``(n, seq_q)`` (``-inf`` for a row that sees no key; float32 for 16-bit
        data), ``lse_lo``, what ``lse`` rounded away (module docstring), the masks as the
        kernels read them (``visible``, ``add``, ``keys`` and ``key_heads``, and the tiles they
        hide throughout, ``hidden`` and ``hidden_keys``: the backward skips them too without
        reading the masks again), ``dropout``, ``(p,
        seed)`` or None, and ``sums`` ``(n, seq_q, 4)`` (float64; None with ``check="off"``):
        the output rows' checksums the kernel carried, which
        :func:`attention.fused_final.verify_output` checks the returned ``out`` against, and
        the rows' sums of the probabilities the product kept (after dropout), which
        :func:`attention.fused_final.verify_grads` predicts ``dV`` with.

    Raises
    ------
    abftgemm.UncorrectableError
        A flagged tile or block still failed its check after recomputation.
    """
    if is_cupy_array(q):  # the CUDA kernels: attention/_cuda_fused.py
        from attention import _cuda_fused
        return _cuda_fused.fused_forward(q, k, v, ctx, scale=scale, causal=causal,
                                         key_visible=key_visible, attn_mask=attn_mask,
                                         dropout=dropout, dropout_seed=dropout_seed,
                                         defer=defer, key_add=key_add, check_finite=check_finite)
    scale, visible = _validate(q, k, v, scale, causal, key_visible, check_finite)
    drop = dropout_of(dropout, dropout_seed)
    add = _NO_ADD if attn_mask is None else additive_of(np, attn_mask, q, k)
    keys, heads = (_NO_KEYS, 1) if key_add is None else \
        key_additive_of(np, key_add, q, k, None if attn_mask is None else add)
    n, lq, d = q.shape
    lk, dt = k.shape[1], work_dtype(q.dtype)
    check, correct = ctx.check != "off", ctx.check == "correct"
    qw, kw, vw = (in_work_dtype(x) for x in (q, k, v))
    kernels = _kernels()
    hidden, hidden_keys = _hidden(kernels, add), _hidden_keys(visible, keys, heads, n, lk)
    ve = _row_encodings(kernels, vw, check)
    out = _output(qw, workspace, "out")
    lse, lse_lo = np.empty((n, lq), dt), np.empty((n, lq), dt)
    sums = np.zeros((n, lq, 4))
    nqb = -(-lq // K.BR)
    tiles = -(-lk // K.BC)
    rec = np.zeros((n * nqb, len(K.SITES), K.FIELDS))
    status = np.zeros(n * nqb, np.int64)
    groups = (K.ForwardOperands(qw, kw, _transposed(kernels, kw, workspace, "k"), vw, ve),
              K.Mask(visible, add, n // add.shape[0], hidden, keys, heads, hidden_keys,
                     dt.type(scale), causal),
              K.ForwardRules(check, correct, coefficients(d, K.BR, dt, block=d),
                             coefficients(lk, d, dt, 2 * tiles, min(lk, K.BC)),
                             coefficients(lk, 1, dt, 2 * tiles), probs_tolerance(dt),
                             gemm_rows(dt, d, K.BR)),
              K.Dropout(*kernel_dropout(drop, dt)), K.ForwardOutputs(out, lse, lse_lo, sums))
    with one_blas_thread():
        if ctx.fault_hook is None:
            kernels.forward(*groups, rec, status)
        else:
            block, _ = K.python_drivers(_site_hook(ctx))
            for t in range(n * nqb):
                status[t] = block(*groups, t // nqb, (t % nqb) * K.BR, rec[t])
    _book(ctx, rec, status, lambda t: t // nqb, FORWARD_SITES, check)
    if out.dtype != q.dtype:
        with np.errstate(over="ignore"):  # an overflow of q's dtype: the callers judge it
            out = out.astype(q.dtype)
    return out, {"q": q, "k": k, "v": v, "out": out, "lse": lse, "lse_lo": lse_lo,
                 "scale": scale, "causal": causal, "visible": visible, "add": add, "keys": keys,
                 "key_heads": heads, "hidden": hidden, "hidden_keys": hidden_keys,
                 "dropout": drop, "sums": sums if check else None}


def fused_backward(saved: dict[str, Any], d_out: Any, ctx: Context,
                   workspace: Workspace | None = None, defer: Deferred | None = None,
                   check_finite: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq, dk, dv)`` (new arrays) from the gradient ``d_out`` ``(n, seq_q, d)`` of
    :func:`fused_forward`'s output (C-contiguous, its dtype, finite: scanned for INF and NaN
    unless ``check_finite`` is False, as :func:`fused_forward`'s inputs, where a non-finite one
    fails the tiles' checks; its outputs
    recycled in ``workspace`` as there), FlashAttention-2 style:
    ``P`` recomputed per tile from the saved log-sum-exp, every tile and accumulator checked
    (module docstring; fault hook sites :data:`BACKWARD_SITES`); ``defer`` as
    :func:`fused_forward`'s.

    Raises
    ------
    abftgemm.UncorrectableError
        A flagged tile or block still failed its check after recomputation.
    """
    if is_cupy_array(saved["q"]):
        from attention import _cuda_fused
        return _cuda_fused.fused_backward(saved, d_out, ctx, defer, check_finite)
    check_gradient(np, d_out, saved["q"], all_finite if check_finite else trusted)
    q, k, v, out, d_out = (in_work_dtype(x) for x in (saved["q"], saved["k"], saved["v"],
                                                       saved["out"], d_out))
    lse = saved["lse"]
    n, lq, d = q.shape
    lk, dt = k.shape[1], q.dtype
    check, correct = ctx.check != "off", ctx.check == "correct"
    dq, dk, dv = (_output(x, workspace, name) for x, name in ((q, "dq"), (k, "dk"), (v, "dv")))
    dqc = np.empty((n, lq, 3))
    kvc = np.empty((n, lk if check else 0, 6))
    rec = np.zeros((n, len(K.SITES), K.FIELDS))
    status = np.zeros(n, np.int64)
    groups = (K.BackwardOperands(q, k, v, d_out, out, lse, saved["lse_lo"]),
              K.Mask(saved["visible"], saved["add"], n // saved["add"].shape[0],
                     saved["hidden"], saved["keys"], saved["key_heads"], saved["hidden_keys"],
                     dt.type(saved["scale"]), saved["causal"]),
              K.BackwardRules(check, correct, coefficients(d, K.BC, dt, block=d),
                              coefficients(lq, d, dt, -(-lq // K.BR), min(lq, K.BR)),
                              coefficients(lk, d, dt, -(-lk // K.BC), min(lk, K.BC)),
                              probs_tolerance(dt), dscores_entry_tolerance(dt),
                              gemm_rows(dt, d, K.BR)),
              K.Dropout(*kernel_dropout(saved.get("dropout"), dt)),
              K.Gradients(dq, dk, dv, dqc, kvc))
    with one_blas_thread():
        if ctx.fault_hook is None:
            _kernels().backward(*groups, rec, status)
        else:
            _, head = K.python_drivers(_site_hook(ctx))
            for b in range(n):
                status[b] = head(*groups, b, rec[b])
    _book(ctx, rec, status, lambda t: t, BACKWARD_SITES, check)
    saved["kv_sums"] = kvc if check else None
    half = saved["q"].dtype
    with np.errstate(over="ignore"):  # an overflow of the 16-bit dtype: judged, not warned
        return tuple(g if g.dtype == half else g.astype(half) for g in (dq, dk, dv))


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype the tiles of ``dtype`` data are computed, accumulated and checked in: float64
    for float64, else float32 (float16 and bfloat16 are converted at the kernel's entry, as
    PyTorch's CPU flash attention computes half types in float32)."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def in_work_dtype(x: np.ndarray) -> np.ndarray:
    """``x`` itself in float32 or float64, else a float32 copy (O(L d) per head; exact): what
    the numba kernels take of :func:`work_dtype`'s data."""
    wt = work_dtype(x.dtype)
    return x if x.dtype == wt else x.astype(wt)


def _validate(q: Any, k: Any, v: Any, scale: float | None, causal: bool,
              key_visible: Any | None, check_finite: bool) -> tuple[float, np.ndarray]:
    """Check the inputs (their finiteness with ``check_finite``); ``(scale, key_visible as (n,
    seq_k) bool or an empty (1, 0))``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array (the fused core runs on the CPU), "
                            f"got {type(t).__name__}")
        if t.dtype not in SUPPORTED or t.dtype != q.dtype:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, of q's dtype"
                            f" {q.dtype}; got {t.dtype}")
    scale = check_inputs(q, k, v, scale, causal, all_finite if check_finite else trusted)
    if key_visible is None:
        return scale, np.ones((1, 0), bool)
    return scale, key_visible_of(np, key_visible, q, k)


def _hidden(kernels: Any, add: np.ndarray) -> np.ndarray:
    """:func:`attention._cpu_fused.hidden_tiles` of the additive mask ``add`` ``(m, seq_q,
    seq_k)`` (``kernels``: :func:`_kernels`), or an empty ``(1, 0, 0)`` for none."""
    if not add.size:
        return _NO_HIDDEN
    out = np.empty((add.shape[0], -(-add.shape[1] // K.BR), -(-add.shape[2] // K.BC)), bool)
    kernels.hidden_tiles(add, out)
    return out


def _hidden_keys(visible: np.ndarray, keys: np.ndarray, key_heads: int, n: int,
                 lk: int) -> np.ndarray:
    """``(n, key blocks)`` bool: the key blocks of :data:`attention._cpu_fused.BC` keys that
    key visibility ``visible`` ``(n, seq_k)`` and the per-key mask ``keys`` ``(n / key_heads,
    seq_k)`` (``-inf``) hide throughout from each head (padding), whose tiles the kernels skip;
    an empty ``(1, 0)`` where neither is given. O(L) per head."""
    if not (visible.size or keys.size):
        return np.zeros((1, 0), bool)
    blocks = -(-lk // K.BC)
    hidden = np.ones((n, blocks * K.BC), bool)  # the last block's missing keys count as hidden
    seen = hidden[:, :lk]
    seen[...] = False
    if visible.size:
        seen |= ~visible
    if keys.size:
        seen |= np.repeat(keys == -np.inf, key_heads, axis=0)
    return hidden.reshape(n, blocks, K.BC).all(axis=2)


def _row_encodings(kernels: Any, x: np.ndarray, check: bool) -> np.ndarray:
    """``(n, 3, L)`` row encodings of ``x`` over its last axis (``kernels``: :func:`_kernels`),
    or an empty ``(n, 3, 0)``."""
    if not check:
        return np.zeros((x.shape[0], 3, 0))
    out = np.empty((x.shape[0], 3, x.shape[1]))
    kernels.encode_rows(x, out)
    return out


def _transposed(kernels: Any, x: np.ndarray, workspace: Workspace | None,
                name: str) -> np.ndarray:
    """``x`` ``(n, L, d)`` as :func:`attention._cpu_fused.transpose_blocks` lays it out: each
    key block's transpose, contiguous (O(L d) a head), in ``workspace``'s buffer ``name`` when
    given (a new array is a fresh mapping for large ``x``: page faults on every call)."""
    shape = (x.shape[0], x.shape[1] * x.shape[2])
    out = np.empty(shape, x.dtype) if workspace is None else \
        workspace.buffer(f"fused:{name}^T", np, shape, x.dtype)
    kernels.transpose_blocks(x, out)
    return out


def _output(like: np.ndarray, workspace: Workspace | None, name: str) -> np.ndarray:
    """A new output array of ``like``'s shape and dtype: from ``workspace``'s recycled outputs
    (:meth:`attention.workspace.Workspace.recycled`: no page faults on memory the C allocator
    gave back) when given."""
    if workspace is None:
        return np.empty_like(like)
    return workspace.recycled(f"fused:{name}", np, like.shape, like.dtype)


def _kernels() -> Any:
    """The fused kernels (:mod:`attention._cpu_fused`) in numba's pool, or their serial twins
    (:func:`abftgemm.threads.pool_kernels`); the BLAS inside them at one thread
    (:func:`abftgemm.threads.one_blas_thread`)."""
    return pool_kernels(K, K.SERIAL)


def _site_hook(ctx: Context) -> Any:
    """The Python drivers' hook: site index -> ``ctx.fault_hook(name, tile)``."""
    user = ctx.fault_hook
    return lambda site, tile: user(K.HOOK_SITES[site], tile)
