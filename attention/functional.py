"""The functional attention core: forward and backward over the table of routes.

``attention_forward(params, x, ctx, ...) -> (y, saved)`` and
``attention_backward(saved, dy, ctx) -> (dx, grads)`` execute every GEMM site as the route table
(:data:`attention.plan.ROUTES`) says, on planned products (:class:`attention.workspace.Workspace`).
On the clean path a pass executes its sites back to back and settles them all with one host
synchronization at its end. When that settle finds something in ``check="correct"`` mode, the
pass is replayed with every site settled as soon as it runs, so that a repair happens at the
source (Q, K and V are corrected before they are saved or used) as in an unplanned layer.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from abftgemm.backend import array_module, astype, get_backend
from abftgemm.checksums import SUPPORTED_DTYPES, Checksums, accumulation_dtype
from abftgemm.plan import CONSUMER_ROWS, settle_all
from abftgemm.report import Event, Report, UncorrectableError, announce
from abftgemm.threads import blas_scope
from attention import softmax, softmax_steps
from attention.context import Context
from attention.dropout import DROPOUT_SITE, Dropout, DropoutStep
from attention.plan import ROUTES
from attention.workspace import Workspace

PARAM_KEYS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
_REPAIRS = ("corrected", "recomputed", "checksum-recomputed")


def attention_forward(params: dict[str, Any], x: Any, ctx: Context, *, n_heads: int,
                      causal: bool = False, key: Any | None = None, value: Any | None = None,
                      key_visible: Any | None = None, attn_mask: Any | None = None,
                      need_weights: bool = False, dropout: float = 0.0,
                      dropout_keep: Any | None = None, rng: Any | None = None,
                      workspace: Workspace | None = None) -> tuple[Any, dict[str, Any]]:
    """Multi-head attention output, every GEMM protected.

    Parameters
    ----------
    params : dict
        ``"wq","wk","wv","wo"`` ``(d_model, d_model)`` applied as ``x @ w``;
        ``"bq","bk","bv","bo"`` ``(d_model,)``; one dtype and array module. Optionally
        ``"w_qkv"`` ``(d_model, 3 * d_model)``, the memory of wq, wk and wv side by side (such as
        PyTorch's ``in_proj_weight.T``, of which they are views): the self-attention backward
        reads it instead of assembling that matrix.
    x : array (batch, seq_q, d_model)
        Query input (and key and value input in self-attention).
    ctx : Context
        Check mode, frequencies, fault hook; findings go to ``ctx.report``.
    n_heads : int
        Heads are contiguous column blocks of width ``d_model // n_heads``.
    causal : bool
        Query ``i`` sees keys ``j <= i`` only.
    key, value : array (batch, seq_k, d_model), optional
        Cross-attention inputs: ``K = key @ Wk + bk``, ``V = value @ Wv + bv`` (both or neither).
    key_visible : bool array (batch, seq_k), optional
        Key-padding mask, True = the key may be attended.
    attn_mask : array (seq_q, seq_k) or (batch*heads, seq_q, seq_k), optional
        Boolean, True = NOT allowed (torch's convention), or float, added to the scaled scores.
    need_weights : bool
        Also keep the attention probabilities as ``saved["probs"]``, ``(batch*heads, seq_q,
        seq_k)`` (they are saved for backward in any case).
    dropout : float
        Attention dropout probability (0: none): the probabilities the context multiplies are
        ``P * keep / (1 - dropout)`` (:mod:`attention.dropout`), kept as
        ``saved["probs_dropped"]``; checked on the site ``"dropout"``.
    dropout_keep : bool array (batch*heads, seq_q, seq_k), optional
        The dropout mask, True = kept; drawn from ``rng`` when not given.
    rng : numpy.random.Generator, optional
        Draws the dropout mask (CuPy's generator for CuPy arrays; a new unseeded one if None).
    workspace : Workspace, optional
        Plans and buffers to reuse across calls (a new one otherwise).

    Returns
    -------
    y : array (batch, seq_q, d_model)
    saved : dict
        What :func:`attention_backward` needs.
    """
    del need_weights  # the probabilities are saved for backward anyway
    inputs = _Inputs.of(params, x, key, value, key_visible, attn_mask, n_heads, causal)
    batch, seq_q = x.shape[:2]
    inputs.dropout = Dropout.of(inputs.xp, dropout, dropout_keep,
                                (batch * n_heads, seq_q, inputs.key.shape[1]), rng)
    ws = workspace or Workspace()
    return _run(lambda p: _forward(p, inputs), ctx, ws, inputs.xp)


def attention_backward(saved: dict[str, Any], dy: Any, ctx: Context, *,
                       workspace: Workspace | None = None,
                       grads_out: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """Gradients w.r.t. the inputs and every parameter, every GEMM protected.

    Parameters
    ----------
    saved : dict
        From :func:`attention_forward`.
    dy : array (batch, seq_q, d_model)
        Gradient of the loss w.r.t. ``y``, dtype of the layer.
    ctx : Context
    workspace : Workspace, optional
    grads_out : dict, optional
        Arrays (any strides; keys of ``params``, all or some) to write those gradients into, for
        example transposed views of a PyTorch module's gradient buffers: a weight gradient
        given as the transpose of a C-contiguous array is computed in that layout, with no copy.

    Returns
    -------
    dx : array (batch, seq_q, d_model), or a tuple ``(d_query, d_key, d_value)`` in
        cross-attention
    grads : dict
        Same keys and shapes as ``params`` (the arrays of ``grads_out`` where given).
    """
    inputs: _Inputs = saved["inputs"]
    if dy.shape != inputs.x.shape or dy.dtype != inputs.dtype:
        raise ValueError(f"dy must have shape {inputs.x.shape} and dtype {inputs.dtype}, "
                         f"got {dy.shape} {dy.dtype}")
    ws = workspace or Workspace()
    out = _gradient_buffers(grads_out or {}, inputs)
    return _run(lambda p: _backward(p, saved, dy, out), ctx, ws, inputs.xp)


# ---------------------------------------------------------------------------------- passes


def _run(body: Any, ctx: Context, ws: Workspace, xp: Any) -> Any:
    """Run a pass with one settle; replay it site by site when the settle repaired something."""
    # One thread count for the whole pass (abftgemm.threads); no NumPy floating-point warnings
    # from a fault's INF/NaN, which the checks judge and report.
    with blas_scope(), np.errstate(all="ignore"):
        return _run_passes(body, ctx, ws, xp)


def _run_passes(body: Any, ctx: Context, ws: Workspace, xp: Any) -> Any:
    first = _Pass(ctx, ws, xp, per_site=False)
    try:
        result = body(first)
        origin = first.settle()
    except UncorrectableError:
        ws.abandon()
        origin = Report()  # something downstream of a fault; the replay settles at the source
    except BaseException:
        ws.abandon()
        raise
    if origin is None:
        ctx.report.extend(first.report)
        return result
    replay = _Pass(ctx, ws, xp, per_site=True, modes=first.modes)  # the first pass's draws
    result = body(replay)
    seen = replay.report.sites
    origin.events = [e for e in origin.events if e.site not in seen]
    ctx.report.extend(origin)
    ctx.report.extend(replay.report)
    return result


class _Pass:
    """One forward or backward pass: named tensors, passed checksums, pending verdicts."""

    def __init__(self, ctx: Context, ws: Workspace, xp: Any, per_site: bool,
                 modes: dict[str, str] | None = None):
        self.ctx, self.ws, self.xp, self.per_site = ctx, ws, xp, per_site
        #: Site -> its check mode in this step, drawn from the plan once (a replay reuses them).
        self.modes = {} if modes is None else modes
        #: Causal layer: the routes' ``a_triangle`` and ``out_triangle`` promises hold.
        self.causal = False
        self.env: dict[str, Any] = {}
        self.sums: dict[str, Any] = {}
        #: Other names of one tensor (in self-attention ``key`` and ``value`` are ``x``).
        self.aliases: dict[str, str] = {}
        self.report = Report()
        self._pending: list[tuple[str, str, Any]] = []

    def tensor(self, name: str | None) -> Any:
        if name is None:
            return None
        if name.endswith("^T"):
            t = self.env[name[:-2]]
            return t.T if t.ndim == 2 else t.transpose(0, 2, 1)
        return self.env[name]

    def gemm(self, site: str, out: Any) -> Any:
        """Run ``site`` as its route says into ``out``; the product is also ``env[route.out]``.

        A 2-D ``out`` that is the transpose of a C-contiguous array (a caller's gradient buffer
        in PyTorch's ``W`` layout) gets the transposed product ``b^T a^T`` written into that
        memory, with no copy (the sites that get one, weight gradients, hand on no checksums;
        the swapped product encodes its own ``a``)."""
        route = ROUTES[site]
        a, b, bias = self.tensor(route.a), self.tensor(route.b), self.tensor(route.bias)
        mode = self.mode(site)
        self.env[route.out] = out
        target = out
        a_sums = None if route.a_sums is None else self.sums.get(self._named(route.a_sums))
        triangle = route.a_triangle if self.causal else None
        if _transposed_2d(out) and bias is None:
            a, b, target, a_sums, triangle = b.T, a.T, out.T, None, None
        if mode == "off":
            _plain(self.xp, a, b, bias, target, site, self.ctx.fault_hook, triangle)
            return out
        plan = self.ws.product(site, a, b, bias, mode, triangle)
        if a_sums is not None:  # (3, batch or 1, k), a view; an empty operand needs none
            a_sums = Checksums(cols=a_sums.reshape(3, -1, a.shape[-1])) if a.size else None
        plan.execute(a, b, bias=bias, out=target, fault_hook=self.ctx.fault_hook,
                     a_checksums=a_sums)
        if a_sums is None and target is out:  # encoded a: later sites of the same a take it
            made = plan.a_encoding()
            if made is not None:
                self.sums.setdefault(self._named(route.a), made.cols)
        if self.per_site:
            report, sums = plan.settle(checksums=True)
            self.report.extend(report)
        else:
            sums = plan.observed_checksums()
            self._pending.append(("plan", site, plan))
        if target is out:
            self.sums[route.out] = sums.cols
        return out

    def kept(self, name: str) -> Any | None:
        """A copy of ``name``'s encoding, kept beyond the workspace that holds it (for the
        backward pass; counted), or None."""
        enc = self.sums.get(name)
        if enc is None:
            return None
        self.ws.counters.copies += 1
        return enc.copy()

    def mode(self, site: str) -> str:
        """``site``'s check mode in this step (each site runs once per pass): drawn from the
        checking plan at its first run, reused by the replay, which must not advance an every-N
        schedule or redraw a probabilistic check."""
        if site not in self.modes:
            self.modes[site] = self.ctx.mode(site)
        return self.modes[site]

    def _named(self, name: str) -> str:
        """``name`` (with any ``^T``) under the name its tensor's checksums are kept by."""
        base = name.removesuffix("^T")
        return self.aliases.get(base, base) + name[len(base):]

    def gemm_deferred(self, site: str, out: Any) -> Any | None:
        """Run a "rows by consumer" site; returns its plan (None when unchecked) for the
        consumer to fill ``observed`` and :meth:`consumed`."""
        route = ROUTES[site]
        a, b = self.tensor(route.a), self.tensor(route.b)
        mode = self.mode(site)
        self.env[route.out] = out
        triangle = route.out_triangle if self.causal else None
        if mode == "off":
            _plain(self.xp, a, b, None, out, site, self.ctx.fault_hook, out_triangle=triangle)
            return None
        plan = self.ws.product(site, a, b, None, mode, directions=CONSUMER_ROWS,
                               out_triangle=triangle)
        rows = self.sums.get(route.b_rows)
        rows = None if rows is None else Checksums(rows=rows.reshape(3, -1, b.shape[-2]))
        plan.execute(a, b, out=out, fault_hook=self.ctx.fault_hook, b_rows=rows)
        return plan

    def consumed(self, site: str, plan: Any | None, redo: Any) -> None:
        """The consumer observed ``plan``'s rows: judge them; settle now (replay) or later.
        ``redo()`` recomputes the consumer's work after a repair."""
        if plan is None:
            return
        plan.judge()
        if not self.per_site:
            self._pending.append(("plan", site, plan))
            return
        found = plan.settle()
        self.report.extend(found)
        if any(e.action in _REPAIRS for e in found.events):
            redo()

    def invariant(self, site: str, verdict: softmax.Verdict | None, recheck: Any) -> None:
        """An invariant check's verdict, read at the settle (at once in a replay, where a
        failure recomputes once: ``recheck`` returns the new verdict)."""
        if verdict is None:
            return
        self.report.checked[site] = self.report.checked.get(site, 0) + 1
        if not self.per_site:
            self._pending.append(("invariant", site, verdict))
            return
        ok, worst, tol = verdict()
        if ok:
            return
        if self.ctx.check == "detect":
            _invariant_finding(self.report, site, worst, tol, "reported", left_in_place=True)
            return
        again = recheck()()
        _invariant_finding(self.report, site, worst, tol,
                           "recomputed" if again[0] else "reported")
        if not again[0]:
            raise UncorrectableError(f"{site}: invariant still violated after recomputation "
                                     f"({again[1]:.3g} > {again[2]:.3g})", self.report)

    def settle(self) -> Report | None:
        """Settle every pending verdict with one host synchronization. Returns None when
        nothing needs a replay, else the findings of the first site (in pass order) that
        repaired something."""
        plans = [p for kind, _, p in self._pending if kind == "plan"]
        reports = iter(settle_all(plans))
        origin = None
        for kind, site, item in self._pending:
            found = Report()
            if kind == "plan":
                found = next(reports)
            else:
                ok, worst, tol = item()
                if not ok:  # outside detect mode the replay recomputes it
                    detect = self.ctx.check == "detect"
                    _invariant_finding(found, site, worst, tol,
                                       "reported" if detect else "recomputed", detect)
            self.report.extend(found)
            if origin is None and any(e.action in _REPAIRS for e in found.events):
                origin = found
        self._pending = []
        return origin


def _invariant_finding(report: Report, site: str, worst: float, tol: float, action: str,
                       left_in_place: bool = False) -> None:
    """Record a violated softmax invariant; announce it when detect mode leaves it in place."""
    done = {"reported": "nothing: left in place" if left_in_place else
            "the step recomputed, and its invariants still violated",
            "recomputed": "the step recomputed; then its invariants checked within tolerance "
                          f"{tol:.3g}"}[action]
    report.events.append(Event(site, 0, "2D", (), (), worst, tol, action, done))
    if left_in_place:
        announce(report.events[-1])


def _plain(xp: Any, a: Any, b: Any, bias: Any | None, out: Any, site: str, hook: Any,
           triangle: str | None = None, out_triangle: str | None = None) -> None:
    """The unprotected product of a site that is not checked on this call."""
    get_backend(xp).gemm(*_as_3d(a, b), out.reshape((-1,) + out.shape[-2:]), bias,
                         triangle=triangle, out_triangle=out_triangle)
    if hook is not None:
        hook(site, out)


def _transposed_2d(x: Any) -> bool:
    """True for a 2-D array that is not C-contiguous but whose transpose is."""
    return x.ndim == 2 and not x.flags.c_contiguous and x.T.flags.c_contiguous


def _as_3d(a: Any, b: Any) -> tuple[Any, Any]:
    return (a if a.ndim == 3 else a[None]), (b if b.ndim == 3 else b[None])


# ---------------------------------------------------------------------------------- inputs


class _Inputs:
    """Validated inputs of a forward call (kept in ``saved`` for backward)."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    @classmethod
    def of(cls, params: dict[str, Any], x: Any, key: Any | None, value: Any | None,
           key_visible: Any | None, attn_mask: Any | None, n_heads: int,
           causal: bool) -> "_Inputs":
        xp = array_module(x)
        wq = params["wq"]
        d_model = wq.shape[0]
        if n_heads <= 0 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads "
                             f"({n_heads})")
        for k in PARAM_KEYS:
            if array_module(params[k]) is not xp:
                raise TypeError(f"x is a {xp.__name__} array; parameter {k} is not")
        w_qkv = params.get("w_qkv")
        if w_qkv is not None and (array_module(w_qkv) is not xp
                                  or w_qkv.shape != (d_model, 3 * d_model)):
            raise ValueError(f"params['w_qkv'] must be a {xp.__name__} array of shape "
                             f"{(d_model, 3 * d_model)}")
        if x.ndim != 3 or x.shape[-1] != d_model:
            raise ValueError(f"x must have shape (batch, seq, {d_model}), got {x.shape}")
        if x.dtype != wq.dtype:
            raise TypeError(f"x has dtype {x.dtype}; the layer's dtype is {wq.dtype}")
        if (key is None) != (value is None):
            raise ValueError("give both key and value (cross-attention) or neither")
        cross = key is not None
        for name, t in (("key", key), ("value", value)):
            if t is None:
                continue
            if array_module(t) is not xp or t.dtype != x.dtype:
                raise TypeError(f"{name} must be a {xp.__name__} {x.dtype} array like x")
            if t.ndim != 3 or t.shape[0] != x.shape[0] or t.shape[-1] != d_model:
                raise ValueError(f"{name} must have shape ({x.shape[0]}, seq_k, {d_model}), "
                                 f"got {t.shape}")
        if cross and key.shape != value.shape:
            raise ValueError(f"key {key.shape} and value {value.shape} must have one shape")
        batch, seq_q = x.shape[:2]
        seq_k = key.shape[1] if cross else seq_q
        if key_visible is not None:
            if array_module(key_visible) is not xp:
                raise TypeError("mask must live on the same array module as x")
            if key_visible.shape != (batch, seq_k):
                raise ValueError(f"mask must have shape {(batch, seq_k)} (batch, seq_k), "
                                 f"got {key_visible.shape}")
            if key_visible.dtype != bool:
                raise TypeError(f"mask must be boolean (True = attend), got {key_visible.dtype}")
        add = _additive(xp, attn_mask, batch * n_heads, seq_q, seq_k)
        return cls(xp=xp, x=x, key=key if cross else x, value=value if cross else x,
                   cross=cross, key_visible=key_visible, attn_add=add, n_heads=n_heads,
                   head_dim=d_model // n_heads, d_model=d_model, causal=causal,
                   dtype=x.dtype, params=params)


def _additive(xp: Any, mask: Any | None, rows: int, seq_q: int, seq_k: int) -> Any | None:
    """``attn_mask`` as an additive float64 ``(1 or rows, seq_q, seq_k)`` array (or None)."""
    if mask is None:
        return None
    if array_module(mask) is not xp:
        raise TypeError("attn_mask must live on the same array module as x")
    if mask.shape not in ((seq_q, seq_k), (rows, seq_q, seq_k)):
        raise ValueError(f"attn_mask must have shape {(seq_q, seq_k)} or {(rows, seq_q, seq_k)},"
                         f" got {mask.shape}")
    if mask.dtype == bool:
        add = xp.where(mask, -np.inf, 0.0)
    elif mask.dtype in SUPPORTED_DTYPES:  # float16, bfloat16, float32, float64
        add = astype(mask, np.float64)
    else:
        raise TypeError(f"attn_mask must be boolean (True = not allowed) or float, got "
                        f"{mask.dtype}")
    return xp.ascontiguousarray(add.reshape((-1, seq_q, seq_k)))


# ---------------------------------------------------------------------------------- forward


def _forward(p: _Pass, inp: _Inputs) -> tuple[Any, dict[str, Any]]:
    xp, ws, dt = p.xp, p.ws, inp.dtype
    batch, seq_q, d = inp.x.shape
    seq_k = inp.key.shape[1]
    h, hd = inp.n_heads, inp.head_dim
    p.env.update(inp.params, x=inp.x, key=inp.key, value=inp.value)
    p.causal = inp.causal
    if not inp.cross:
        p.aliases.update(key="x", value="x")
    p.gemm("q_proj", ws.buffer("q", xp, (batch, seq_q, d), dt))
    p.gemm("k_proj", ws.buffer("k", xp, (batch, seq_k, d), dt))
    p.gemm("v_proj", ws.buffer("v", xp, (batch, seq_k, d), dt))
    for name in "qkv":
        p.env[name + "h"] = _split(xp, p.env[name], h)
        if name in p.sums:
            p.sums[name + "h"] = p.sums[name]
    probs = _scores_and_softmax(p, inp, (batch * h, seq_q, seq_k))
    dropped = _dropout(p, inp, probs)
    p.gemm("context", ws.buffer("context_h", xp, (batch * h, seq_q, hd), dt))
    p.env["context"] = _merge(xp, p.env["context_h"], h)
    y = p.gemm("out_proj", xp.empty((batch, seq_q, d), dt))
    saved = {"inputs": inp, "qh": p.env["qh"], "kh": p.env["kh"], "vh": p.env["vh"],
             "probs": probs, "probs_dropped": dropped, "context": p.env["context"],
             "v_sums": p.kept("vh"), "probs_t_sums": p.kept("probs^T")}
    return y, saved


def _scores_and_softmax(p: _Pass, inp: Any, shape: tuple[int, int, int]) -> Any:
    """The ``scores`` product (``qh @ kh^T``, rows checked by the softmax kernel) and the checked
    softmax into ``p.env["probs"]``, which is returned; the encodings of P the kernel makes on its
    write go to ``p.sums``."""
    scores = p.ws.buffer("scores", p.xp, shape, inp.dtype)
    plan = p.gemm_deferred("scores", scores)
    probs = p.xp.empty_like(scores)
    p.env["probs"] = probs
    step = softmax_steps.forward_step(inp, scores, probs, p.ctx, p.ws, plan)
    p.consumed("scores", plan, step.run)
    p.invariant("softmax", step.verdict, step.recompute)
    if step.encodings is not None:  # made by the softmax kernel on its write of P
        p.sums["probs"], p.sums["probs^T"] = step.encodings
    return probs


def _dropout(p: _Pass, inp: Any, probs: Any) -> Any | None:
    """With attention dropout: the dropped probabilities (a new array), checked on the site
    ``"dropout"``, become what the products read as ``probs``; returns them (None without
    dropout). The encodings the softmax kernel made describe ``P``, not them: they are not
    handed on (the products encode what they read)."""
    if inp.dropout is None:
        return None
    for name in ("probs", "probs^T"):
        p.sums.pop(name, None)
    step = DropoutStep(probs, inp.dropout, p.xp.empty_like(probs), p.ctx)
    p.invariant(DROPOUT_SITE, step.verdict, step.recompute)
    p.env["probs"] = step.out
    return step.out


def _split(xp: Any, t: Any, heads: int) -> Any:
    """(batch, seq, d_model) -> new contiguous (batch*heads, seq, head_dim)."""
    b, s, d = t.shape
    out = xp.empty((b, heads, s, d // heads), t.dtype)
    out[...] = t.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)
    return out.reshape(b * heads, s, d // heads)


def _merge(xp: Any, t: Any, heads: int, out: Any | None = None) -> Any:
    """(batch*heads, seq, head_dim) -> contiguous (batch, seq, d_model)."""
    bh, s, hd = t.shape
    b = bh // heads
    out = xp.empty((b, s, heads * hd), t.dtype) if out is None else out
    out.reshape(b, s, heads, hd)[...] = t.reshape(b, heads, s, hd).transpose(0, 2, 1, 3)
    return out


# ---------------------------------------------------------------------------------- backward


def _gradient_buffers(given: dict[str, Any], inp: "_Inputs") -> dict[str, Any]:
    """Validated ``grads_out``, completed with new arrays for the gradients not given."""
    unknown = set(given) - set(PARAM_KEYS)
    if unknown:
        raise ValueError(f"grads_out has unknown keys {sorted(unknown)}; expected {PARAM_KEYS}")
    xp, par = inp.xp, inp.params
    out = {}
    for k in PARAM_KEYS:
        g = given.get(k)
        if g is None:
            g = xp.empty(par[k].shape, inp.dtype)
        elif array_module(g) is not xp or g.shape != par[k].shape or g.dtype != inp.dtype:
            raise ValueError(f"grads_out[{k!r}] must be a {xp.__name__} {inp.dtype} array of "
                             f"shape {par[k].shape}")
        out[k] = g
    return out


def _backward(p: _Pass, saved: dict[str, Any], dy: Any,
              grads: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    inp: _Inputs = saved["inputs"]
    xp, ws, dt = p.xp, p.ws, inp.dtype
    batch, seq_q, d = inp.x.shape
    seq_k = inp.key.shape[1]
    h, hd = inp.n_heads, inp.head_dim
    flat = (-1, d)
    par = inp.params
    p.env.update(par, x=inp.x.reshape(flat), key=inp.key.reshape(flat),
                 value=inp.value.reshape(flat), dy=dy.reshape(flat), context=saved["context"].reshape(flat),
                 qh=saved["qh"], kh=saved["kh"], vh=saved["vh"], probs=_read_probs(saved))
    p.causal = inp.causal
    if not inp.cross:
        p.aliases.update(key="x", value="x")
    for name, key in (("vh", "v_sums"), ("probs^T", "probs_t_sums")):
        if saved[key] is not None:
            p.sums[name] = saved[key]
    p.gemm("d_wo", grads["wo"])
    p.env["dy"] = dy
    d_ctx = p.gemm("d_context", ws.buffer("d_context", xp, (batch, seq_q, d), dt))
    p.env["d_context_h"] = _split(xp, d_ctx, h)
    d_probs = ws.buffer("d_probs", xp, (batch * h, seq_q, seq_k), dt)
    plan = p.gemm_deferred("d_probs", d_probs)
    p.gemm("d_v", ws.buffer("d_vh", xp, (batch * h, seq_k, hd), dt))
    d_scores = ws.buffer("d_scores", xp, (batch * h, seq_q, seq_k), dt)
    step = softmax_steps.backward_step(d_probs, saved["probs"], d_scores, 1 / math.sqrt(hd),
                                       p.ctx, ws, plan, causal=inp.causal, dropout=inp.dropout)
    p.consumed("d_probs", plan, step.run)
    p.invariant("softmax_backward", step.verdict, step.recompute)
    p.env["d_scores"] = d_scores
    if step.encodings is not None:  # made by the softmax kernel on its write of dS
        p.sums["d_scores"], p.sums["d_scores^T"] = step.encodings
    p.gemm("d_q", ws.buffer("d_qh", xp, (batch * h, seq_q, hd), dt))
    p.gemm("d_k", ws.buffer("d_kh", xp, (batch * h, seq_k, hd), dt))
    dq = _merge(xp, p.env["d_qh"], h, ws.buffer("dq", xp, (batch, seq_q, d), dt)).reshape(flat)
    dk = _merge(xp, p.env["d_kh"], h, ws.buffer("dk", xp, (batch, seq_k, d), dt)).reshape(flat)
    dv = _merge(xp, p.env["d_vh"], h, ws.buffer("dv", xp, (batch, seq_k, d), dt)).reshape(flat)
    p.env.update(dq=dq, dk=dk, dv=dv)
    parts = [p.sums.get(n) for n in (("d_qh",) if inp.cross else ("d_qh", "d_kh", "d_vh"))]
    if batch and all(e is not None for e in parts):  # d_x's a, [dQ dK dV] (dQ in cross-attn.)
        p.sums["d_qkv"] = _stacked_encoding(xp, parts, batch,
                                            ws.buffer("d_qkv_sums", xp, (3, 1, len(parts) * d),
                                                      np.float64))
    _column_sum(dy.reshape(flat), grads["bo"])
    for name in "qkv":
        p.gemm(f"d_w{name}", grads["w" + name])
        _column_sum(p.env["d" + name], grads["b" + name])
    if inp.cross:
        p.env.update(d_qkv=dq, w_qkv=par["wq"])
        d_query = p.gemm("d_x", xp.empty((batch * seq_q, d), dt)).reshape(inp.x.shape)
        d_key = p.gemm("d_key", xp.empty((batch * seq_k, d), dt)).reshape(inp.key.shape)
        d_value = p.gemm("d_value", xp.empty((batch * seq_k, d), dt)).reshape(inp.value.shape)
        dx: Any = (d_query, d_key, d_value)
    else:
        d_qkv = ws.buffer("d_qkv", xp, (batch * seq_q, 3 * d), dt)
        w_qkv = par.get("w_qkv")
        if w_qkv is None:
            w_qkv = ws.buffer("w_qkv", xp, (d, 3 * d), dt)
            for i, w in enumerate(("wq", "wk", "wv")):
                w_qkv[:, i * d:(i + 1) * d] = par[w]
        for i, g in enumerate((dq, dk, dv)):
            d_qkv[:, i * d:(i + 1) * d] = g
        p.env.update(d_qkv=d_qkv, w_qkv=w_qkv)
        dx = p.gemm("d_x", xp.empty((batch * seq_q, d), dt)).reshape(inp.x.shape)
    return dx, {k: grads[k] for k in PARAM_KEYS}


def _read_probs(saved: dict[str, Any]) -> Any:
    """The probabilities the backward products read: after dropout when there was one."""
    dropped = saved.get("probs_dropped")
    return saved["probs"] if dropped is None else dropped


def _stacked_encoding(xp: Any, parts: list[Any], batch: int, out: Any) -> Any:
    """Column encoding ``out`` ``(3, 1, width)`` of a ``(batch * seq, width)`` matrix from the
    column encodings of its head blocks over each batch item's ``seq`` rows (``parts``, side by
    side, each ``(3, batch * heads, head_dim)``, as the per-head products observe them). Plain
    and absolute sums add up over the items; the location weight of row ``s`` of item ``b``,
    ``(b * seq + s + 1) / (batch * seq)``, is ``b / batch`` plus the item's own ``(s + 1) /
    seq`` over ``batch`` (numba on the CPU: :func:`attention._cpu_encodings.stack`)."""
    if xp is np:
        from attention import _cpu_encodings  # numba: loaded with the CPU path only

        _cpu_encodings.stack(tuple(parts), batch, out)
        return out
    e = xp.concatenate([x.reshape(3, batch, -1) for x in parts], axis=2)  # (3, batch, width)
    item = (xp.arange(batch, dtype=np.float64) / batch)[:, None]
    weighted = e[1] / batch
    weighted[1:] += item[1:] * e[0, 1:]  # item 0's weight is 0: no 0 * inf = NaN
    e[0].sum(axis=0, out=out[0, 0])
    weighted.sum(axis=0, out=out[1, 0])
    e[2].sum(axis=0, out=out[2, 0])
    return out


def _column_sum(t: Any, out: Any) -> None:
    """Bias gradient into ``out``: column sums of ``t`` accumulated in float32/float64."""
    acc = accumulation_dtype(t.dtype)
    if acc == t.dtype:
        t.sum(axis=0, out=out)
    else:
        out[...] = t.sum(axis=0, dtype=acc)
