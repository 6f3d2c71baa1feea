"""A small GPT-style character-level language model on protected GEMMs, with a manual backward.

Token embedding + learned positions -> ``n_layers`` pre-LayerNorm blocks
``[LayerNorm -> MultiHeadAttention(causal) -> residual -> LayerNorm -> MLP(GELU) -> residual]`` ->
final LayerNorm -> output projection -> cross-entropy.  Every GEMM of the model, forward and
backward, runs through :func:`abftgemm.matmul` (the attention's through
:class:`attention.MultiHeadAttention`) with one check mode and one ``fault_hook``, so a fault can
be injected at any site and the step's :class:`abftgemm.Report` says what protection found.

Site names besides the attention's :data:`attention.SITES`: ``"mlp_up"``, ``"mlp_down"``,
``"lm_head"`` (forward) and ``"d_mlp_up_w"``, ``"d_mlp_up_x"``, ``"d_mlp_down_w"``,
``"d_mlp_down_x"``, ``"d_lm_head_w"``, ``"d_lm_head_x"`` (backward: weight and input gradients).

The array module ``xp`` is NumPy or CuPy; everything here is written once for both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import abftgemm
from abftgemm import PlanCache, Report
from abftgemm.backend import array_module
from attention import MultiHeadAttention

FaultHook = Callable[[str, Any], None]

#: GEMM sites of one block's MLP, forward then backward.
MLP_SITES: tuple[str, ...] = ("mlp_up", "mlp_down", "d_mlp_up_w", "d_mlp_up_x", "d_mlp_down_w",
                              "d_mlp_down_x")
_GELU_C = math.sqrt(2.0 / math.pi)


@dataclass
class Gemm:
    """How one training step runs its GEMMs: check mode, fault hook, and the report collected.

    Attributes
    ----------
    check : {"correct", "detect", "off"}
    fault_hook : callable ``(site, c)`` or None
    report : Report
        Findings of every protected product run through this object.
    plans : PlanCache
        Where the planned products are kept (the model's: one plan per distinct product, not
        per site, so no step after the first makes one).
    """

    check: str = "correct"
    fault_hook: FaultHook | None = None
    report: Report = field(default_factory=Report)
    plans: PlanCache = field(default_factory=PlanCache)

    def __call__(self, a: Any, b: Any, site: str, bias: Any | None = None) -> Any:
        """``a @ b (+ bias)`` through :func:`abftgemm.matmul` at ``site``."""
        c, report = abftgemm.matmul(a, b, bias=bias, check=self.check, fault_hook=self.fault_hook,
                                    name=site, return_report=True, plans=self.plans)
        self.report.extend(report)
        return c


# ----------------------------------------------------------------------------- elementwise pieces


def layer_norm_forward(x: Any, g: Any, b: Any, eps: float = 1e-5) -> tuple[Any, tuple]:
    """LayerNorm over the last axis: ``g * (x - mean) / sqrt(var + eps) + b``.

    Returns
    -------
    y : array, same shape as ``x``
    cache : tuple
        ``(xhat, inv_std, g)`` for :func:`layer_norm_backward`.
    """
    centred = x - x.mean(axis=-1, keepdims=True)
    inv_std = 1.0 / _xp(x).sqrt((centred * centred).mean(axis=-1, keepdims=True) + eps)
    xhat = centred * inv_std
    return (xhat * g + b).astype(x.dtype), (xhat, inv_std, g)


def layer_norm_backward(dy: Any, cache: tuple) -> tuple[Any, Any, Any]:
    """Gradients of :func:`layer_norm_forward`.

    Returns
    -------
    dx : array, shape of ``dy``
    dg, db : array (features,)
    """
    xhat, inv_std, g = cache
    n = xhat.shape[-1]
    lead = tuple(range(dy.ndim - 1))
    dg = (dy * xhat).sum(axis=lead)
    db = dy.sum(axis=lead)
    dxhat = dy * g
    dx = inv_std / n * (n * dxhat - dxhat.sum(axis=-1, keepdims=True)
                        - xhat * (dxhat * xhat).sum(axis=-1, keepdims=True))
    return dx.astype(dy.dtype), dg.astype(dy.dtype), db.astype(dy.dtype)


def gelu_forward(x: Any) -> tuple[Any, Any]:
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    Returns ``(y, cache)``; the cache is ``x``.
    """
    t = _gelu_tanh(x)
    return (0.5 * x * (1.0 + t)).astype(x.dtype), x


def gelu_backward(dy: Any, x: Any) -> Any:
    """Gradient of :func:`gelu_forward` with respect to its input ``x``."""
    t = _gelu_tanh(x)
    du = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return (dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)).astype(dy.dtype)


def _gelu_tanh(x: Any) -> Any:
    xp = _xp(x)
    return xp.tanh(_GELU_C * (x + 0.044715 * x * x * x))


def cross_entropy_forward(logits: Any, targets: Any) -> tuple[float, tuple]:
    """Mean cross-entropy of ``softmax(logits)`` against integer ``targets``.

    Parameters
    ----------
    logits : array (..., vocab)
    targets : int array (...)

    Returns
    -------
    loss : float
        NaN or INF when the logits are not finite.
    cache : tuple
        ``(probs, targets)`` for :func:`cross_entropy_backward`.
    """
    xp = _xp(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    tflat = targets.reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = flat - flat.max(axis=-1, keepdims=True)
        exp = xp.exp(shifted)
        total = exp.sum(axis=-1, keepdims=True)
        rows = xp.arange(flat.shape[0])
        loss = float((xp.log(total[:, 0]) - shifted[rows, tflat]).mean())
        probs = exp / total
    return loss, (probs, tflat, logits.shape)


def cross_entropy_backward(cache: tuple) -> Any:
    """Gradient of the mean cross-entropy with respect to the logits (same shape)."""
    probs, tflat, shape = cache
    xp = _xp(probs)
    d = probs.copy()
    d[xp.arange(d.shape[0]), tflat] -= 1.0
    return (d / d.shape[0]).reshape(shape).astype(probs.dtype)


# ----------------------------------------------------------------------------- GEMM pieces


def linear_forward(x: Any, w: Any, b: Any, site: str, gemm: Gemm) -> Any:
    """``x @ w + b`` at ``site`` (``x``: (..., d_in), ``w``: (d_in, d_out), ``b``: (d_out,))."""
    return gemm(x, w, site, bias=b)


def linear_backward(dy: Any, x: Any, w: Any, site: str, gemm: Gemm) -> tuple[Any, Any, Any]:
    """Gradients of :func:`linear_forward`: ``(dx, dw, db)``.

    ``dw = xᵀ dy`` runs at site ``"d_<site>_w"``, ``dx = dy wᵀ`` at ``"d_<site>_x"``.
    """
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw = gemm(x2.T, dy2, f"d_{site}_w")
    dx = gemm(dy2, w.T, f"d_{site}_x").reshape(x.shape)
    return dx, dw, dy2.sum(axis=0)


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`GPT`.

    Attributes
    ----------
    vocab : int
        Number of distinct tokens (characters).
    seq_len : int
        Longest context (number of learned positions).
    d_model, n_heads, n_layers, d_ff : int
        Width, heads per attention, number of blocks, MLP hidden width.
    dtype : str
        Parameter and activation dtype (as :class:`attention.MultiHeadAttention` accepts).
    """

    vocab: int
    seq_len: int = 32
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128
    dtype: str = "float32"


class Block:
    """One pre-LayerNorm transformer block: attention and MLP, each with a residual connection.

    Parameters
    ----------
    config : GPTConfig
    xp : module
        numpy or cupy.
    seed : int
        Seeds the attention layer and this block's own parameters.
    """

    def __init__(self, config: GPTConfig, xp: Any, seed: int):
        d, f = config.d_model, config.d_ff
        self.attn = MultiHeadAttention(d, config.n_heads, causal=True, dtype=config.dtype, xp=xp,
                                       seed=seed)
        dtype = self.attn.dtype
        rng = np.random.default_rng([seed, 1])
        host = {
            "ln1.g": np.ones(d), "ln1.b": np.zeros(d), "ln2.g": np.ones(d), "ln2.b": np.zeros(d),
            "mlp_up.w": rng.standard_normal((d, f)) / math.sqrt(d), "mlp_up.b": np.zeros(f),
            "mlp_down.w": rng.standard_normal((f, d)) / math.sqrt(2 * f * config.n_layers),
            "mlp_down.b": np.zeros(d),
        }
        self.params = {k: xp.asarray(v.astype(dtype)) for k, v in host.items()}

    def parameters(self) -> dict[str, Any]:
        """This block's parameters (its own and the attention's ``attn.*``), by name."""
        return {**self.params, **{f"attn.{k}": v for k, v in self.attn.params.items()}}

    def forward(self, x: Any, gemm: Gemm) -> tuple[Any, dict[str, Any]]:
        """Block output for ``x`` (batch, seq, d_model) and the cache for :meth:`backward`."""
        p = self.params
        h1, ln1 = layer_norm_forward(x, p["ln1.g"], p["ln1.b"])
        self.attn.check = gemm.check
        a, attn = self.attn.forward(h1, fault_hook=gemm.fault_hook)
        gemm.report.extend(self.attn.last_report)
        x1 = x + a
        h2, ln2 = layer_norm_forward(x1, p["ln2.g"], p["ln2.b"])
        up = linear_forward(h2, p["mlp_up.w"], p["mlp_up.b"], "mlp_up", gemm)
        act, gelu = gelu_forward(up)
        down = linear_forward(act, p["mlp_down.w"], p["mlp_down.b"], "mlp_down", gemm)
        cache = {"ln1": ln1, "attn": attn, "ln2": ln2, "h2": h2, "gelu": gelu, "act": act}
        return x1 + down, cache

    def backward(self, dy: Any, cache: dict[str, Any], gemm: Gemm) -> tuple[Any, dict[str, Any]]:
        """Gradients w.r.t. the block input and every entry of :meth:`parameters`."""
        p = self.params
        grads: dict[str, Any] = {}
        d_act, grads["mlp_down.w"], grads["mlp_down.b"] = linear_backward(
            dy, cache["act"], p["mlp_down.w"], "mlp_down", gemm)
        d_up = gelu_backward(d_act, cache["gelu"])
        d_h2, grads["mlp_up.w"], grads["mlp_up.b"] = linear_backward(
            d_up, cache["h2"], p["mlp_up.w"], "mlp_up", gemm)
        d_x1_ln, grads["ln2.g"], grads["ln2.b"] = layer_norm_backward(d_h2, cache["ln2"])
        d_x1 = dy + d_x1_ln
        self.attn.check = gemm.check
        # the backward's findings alone (the forward's went in with the forward)
        d_h1, attn_grads = self.attn.backward(d_x1, {**cache["attn"], "report": Report()},
                                              fault_hook=gemm.fault_hook)
        gemm.report.extend(self.attn.last_report)
        grads.update({f"attn.{k}": v for k, v in attn_grads.items()})
        d_x_ln, grads["ln1.g"], grads["ln1.b"] = layer_norm_backward(d_h1, cache["ln1"])
        return d_x1 + d_x_ln, grads


class GPT:
    """Character-level GPT on protected GEMMs.

    Parameters
    ----------
    config : GPTConfig
    xp : module
        numpy or cupy.
    seed : int
        Seed of every parameter initialization.

    Raises
    ------
    ValueError
        If ``config.n_layers < 1``.

    Notes
    -----
    :meth:`parameters` returns the live arrays: updating them in place (an optimizer, a checkpoint
    restore) updates the model.
    """

    def __init__(self, config: GPTConfig, xp: Any = np, seed: int = 0):
        if config.n_layers < 1:
            raise ValueError(f"n_layers must be at least 1, got {config.n_layers}")
        self.config, self.xp = config, xp
        #: The planned products of the model's own GEMMs (the attention layers keep theirs).
        self.plans = PlanCache()
        self.blocks = [Block(config, xp, seed=seed + 1 + i) for i in range(config.n_layers)]
        self.dtype = dtype = self.blocks[0].attn.dtype
        rng = np.random.default_rng([seed, 0])
        d, v = config.d_model, config.vocab
        host = {
            "tok_emb": 0.1 * rng.standard_normal((v, d)),
            "pos_emb": 0.1 * rng.standard_normal((config.seq_len, d)),
            "ln_f.g": np.ones(d), "ln_f.b": np.zeros(d),
            "lm_head.w": rng.standard_normal((d, v)) / math.sqrt(d), "lm_head.b": np.zeros(v),
        }
        self.params = {k: xp.asarray(a.astype(dtype)) for k, a in host.items()}

    def parameters(self) -> dict[str, Any]:
        """Every parameter by dotted name (``"blocks.0.attn.wq"``, ``"tok_emb"``, ...)."""
        named = dict(self.params)
        for i, block in enumerate(self.blocks):
            named.update({f"blocks.{i}.{k}": v for k, v in block.parameters().items()})
        return named

    def loss_and_grads(self, tokens: Any, targets: Any, check: str = "correct",
                       fault_hook: FaultHook | None = None, fault_layer: int | None = None
                       ) -> tuple[float, dict[str, Any], Report]:
        """Forward and backward on one batch.

        Parameters
        ----------
        tokens, targets : int arrays (batch, seq)
            Inputs and next-token targets, ``seq <= config.seq_len``.
        check : {"correct", "detect", "off"}
            Protection mode of every GEMM.
        fault_hook : callable ``(site, c)``, optional
            Passed to the GEMMs of block ``fault_layer`` only, or to every GEMM of the model when
            ``fault_layer`` is None.
        fault_layer : int, optional
            The block that gets ``fault_hook``.

        Returns
        -------
        loss : float
            Mean cross-entropy (non-finite if a fault got through).
        grads : dict
            Same keys as :meth:`parameters`.
        report : Report
            Everything protection found in this step.

        Raises
        ------
        abftgemm.UncorrectableError
            When protection could not deliver a verified product.
        """
        report = Report()
        head = Gemm(check, fault_hook if fault_layer is None else None, report, self.plans)
        hooked = Gemm(check, fault_hook, report, self.plans)
        gemms = [hooked if fault_layer in (None, i) else Gemm(check, None, report, self.plans)
                 for i in range(len(self.blocks))]
        p = self.params
        seq = tokens.shape[1]
        x = p["tok_emb"][tokens] + p["pos_emb"][:seq]
        caches = []
        for block, gemm in zip(self.blocks, gemms):
            x, cache = block.forward(x, gemm)
            caches.append(cache)
        h, ln_f = layer_norm_forward(x, p["ln_f.g"], p["ln_f.b"])
        logits = linear_forward(h, p["lm_head.w"], p["lm_head.b"], "lm_head", head)
        loss, ce = cross_entropy_forward(logits, targets)

        grads: dict[str, Any] = {}
        d_logits = cross_entropy_backward(ce)
        d_h, grads["lm_head.w"], grads["lm_head.b"] = linear_backward(
            d_logits, h, p["lm_head.w"], "lm_head", head)
        dx, grads["ln_f.g"], grads["ln_f.b"] = layer_norm_backward(d_h, ln_f)
        for i in reversed(range(len(self.blocks))):
            dx, block_grads = self.blocks[i].backward(dx, caches[i], gemms[i])
            grads.update({f"blocks.{i}.{k}": v for k, v in block_grads.items()})
        grads["pos_emb"] = self.xp.zeros_like(p["pos_emb"])
        grads["pos_emb"][:seq] = dx.sum(axis=0)
        grads["tok_emb"] = _embedding_grad(tokens, dx, self.config.vocab)
        return loss, grads, report


def _embedding_grad(tokens: Any, dx: Any, vocab: int) -> Any:
    """Scatter-add of ``dx`` rows into the token-embedding rows, as a one-hot product."""
    xp = _xp(dx)
    onehot = (tokens.reshape(-1, 1) == xp.arange(vocab)).astype(dx.dtype)
    return onehot.T @ dx.reshape(-1, dx.shape[-1])


def _xp(a: Any) -> Any:
    """The array module of ``a``."""
    return array_module(a)
