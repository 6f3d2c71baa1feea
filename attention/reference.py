"""Float64 NumPy reference for multi-head self-attention (forward and analytic backward).

This module is the test oracle for the checksum-protected attention layer.
It is deliberately plain: NumPy only, everything in float64, one small
function per step, no fault tolerance.  Its backward pass is checked against
central finite differences (tests/test_attention_reference.py).

Conventions (a contract other code relies on)
---------------------------------------------
* ``params`` is a dict with ``"wq", "wk", "wv", "wo"`` of shape
  ``(d_model, d_model)``, applied as ``x @ w``, and ``"bq", "bk", "bv", "bo"``
  of shape ``(d_model,)``.
* ``x`` has shape ``(batch, seq, d_model)``; ``n_heads`` divides ``d_model``
  and head ``h`` uses the contiguous column block ``[h*hd:(h+1)*hd]`` of Q, K
  and V, where ``hd = d_model // n_heads``.
* ``Q = x@wq + bq``, ``K = x@wk + bk``, ``V = x@wv + bv``; per head
  ``S = Q_h K_hᵀ / sqrt(hd)``.
* ``mask`` is an optional boolean ``(batch, seq)`` key-padding mask,
  ``True`` = attend: key ``j`` is visible iff ``mask[b, j]``.  ``causal=True``
  additionally hides keys ``j > i``.
* ``P`` is the softmax of ``S`` over the visible keys; a row with no visible
  key gets ``P = 0`` everywhere, so its context is 0 and its output row is
  just ``bo``.  Hidden entries get zero gradient.
* ``CL = P V_h`` concatenated over heads, shape ``(batch, seq, d_model)``;
  ``y = CL @ wo + bo``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "PARAM_KEYS",
    "init_params",
    "visible",
    "split_heads",
    "merge_heads",
    "masked_softmax",
    "softmax_backward",
    "project",
    "attention_scores",
    "attention_probs",
    "forward",
    "backward_steps",
    "backward",
]

#: Keys of the parameter dict (and of the gradient dict returned by ``backward``).
PARAM_KEYS: tuple[str, ...] = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")

Params = dict[str, np.ndarray]
Cache = dict[str, Any]


# --------------------------------------------------------------------------- helpers


def _f64(a: Any) -> np.ndarray:
    """Return ``a`` as a float64 ndarray (copying only when needed)."""
    return np.asarray(a, dtype=np.float64)


def _as_params(params: Params, d_model: int) -> Params:
    """Cast every parameter to float64 and check its shape.

    Parameters
    ----------
    params : dict of str -> array_like
        Must contain every key of :data:`PARAM_KEYS`.
    d_model : int
        Model width.

    Returns
    -------
    dict of str -> ndarray
        float64 copies/views, weights ``(d_model, d_model)``, biases ``(d_model,)``.
    """
    missing = [key for key in PARAM_KEYS if key not in params]
    if missing:
        raise KeyError(f"params is missing {missing}")
    out: Params = {}
    for key in PARAM_KEYS:
        value = _f64(params[key])
        expected = (d_model, d_model) if key.startswith("w") else (d_model,)
        if value.shape != expected:
            raise ValueError(f"params[{key!r}] has shape {value.shape}, expected {expected}")
        out[key] = value
    return out


def _head_dim(d_model: int, n_heads: int) -> int:
    """Return ``d_model // n_heads``, checking that ``n_heads`` divides ``d_model``."""
    if n_heads < 1 or d_model % n_heads != 0:
        raise ValueError(f"n_heads={n_heads} must be >= 1 and divide d_model={d_model}")
    return d_model // n_heads


def init_params(d_model: int, rng: np.random.Generator, scale: float = 1.0) -> Params:
    """Draw random float64 parameters following the module's conventions.

    Parameters
    ----------
    d_model : int
        Model width.
    rng : numpy.random.Generator
        Source of randomness.
    scale : float, optional
        Weights are ``N(0, scale² / d_model)``, biases ``N(0, scale²)``.

    Returns
    -------
    dict of str -> ndarray
        Weights ``(d_model, d_model)`` and biases ``(d_model,)``.
    """
    std_w = scale / np.sqrt(d_model)
    params: Params = {}
    for key in PARAM_KEYS:
        shape = (d_model, d_model) if key.startswith("w") else (d_model,)
        params[key] = rng.normal(0.0, std_w if key.startswith("w") else scale, size=shape)
    return params


def visible(mask: np.ndarray | None, causal: bool, batch: int, seq: int) -> np.ndarray:
    """Which (query, key) pairs may attend.

    Parameters
    ----------
    mask : ndarray of bool, shape (batch, seq), or None
        Key-padding mask, ``True`` = attend.  ``None`` means every key is visible.
    causal : bool
        If true, key ``j`` is additionally hidden from query ``i`` when ``j > i``.
    batch, seq : int
        Problem size.

    Returns
    -------
    ndarray of bool, shape (batch, 1, seq, seq)
        ``out[b, 0, i, j]`` is true iff query ``i`` of batch row ``b`` sees key ``j``.
        The singleton axis broadcasts over heads.
    """
    vis = np.ones((batch, 1, seq, seq), dtype=bool)
    if mask is not None:
        keys = np.asarray(mask)
        if keys.shape != (batch, seq):
            raise ValueError(f"mask has shape {keys.shape}, expected {(batch, seq)}")
        if keys.dtype != np.bool_:
            raise TypeError(f"mask must be boolean, got dtype {keys.dtype}")
        vis &= keys[:, None, None, :]
    if causal:
        vis &= np.tril(np.ones((seq, seq), dtype=bool))[None, None, :, :]
    return vis


def split_heads(t: np.ndarray, n_heads: int) -> np.ndarray:
    """Split the feature axis into heads.

    Parameters
    ----------
    t : ndarray, shape (batch, seq, d_model)
    n_heads : int

    Returns
    -------
    ndarray, shape (batch, n_heads, seq, hd)
        ``out[:, h] == t[:, :, h*hd:(h+1)*hd]``.
    """
    batch, seq, d_model = t.shape
    hd = _head_dim(d_model, n_heads)
    return t.reshape(batch, seq, n_heads, hd).transpose(0, 2, 1, 3)


def merge_heads(t: np.ndarray) -> np.ndarray:
    """Inverse of :func:`split_heads`.

    Parameters
    ----------
    t : ndarray, shape (batch, n_heads, seq, hd)

    Returns
    -------
    ndarray, shape (batch, seq, n_heads * hd)
    """
    batch, n_heads, seq, hd = t.shape
    return t.transpose(0, 2, 1, 3).reshape(batch, seq, n_heads * hd)


# --------------------------------------------------------------------------- softmax


def masked_softmax(s: np.ndarray, vis: np.ndarray) -> np.ndarray:
    """Softmax over the last axis restricted to visible entries.

    Parameters
    ----------
    s : ndarray, shape (..., seq_q, seq_k)
        Scores.  Hidden entries are ignored (they may hold anything finite).
    vis : ndarray of bool, broadcastable to ``s.shape``
        Visible entries.

    Returns
    -------
    ndarray, shape ``s.shape``
        Probabilities: each row sums to 1 over its visible entries; hidden
        entries are 0, and a row with no visible entry is all 0.
    """
    s = _f64(s)
    vis = np.broadcast_to(vis, s.shape)
    any_visible = vis.any(axis=-1, keepdims=True)
    row_max = np.where(vis, s, -np.inf).max(axis=-1, keepdims=True)
    row_max = np.where(any_visible, row_max, 0.0)
    e = np.where(vis, np.exp(np.where(vis, s - row_max, 0.0)), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    return np.where(any_visible, e / np.where(any_visible, denom, 1.0), 0.0)


def softmax_backward(dp: np.ndarray, p: np.ndarray, vis: np.ndarray) -> np.ndarray:
    """Gradient of the loss w.r.t. the scores, given the gradient w.r.t. the probabilities.

    ``dS = P * (dP - rowsum(dP * P))``, then hidden entries set to 0.

    Parameters
    ----------
    dp : ndarray, shape (..., seq_q, seq_k)
        Gradient w.r.t. ``P``.
    p : ndarray, shape (..., seq_q, seq_k)
        Probabilities from :func:`masked_softmax`.
    vis : ndarray of bool, broadcastable to ``p.shape``

    Returns
    -------
    ndarray, shape ``p.shape``
        Gradient w.r.t. the scores; 0 at hidden entries and on fully hidden rows.
    """
    row = (dp * p).sum(axis=-1, keepdims=True)
    ds = p * (dp - row)
    return np.where(vis, ds, 0.0)


# --------------------------------------------------------------------------- forward


def project(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Affine projection ``x @ w + b``.

    Parameters
    ----------
    x : ndarray, shape (batch, seq, d_in)
    w : ndarray, shape (d_in, d_out)
    b : ndarray, shape (d_out,)

    Returns
    -------
    ndarray, shape (batch, seq, d_out)
    """
    return x @ w + b


def attention_scores(q: np.ndarray, k: np.ndarray, n_heads: int) -> np.ndarray:
    """Scaled dot-product scores per head.

    Parameters
    ----------
    q, k : ndarray, shape (batch, seq, d_model)
    n_heads : int

    Returns
    -------
    ndarray, shape (batch, n_heads, seq, seq)
        ``S[b, h] = Q_h K_hᵀ / sqrt(hd)``.
    """
    hd = _head_dim(q.shape[-1], n_heads)
    qh, kh = split_heads(q, n_heads), split_heads(k, n_heads)
    return qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(hd)


def attention_probs(
    q: np.ndarray,
    k: np.ndarray,
    n_heads: int,
    mask: np.ndarray | None = None,
    causal: bool = False,
) -> np.ndarray:
    """Attention probabilities ``P = masked softmax(Q_h K_hᵀ / sqrt(hd))``.

    Parameters
    ----------
    q, k : array_like, shape (batch, seq, d_model)
        Projected queries and keys (biases already added).
    n_heads : int
    mask : ndarray of bool, shape (batch, seq), or None
        Key-padding mask, ``True`` = attend.
    causal : bool

    Returns
    -------
    ndarray, shape (batch, n_heads, seq, seq)
    """
    q, k = _f64(q), _f64(k)
    batch, seq, _ = q.shape
    return masked_softmax(attention_scores(q, k, n_heads), visible(mask, causal, batch, seq))


def forward(
    x: np.ndarray,
    params: Params,
    n_heads: int,
    mask: np.ndarray | None = None,
    causal: bool = False,
    dropout: float = 0.0,
    dropout_keep: np.ndarray | None = None,
) -> tuple[np.ndarray, Cache]:
    """Multi-head self-attention forward pass in float64.

    Parameters
    ----------
    x : array_like, shape (batch, seq, d_model)
    params : dict of str -> array_like
        ``wq, wk, wv, wo`` of shape (d_model, d_model); ``bq, bk, bv, bo`` of shape (d_model,).
    n_heads : int
        Must divide ``d_model``.
    mask : ndarray of bool, shape (batch, seq), or None
        Key-padding mask, ``True`` = attend.
    causal : bool
        Hide keys ``j > i`` from query ``i``.
    dropout : float
        Attention dropout probability; with it, ``dropout_keep``.
    dropout_keep : ndarray of bool, shape (batch, n_heads, seq, seq), or None
        The dropout mask, ``True`` = kept: the context multiplies
        ``P * keep / (1 - dropout)`` (0 everywhere for ``dropout == 1``).

    Returns
    -------
    y : ndarray, shape (batch, seq, d_model)
        ``concat_h(P_h V_h) @ wo + bo``.
    cache : dict
        Intermediates for :func:`backward`:
        ``x, q, k, v, context`` of shape (batch, seq, d_model),
        ``p`` and ``p_dropped`` (the probabilities after dropout) of shape
        (batch, n_heads, seq, seq), ``keep_scaled`` (``keep / (1 - dropout)``, or 1) and
        ``visible`` (bool) of shape (batch, 1, seq, seq).
    """
    x = _f64(x)
    if x.ndim != 3:
        raise ValueError(f"x must have shape (batch, seq, d_model), got {x.shape}")
    batch, seq, d_model = x.shape
    _head_dim(d_model, n_heads)
    prm = _as_params(params, d_model)

    q = project(x, prm["wq"], prm["bq"])
    k = project(x, prm["wk"], prm["bk"])
    v = project(x, prm["wv"], prm["bv"])
    vis = visible(mask, causal, batch, seq)
    p = masked_softmax(attention_scores(q, k, n_heads), vis)
    if (dropout_keep is None) != (dropout == 0):
        raise ValueError("give dropout_keep exactly when dropout > 0")
    keep_scaled = 1.0 if dropout_keep is None else \
        np.where(dropout_keep, 0.0 if dropout == 1 else 1 / (1 - dropout), 0.0)
    p_dropped = p * keep_scaled
    context = merge_heads(p_dropped @ split_heads(v, n_heads))
    y = project(context, prm["wo"], prm["bo"])
    cache: Cache = {"x": x, "q": q, "k": k, "v": v, "p": p, "p_dropped": p_dropped,
                    "keep_scaled": keep_scaled, "context": context, "visible": vis}
    return y, cache


# --------------------------------------------------------------------------- backward


def _weight_grad(inp: np.ndarray, dout: np.ndarray) -> np.ndarray:
    """``Σ_batch inpᵀ dout``: gradient of ``inp @ w`` w.r.t. ``w``.

    Parameters
    ----------
    inp : ndarray, shape (batch, seq, d_in)
    dout : ndarray, shape (batch, seq, d_out)

    Returns
    -------
    ndarray, shape (d_in, d_out)
    """
    return np.einsum("bsi,bso->io", inp, dout)


def _bias_grad(dout: np.ndarray) -> np.ndarray:
    """Sum of ``dout`` over batch and seq, shape (d_out,)."""
    return dout.sum(axis=(0, 1))


def backward_steps(
    dy: np.ndarray,
    cache: Cache,
    params: Params,
    n_heads: int,
) -> dict[str, np.ndarray]:
    """Analytic backward pass of :func:`forward`, returning every named intermediate.

    Parameters
    ----------
    dy : array_like, shape (batch, seq, d_model)
        Gradient of the loss w.r.t. ``y``.
    cache : dict
        Second return value of :func:`forward`.
    params : dict of str -> array_like
        The parameters used in the forward pass.
    n_heads : int
        As in the forward pass.

    Returns
    -------
    dict of str -> ndarray
        ``d_context`` (batch, seq, d_model): gradient w.r.t. CL;
        ``d_p``, ``d_s`` (batch, n_heads, seq, seq): w.r.t. P and the scores S;
        ``d_q``, ``d_k``, ``d_v`` (batch, seq, d_model): w.r.t. Q, K, V;
        ``dx`` (batch, seq, d_model); and one entry per key of ``params``
        (``wq`` ... ``bo``) holding that parameter's gradient.

    Notes
    -----
    Steps (per head ``h``; ``/√hd`` is the score scale; ``P_d`` the probabilities after
    dropout, ``D = keep / (1 - dropout)``, ``P_d = P`` and ``D = 1`` without)::

        dWo = CLᵀ dY            dbo = Σ dY            dCL = dY Woᵀ
        dP  = (dCL_h V_hᵀ) * D  dV_h = P_dᵀ dCL_h
        dS  = P * (dP - rowsum(dP * P))   (0 where hidden)
        dQ_h = dS K_h / √hd     dK_h = dSᵀ Q_h / √hd
        dW{q,k,v} = xᵀ d{Q,K,V} db{q,k,v} = Σ d{Q,K,V}
        dx = dQ Wqᵀ + dK Wkᵀ + dV Wvᵀ
    """
    x, q, k, v = cache["x"], cache["q"], cache["k"], cache["v"]
    p, context, vis = cache["p"], cache["context"], cache["visible"]
    p_dropped, keep_scaled = cache.get("p_dropped", p), cache.get("keep_scaled", 1.0)
    dy = _f64(dy)
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {dy.shape}, expected {x.shape}")
    d_model = x.shape[-1]
    hd = _head_dim(d_model, n_heads)
    prm = _as_params(params, d_model)
    scale = 1.0 / np.sqrt(hd)

    # out_proj: y = CL Wo + bo
    d_wo = _weight_grad(context, dy)
    d_bo = _bias_grad(dy)
    d_context = dy @ prm["wo"].T
    d_clh = split_heads(d_context, n_heads)  # (b, h, s, hd)

    # context: CL_h = P V_h
    vh = split_heads(v, n_heads)
    d_p = d_clh @ vh.transpose(0, 1, 3, 2) * keep_scaled  # (b, h, s, s)
    d_vh = p_dropped.transpose(0, 1, 3, 2) @ d_clh  # (b, h, s, hd)

    # softmax
    d_s = softmax_backward(d_p, p, vis)

    # scores: S = Q_h K_hᵀ / √hd
    d_qh = d_s @ split_heads(k, n_heads) * scale
    d_kh = d_s.transpose(0, 1, 3, 2) @ split_heads(q, n_heads) * scale
    d_q, d_k, d_v = merge_heads(d_qh), merge_heads(d_kh), merge_heads(d_vh)

    # projections: Q = x Wq + bq, etc.
    dx = d_q @ prm["wq"].T + d_k @ prm["wk"].T + d_v @ prm["wv"].T
    return {
        "d_context": d_context,
        "d_p": d_p,
        "d_s": d_s,
        "d_q": d_q,
        "d_k": d_k,
        "d_v": d_v,
        "dx": dx,
        "wq": _weight_grad(x, d_q),
        "wk": _weight_grad(x, d_k),
        "wv": _weight_grad(x, d_v),
        "wo": d_wo,
        "bq": _bias_grad(d_q),
        "bk": _bias_grad(d_k),
        "bv": _bias_grad(d_v),
        "bo": d_bo,
    }


def backward(
    dy: np.ndarray,
    cache: Cache,
    params: Params,
    n_heads: int,
) -> tuple[np.ndarray, Params]:
    """Analytic backward pass of :func:`forward`.

    Parameters
    ----------
    dy : array_like, shape (batch, seq, d_model)
        Gradient of the loss w.r.t. ``y``.
    cache : dict
        Second return value of :func:`forward`.
    params : dict of str -> array_like
        The parameters used in the forward pass.
    n_heads : int
        As in the forward pass.

    Returns
    -------
    dx : ndarray, shape (batch, seq, d_model)
        Gradient w.r.t. ``x``.
    grads : dict of str -> ndarray
        Same keys and shapes as ``params``.

    See Also
    --------
    backward_steps : the same computation, exposing dCL, dP, dS, dQ, dK, dV.
    """
    steps = backward_steps(dy, cache, params, n_heads)
    return steps["dx"], {key: steps[key] for key in PARAM_KEYS}
