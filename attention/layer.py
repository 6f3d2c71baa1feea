"""Multi-head self-attention whose every GEMM, forward and backward, is checksum-protected.

Three layers, as in flash-attention: the protected products (``abftgemm.matmul``), the glue that
saves what backward needs (``forward`` returns a cache), and this public class. Faults are repaired
where they happen, so the activations saved for backward are clean.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

import abftgemm
from abftgemm.checksums import Checksums, accumulation_dtype, check_dtype
from abftgemm.report import Report, register_library_package
from attention import softmax
from attention.plan import CheckingPlan

register_library_package("attention")  # fault warnings point at the caller of the layer

FaultHook = Callable[[str, Any], None]
PARAM_KEYS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")


class MultiHeadAttention:
    """Multi-head self-attention with ABFT-protected GEMMs and invariant-checked softmax.

    Parameters
    ----------
    d_model : int
        Model width; ``n_heads`` must divide it.
    n_heads : int
        Heads are contiguous column blocks of width ``d_model // n_heads``.
    causal : bool
        Query ``i`` sees keys ``j <= i`` only.
    dtype : str or dtype
        ``"float16"``, ``"bfloat16"``, ``"float32"`` or ``"float64"``: parameters, activations
        and GEMM operands. GEMMs accumulate in float32 (float64 for float64); softmax and its
        backward compute in float32 (float64) and store in ``dtype``.
    xp : module
        ``numpy`` (CPU) or ``cupy`` (GPU).
    seed : int
        Seed of the parameter initialization.
    check : {"correct", "detect", "off"}
        As in :func:`abftgemm.matmul`, for every site.
    plan : CheckingPlan, optional
        How often each site is checked (default: every call).

    Attributes
    ----------
    params : dict
        ``"wq","wk","wv","wo"`` ``(d_model, d_model)`` applied as ``x @ w``; ``"bq","bk","bv","bo"``
        ``(d_model,)``.
    last_report : Report
        Findings of the most recent ``forward`` or ``backward`` call.

    Notes
    -----
    A query row with no visible key (all keys masked) gets attention probabilities of 0, so its
    context is 0 and its output is ``bo``; no gradient flows through its scores.
    """

    def __init__(self, d_model: int, n_heads: int, *, causal: bool = False,
                 dtype: Any = "float32", xp: Any = np, seed: int = 0, check: str = "correct",
                 plan: CheckingPlan | None = None):
        if n_heads <= 0 or d_model <= 0 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        if check not in abftgemm.CHECK_MODES:
            raise ValueError(f"check must be one of {abftgemm.CHECK_MODES}, got {check!r}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.causal, self.xp, self.check = causal, xp, check
        self.dtype = check_dtype(_dtype(dtype))
        self.plan = plan or CheckingPlan()
        self.params = self._init_params(seed)
        self.last_report = Report()

    def _init_params(self, seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        d = self.d_model
        host = {k: rng.standard_normal((d, d)) / math.sqrt(d) for k in ("wq", "wk", "wv", "wo")}
        host.update({k: 0.1 * rng.standard_normal(d) for k in ("bq", "bk", "bv", "bo")})
        return {k: self.xp.asarray(v.astype(self.dtype)) for k, v in host.items()}

    # ------------------------------------------------------------------ forward
    def forward(self, x: Any, mask: Any | None = None,
                fault_hook: FaultHook | None = None) -> tuple[Any, dict[str, Any]]:
        """Attention output for ``x``.

        Parameters
        ----------
        x : array (batch, seq, d_model)
            Same array module and dtype as the layer.
        mask : bool array (batch, seq), optional
            Key-padding mask, True = attend.
        fault_hook : callable ``(site, c)``, optional
            Called with every site's raw product before verification.

        Returns
        -------
        y : array (batch, seq, d_model)
        cache : dict
            What ``backward`` needs.
        """
        self._check_input(x, mask)
        run = _Run(self, fault_hook)
        p = self.params
        b, s, d = x.shape
        x_sums = abftgemm.checksums_of(x, rows=False) if self.check != "off" else None
        q, _ = run.gemm("q_proj", x, p["wq"], bias=p["bq"], a_checksums=x_sums)
        k, k_sums = run.gemm("k_proj", x, p["wk"], bias=p["bk"], a_checksums=x_sums)
        v, v_sums = run.gemm("v_proj", x, p["wv"], bias=p["bv"], a_checksums=x_sums)
        qh, kh, vh = (self._split(t) for t in (q, k, v))
        # The scores are verified by the softmax, which reads them anyway (row checksums).
        scores, deferred = run.gemm_deferred("scores", qh, kh.transpose(0, 2, 1),
                                             b_checksums=_transposed(self._split_sums(k_sums)))
        vis = self._visible(mask, b, s)
        probs = run.softmax(scores, deferred, vis, mask)
        ctx, ctx_sums = run.gemm("context", probs, vh)
        merged = self._merge(ctx)
        y, _ = run.gemm("out_proj", merged, p["wo"], bias=p["bo"],
                        a_checksums=self._merge_sums(ctx_sums, b))
        self.last_report = run.report
        cache = {"x": x, "qh": qh, "kh": kh, "vh": vh, "probs": probs, "context": merged,
                 "visible": vis, "v_sums": v_sums}
        return y, cache

    # ------------------------------------------------------------------ backward
    def backward(self, dy: Any, cache: dict[str, Any],
                 fault_hook: FaultHook | None = None) -> tuple[Any, dict[str, Any]]:
        """Gradients of a loss with gradient ``dy`` w.r.t. ``x`` and every parameter.

        Parameters
        ----------
        dy : array (batch, seq, d_model)
        cache : dict
            From ``forward``.
        fault_hook : callable ``(site, c)``, optional

        Returns
        -------
        dx : array (batch, seq, d_model)
        grads : dict
            Same keys and shapes as ``params``.
        """
        x = cache["x"]
        if dy.shape != x.shape or dy.dtype != self.dtype:
            raise ValueError(f"dy must have shape {x.shape} and dtype {self.dtype}, "
                             f"got {dy.shape} {dy.dtype}")
        run = _Run(self, fault_hook)
        p = self.params
        flat = (-1, self.d_model)
        d_wo, _ = run.gemm("d_wo", cache["context"].reshape(flat).T, dy.reshape(flat))
        d_ctx, d_ctx_sums = run.gemm("d_context", dy, p["wo"].T)
        d_ctx_h = self._split(d_ctx)
        d_probs, _ = run.gemm("d_probs", d_ctx_h, cache["vh"].transpose(0, 2, 1),
                              a_checksums=self._split_sums(d_ctx_sums),
                              b_checksums=_transposed(self._split_sums(cache["v_sums"])))
        d_vh, _ = run.gemm("d_v", cache["probs"].transpose(0, 2, 1), d_ctx_h)
        d_scores = run.softmax_backward(d_probs, cache["probs"], 1 / math.sqrt(self.head_dim))
        d_qh, _ = run.gemm("d_q", d_scores, cache["kh"])
        d_kh, _ = run.gemm("d_k", d_scores.transpose(0, 2, 1), cache["qh"])
        dq, dk, dv = (self._merge(t).reshape(flat) for t in (d_qh, d_kh, d_vh))
        x_t = x.reshape(flat).T
        grads = {"wo": d_wo, "bo": _column_sum(dy.reshape(flat))}
        for name, dt in (("q", dq), ("k", dk), ("v", dv)):
            grads["w" + name], _ = run.gemm(f"d_w{name}", x_t, dt)
            grads["b" + name] = _column_sum(dt)
        xp = self.xp
        d_all = xp.concatenate([dq, dk, dv], axis=1)
        w_all = xp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1)
        dx, _ = run.gemm("d_x", d_all, w_all.T)
        self.last_report = run.report
        return dx.reshape(x.shape), {k: grads[k] for k in PARAM_KEYS}

    # ------------------------------------------------------------------ helpers
    def _check_input(self, x: Any, mask: Any | None) -> None:
        xp = abftgemm.backend.array_module(x)
        if xp is not self.xp:
            raise TypeError(f"x is a {xp.__name__} array; this layer runs on {self.xp.__name__}")
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (batch, seq, {self.d_model}), got {x.shape}")
        if x.dtype != self.dtype:
            raise TypeError(f"x has dtype {x.dtype}; the layer's dtype is {self.dtype}")
        if mask is not None:
            if abftgemm.backend.array_module(mask) is not self.xp:
                raise TypeError("mask must live on the same array module as x")
            if mask.shape != x.shape[:2]:
                raise ValueError(f"mask must have shape {x.shape[:2]} (batch, seq), got {mask.shape}")
            if mask.dtype != bool:
                raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype}")

    def _split(self, t: Any) -> Any:
        """(batch, seq, d_model) -> contiguous (batch*heads, seq, head_dim)."""
        b, s, _ = t.shape
        heads = t.reshape(b, s, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        return self.xp.ascontiguousarray(heads).reshape(b * self.n_heads, s, self.head_dim)

    def _merge(self, t: Any) -> Any:
        """(batch*heads, seq, head_dim) -> contiguous (batch, seq, d_model)."""
        bh, s, hd = t.shape
        b = bh // self.n_heads
        heads = t.reshape(b, self.n_heads, s, hd).transpose(0, 2, 1, 3)
        return self.xp.ascontiguousarray(heads).reshape(b, s, self.d_model)

    def _split_sums(self, sums: Checksums | None) -> Checksums | None:
        """Column encodings (batch, d_model, 3) -> per head (batch*heads, head_dim, 3)."""
        if sums is None or sums.cols is None:
            return None
        return Checksums(cols=sums.cols.reshape(-1, self.head_dim, 3))

    def _merge_sums(self, sums: Checksums | None, batch: int) -> Checksums | None:
        """Per-head column encodings back to (batch, d_model, 3)."""
        if sums is None or sums.cols is None:
            return None
        return Checksums(cols=sums.cols.reshape(batch, self.d_model, 3))

    def _visible(self, mask: Any | None, b: int, s: int) -> Any | None:
        """Boolean (batch*heads, seq, seq) visibility (broadcast over heads), or None."""
        xp = self.xp
        if mask is None and not self.causal:
            return None
        vis = xp.ones((b, 1, s, s), dtype=bool)
        if mask is not None:
            vis = vis & mask[:, None, None, :]
        if self.causal:
            vis = vis & xp.tril(xp.ones((s, s), dtype=bool))
        vis = xp.broadcast_to(vis, (b, self.n_heads, s, s))
        return vis.reshape(b * self.n_heads, s, s)


class _Run:
    """One forward or backward call: applies the plan and collects the report."""

    def __init__(self, layer: MultiHeadAttention, fault_hook: FaultHook | None):
        self.layer, self.fault_hook, self.report = layer, fault_hook, Report()

    def _mode(self, site: str) -> str:
        if self.layer.check == "off":
            return "off"
        return self.layer.check if self.layer.plan.should_check(site) else "off"

    def gemm(self, site: str, a: Any, b: Any, *, bias: Any | None = None,
             a_checksums: Checksums | None = None,
             b_checksums: Checksums | None = None) -> tuple[Any, Checksums | None]:
        mode = self._mode(site)
        c, report, sums = abftgemm.matmul(a, b, bias=bias, check=mode, fault_hook=self.fault_hook,
                                          name=site, return_report=True, return_checksums=True,
                                          a_checksums=a_checksums if mode != "off" else None,
                                          b_checksums=b_checksums if mode != "off" else None)
        self.report.extend(report)
        return c, sums

    def gemm_deferred(self, site: str, a: Any, b: Any,
                      b_checksums: Checksums | None) -> tuple[Any, Any]:
        mode = self._mode(site)
        return abftgemm.matmul_deferred(a, b, check=mode, fault_hook=self.fault_hook, name=site,
                                        b_checksums=b_checksums if mode != "off" else None)

    def softmax(self, scores: Any, deferred: Any | None, visible: Any | None,
                key_mask: Any | None) -> Any:
        """Softmax of the raw scores; verifies the scores on the way (``deferred``), then checks
        the probabilities by their invariants."""
        if scores.size == 0:  # seq = 0: no rows to normalize (reductions over nothing fail)
            return scores
        layer = self.layer
        scale = 1 / math.sqrt(layer.head_dim)
        acc = accumulation_dtype(layer.dtype)
        on_gpu = layer.xp.__name__ == "cupy"  # the GPU kernel scales the raw scores itself
        z = None

        def compute() -> tuple[Any, Any]:
            nonlocal z
            z = None if on_gpu else scores.astype(acc) * scale
            return softmax.softmax_with_row_stats(scores, z, scale, visible, key_mask,
                                                  layer.causal, layer.n_heads, layer.dtype,
                                                  want_stats=deferred is not None)

        probs, stats = compute()
        if deferred is not None and deferred.verify_rows(stats, self.report):
            probs, _ = compute()  # the scores were repaired in place

        def verify(p: Any) -> tuple[bool, float, float]:
            nonlocal z
            if z is None:
                z = scores.astype(acc) * scale
            return softmax.check_forward(p, z, visible)

        return softmax.checked("softmax", probs, lambda: compute()[0], verify, layer.check,
                               self.report, self.fault_hook)

    def softmax_backward(self, d_probs: Any, probs: Any, scale: float) -> Any:
        if d_probs.size == 0:  # seq = 0
            return d_probs
        layer = self.layer
        compute = lambda: softmax.softmax_backward(d_probs, probs, layer.dtype)  # noqa: E731
        ds = softmax.checked("softmax_backward", compute(), compute,
                             lambda g: softmax.check_backward(g, d_probs, probs), layer.check,
                             self.report, self.fault_hook)
        return (ds * scale).astype(layer.dtype)


def _transposed(sums: Checksums | None) -> Checksums | None:
    return None if sums is None else sums.T


def _column_sum(t: Any) -> Any:
    """Bias gradient: column sums accumulated in float32/float64, returned in t's dtype."""
    return t.astype(accumulation_dtype(t.dtype)).sum(axis=0).astype(t.dtype)


def _dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)
