"""The functional attention core: the pass tables of :mod:`attention.passes`, run.

``attention_forward(params, x, ctx, ...) -> (y, saved)`` and
``attention_backward(saved, dy, ctx) -> (dx, grads)`` resolve the layer's table
(:data:`attention.passes.FORWARD`, :data:`attention.passes.BACKWARD`) for the call and run it with
one executor, :class:`_Pass`, step by step, every GEMM a planned product
(:class:`attention.workspace.Workspace`). On the clean path a pass runs its steps back to back and
settles them all with one host synchronization at its end. When that settle finds something in
``check="correct"`` mode, the pass is replayed with every step settled as soon as it runs, so
that a repair happens at the source (Q, K and V are corrected before they are saved or used) as
in an unplanned layer.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from abftgemm.backend import array_module, astype, get_backend, reads_counted_by
from abftgemm.checksums import SUPPORTED_DTYPES, Checksums, accumulation_dtype
from abftgemm.plan import CONSUMER_ROWS, settle_all
from abftgemm.report import Event, Report, UncorrectableError, announce
from abftgemm.threads import blas_scope
from attention import softmax_steps
from attention._cpu_heads import merge_heads, split_heads
from attention.context import Context
from attention.dropout import Dropout, DropoutStep, for_core
from attention.dropout_hash import keep_mask
from attention.fused import fused_backward, fused_forward
from attention.fused_choice import (CAUSAL_NOT_SQUARE, MASK_GRAD, backward_reason, check_core,
                                     finite_reason, overflowed, refused, static_reason)
from attention.fused_deferred import Deferred
from attention.fused_final import (OUTPUT_SITE, defer_grads, defer_output, verify_grads,
                                   verify_output)
from attention.fused_rules import mask_groups
from attention.passes import (BACKWARD_OUTPUTS, CORE_BACKWARD, CORE_FORWARD, FORWARD_OUTPUT,
                              PARAM_KEYS, Step, Variant, carried, layer, steps)
from attention.softmax import Verdict
from attention.workspace import Workspace

_WEIGHTS = ("wq", "wk", "wv", "wo")
_REPAIRS = ("corrected", "recomputed", "checksum-recomputed")


def attention_forward(params: dict[str, Any], x: Any, ctx: Context, *, n_heads: int,
                      causal: bool = False, key: Any | None = None, value: Any | None = None,
                      key_visible: Any | None = None, attn_mask: Any | None = None,
                      need_weights: bool = False, dropout: float = 0.0,
                      dropout_keep: Any | None = None, rng: Any | None = None,
                      workspace: Workspace | None = None, core: str = "auto",
                      dropout_seed: int | None = None, mask_grad: bool = False,
                      key_add: Any | None = None) -> tuple[Any, dict[str, Any]]:
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
    attn_mask : array (seq_q, seq_k), (batch*heads, seq_q, seq_k) or (batch, seq_q, seq_k), optional
        Boolean, True = NOT allowed (torch's convention), or float, added to the scaled scores:
        one for all, one per head, or one per batch item that its heads share (any ``(m,
        seq_q, seq_k)`` with ``m`` dividing ``batch * heads``: rows ``b`` with ``b // (batch *
        heads / m) = i`` read mask ``i``).
    need_weights : bool
        Keep the attention probabilities as ``saved["probs"]``, ``(batch*heads, seq_q,
        seq_k)``: the unfused product runs (the fused core makes none).
    dropout : float
        Attention dropout probability (0: none): the probabilities the context multiplies are
        ``P * keep / (1 - dropout)`` (:mod:`attention.dropout`). The unfused core keeps them as
        ``saved["probs_dropped"]`` and checks them on the site ``"dropout"``; the fused core
        regenerates its keep decisions per tile from a seed (:mod:`attention.dropout_hash`) and
        checks the dropped tiles through its accumulators (:mod:`attention.fused`).
    dropout_keep : bool array (batch*heads, seq_q, seq_k), optional
        The dropout mask, True = kept (the unfused core runs). Without it (and without
        ``dropout_seed``) the unfused core draws its mask from ``rng``, the fused core its seed.
    rng : numpy.random.Generator, optional
        Draws the dropout mask or seed (CuPy's generator for CuPy arrays; a new unseeded one if
        None).
    workspace : Workspace, optional
        Plans and buffers to reuse across calls (a new one otherwise).
    core : {"auto", "fused", "unfused"}
        The attention product between the projections: ``"auto"`` runs the fused core
        (:mod:`attention.fused`: tiles, O(L) memory, every tile checked, its own fault-hook
        sites) where it applies (:mod:`attention.fused_choice`: NumPy float16, bfloat16,
        float32 or float64, no ``dropout_keep``, no ``need_weights``, no fault hook, every call
        of the product's sites checked, finite Q, K and V), else the unfused sites ``scores``,
        ``softmax``, ``context`` (and backward ``d_probs``, ``d_v``, ``softmax_backward``,
        ``d_q``, ``d_k``); ``"fused"`` and ``"unfused"`` force one (``"fused"`` raises
        ``ValueError`` where it does not apply; on non-finite Q, K or V it raises in
        ``check="correct"``, after repairing a projection's fault that made them so, and runs the
        unfused steps in ``"detect"`` and ``"off"``, as ``"auto"`` does). CuPy data run the fused
        core's CUDA kernels with ``"fused"`` only (``"auto"`` keeps them unfused until those kernels
        have run on a GPU). The fused core encodes its operands itself: the
        projections' output checksums are not handed on to it; its outputs get final checks
        after it (:mod:`attention.fused_final`, sites ``fused:out``, ``fused:dV_out`` and
        ``fused:dK_out``).
    dropout_seed : int, optional
        The seed of the keep decisions (:func:`attention.dropout_hash.keep_mask`), in ``[0,
        2^64)``, on either core (the unfused core materializes the mask); excludes
        ``dropout_keep``.
    mask_grad : bool
        :func:`attention_backward` also returns the gradient of the float ``attn_mask`` (a
        learned position bias), as ``grads["attn_mask"]``: the unfused core runs (the gradient
        is its checked ``dS``).
    key_add : float array (batch, seq_k), optional
        A float key padding mask: added to the scaled scores of every query row of every head of
        its batch item (``-inf``: not allowed), after ``attn_mask`` (their float64 sum is added,
        as PyTorch merges the two). The fused core reads it as it is, O(seq_k) per item (no
        ``(batch*heads, seq_q, seq_k)`` array); the unfused core folds it into its float64
        additive mask of that shape when it runs.

    Returns
    -------
    y : array (batch, seq_q, d_model)
    saved : dict
        What :func:`attention_backward` needs; ``saved["core"]`` is ``"fused"`` or
        ``"unfused"``, and ``saved["probs"]`` is None after the fused core. It holds ``x``,
        ``key``, ``value``, the parameters, the masks and ``dropout_keep`` by reference, not as
        copies (NumPy arrays have no version counter to tell): change none of them in place
        before the backward.
    """
    check_core(core)
    inp = _Inputs.of(params, x, key, value, key_visible, attn_mask, n_heads, causal, key_add)
    if mask_grad:
        check_mask_grad(attn_mask, core)
    why_not = "core='unfused'" if core == "unfused" or mask_grad else static_reason(
        inp.xp, inp.dtype, inp.mask_add, ctx, dropout_keep, core == "fused", need_weights,
        inp.key_add)
    if why_not is None and causal and inp.key.shape[1] != x.shape[1]:
        why_not = CAUSAL_NOT_SQUARE
    if core == "fused" and why_not is not None:
        raise refused(why_not)
    inp.core = core
    batch, seq_q = x.shape[:2]
    inp.shape = (batch * n_heads, seq_q, inp.key.shape[1])
    inp.dropout, inp.fused_dropout = for_core(inp.xp, dropout, dropout_keep, dropout_seed,
                                              inp.shape, rng, fused=why_not is None)
    variant = Variant(inp.cross, inp.causal, inp.dropout is not None, gpu=inp.xp is not np,
                      fused=why_not is None)
    env = lambda: {**inp.params, "x": x, "key": inp.key, "value": inp.value}  # noqa: E731
    y, saved = forward_pass(*layer(variant), variant, inp, env, FORWARD_OUTPUT, ctx, workspace)
    # "auto" runs the unfused core in place of the fused one on non-finite Q, K or V
    saved["core"] = "fused" if saved.get("lse") is not None else "unfused"
    saved.setdefault("probs", None)
    saved["mask_shape"] = attn_mask.shape if mask_grad else None
    return y, saved


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
        example transposed views of a PyTorch module's gradient buffers: weight gradients given
        as transposes of C-contiguous arrays (all that are given: one layout) are computed in
        that layout, with no copy (:data:`attention.passes.Variant` ``w_layout``).

    Returns
    -------
    dx : array (batch, seq_q, d_model), or a tuple ``(d_query, d_key, d_value)`` in
        cross-attention
    grads : dict
        Same keys and shapes as ``params`` (the arrays of ``grads_out`` where given); after a
        forward with ``mask_grad=True`` also ``"attn_mask"``, float64 of the mask's shape.
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("inputs"), _Inputs):
        raise TypeError("saved must be the dict attention_forward returned (the layer's cache), "
                        f"got {type(saved).__name__}" + (
                            f" with keys {sorted(saved)[:8]}" if isinstance(saved, dict) else ""))
    inp: _Inputs = saved["inputs"]
    if dy.shape != inp.x.shape or dy.dtype != inp.dtype:
        raise ValueError(f"dy must have shape {inp.x.shape} and dtype {inp.dtype}, "
                         f"got {dy.shape} {dy.dtype}")
    grads = _gradient_buffers(grads_out or {}, inp)
    w_layout = _transposed_2d(grads["wq"])

    def env() -> dict[str, Any]:
        flat = {k: t.reshape(-1, inp.d_model) for k, t in (
            ("x", inp.x), ("key", inp.key), ("value", inp.value), ("dy", dy),
            ("context", saved["context"]))}
        return {**inp.params, **{"d_" + k: g for k, g in grads.items()}, **flat}

    variant = replace(saved["variant"], w_layout=w_layout)
    mask_shape = saved.get("mask_shape")
    outputs = BACKWARD_OUTPUTS + (("d_scores",) if mask_shape else ())
    p = backward_pass(layer(variant)[1], variant, saved, env, outputs, ctx, workspace, flat=True)
    if mask_shape:
        grads["attn_mask"] = mask_gradient(inp, p.env["d_scores"], mask_shape)
    dx, d_key, d_value = (p.env.get(n) for n in BACKWARD_OUTPUTS)
    dx = dx.reshape(inp.x.shape)
    if inp.cross:
        dx = (dx, d_key.reshape(inp.key.shape), d_value.reshape(inp.key.shape))
    return dx, grads


# ---------------------------------------------------------------------------------- passes


def forward_pass(forward: tuple[Step, ...], backward: tuple[Step, ...], variant: Variant,
                 inp: Any, env: Callable[[], dict[str, Any]], out: str, ctx: Context,
                 workspace: Workspace | None) -> tuple[Any, dict[str, Any]]:
    """Run the table ``forward`` in ``variant`` on the tensors ``env()`` binds; returns the
    tensor named ``out`` and what ``backward`` needs: the tensors it reads (kept as new arrays)
    and the encodings it takes, under ``saved["sums"]``; ``saved["probs_dropped"]`` is None
    without dropout."""
    fwd, bwd = steps(forward, variant), steps(backward, variant)
    tensors, sums = carried(fwd, bwd, variant.gpu)
    p = _run(fwd, inp, env, tensors | {out}, ctx, workspace, numba_pool=variant.fused)
    kept = {n: p.sums[n].copy() for n in sums if n in p.sums}  # beyond the workspace
    p.ws.counters.copies += len(kept)
    saved = {"inputs": inp, "variant": variant, "probs_dropped": None, "tensors": tensors,
             **{n: p.env[n] for n in tensors}, "sums": kept}
    return p.env[out], saved


def backward_pass(backward: tuple[Step, ...], variant: Variant, saved: dict[str, Any],
                  env: Callable[[], dict[str, Any]], outputs: tuple[str, ...], ctx: Context,
                  workspace: Workspace | None, flat: bool = False) -> "_Pass":
    """Run the table ``backward`` in ``variant`` on ``env()`` and what :func:`forward_pass`
    saved; ``outputs`` are new arrays. Returns the pass (its ``env`` holds the results)."""
    bind = lambda: {**{n: saved[n] for n in saved["tensors"]}, **env()}  # noqa: E731
    return _run(steps(backward, variant), saved["inputs"], bind, frozenset(outputs), ctx,
                workspace, saved["sums"], flat, numba_pool=variant.fused)


def _run(table: tuple[Step, ...], inp: Any, env: Callable[[], dict[str, Any]],
         keep: frozenset[str], ctx: Context, workspace: Workspace | None,
         sums: dict[str, Any] | None = None, flat: bool = False,
         numba_pool: bool = False) -> "_Pass":
    """Run a table with one settle; replay it step by step when the settle repaired something.
    Returns the pass that delivered."""
    ws = workspace or Workspace()
    # One thread count for the whole pass, its large products in numba's pool beside the fused
    # core (abftgemm.threads); no NumPy floating-point warnings from a fault's INF/NaN, which the
    # checks judge and report.
    with blas_scope(numba_pool=numba_pool), np.errstate(all="ignore"), \
            reads_counted_by(ws.counters):
        first = _Pass(ctx, ws, inp, env(), keep, sums, flat, per_site=False)
        try:
            first.run(table)
            origin = first.settle()
        except _Replay as replay:
            ws.abandon()
            origin = replay.found or Report()
        except UncorrectableError as exc:  # downstream of a fault: the replay settles at the
            ws.abandon()                   # source (a transient fault is gone by then)
            origin = _replayed(exc.report)
        except BaseException:
            ws.abandon()
            raise
        if origin is None:
            ctx.report.extend(first.report)
            done = first
        else:  # the first pass's check decisions
            done = _Pass(ctx, ws, inp, env(), keep, sums, flat, per_site=True, modes=first.modes)
            done.run(table)
            seen = done.report.sites
            # the origin's findings, not its checks: the replay verified every site again and
            # counts each once, as a clean pass does
            ctx.report.extend(Report([e for e in origin.events if e.site not in seen]))
            ctx.report.extend(done.report)
    if ctx.trace is not None:
        ctx.trace.extend(done.trace)
    return done


def _replayed(found: Report) -> Report:
    """The findings of a first run that a failed check ended, as the replay that follows
    answers them: recomputed (the pass again from its inputs, each step checked as it runs)."""
    out = Report()
    out.events = [replace(
        e, action="recomputed", verified=f"{e.verified}; the pass was replayed from its inputs, "
        "each step checked as it ran") for e in found.events]
    return out


class _Replay(Exception):
    """Raised in a pass's first run where only a replay, which settles each step as it runs, can
    go on (the fused core's inputs hold INF or NaN: a projection's fault, or the caller's), with
    the findings of the steps settled so far."""

    def __init__(self, found: Report | None):
        super().__init__()
        self.found = found


class _Pass:
    """One run of a pass table: named tensors, handed-on encodings, pending verdicts. Each
    ``Step.op`` is the method of its name; it returns what it took or made of the encodings
    (:func:`attention.passes.checksums` says the same of the table), recorded in :attr:`trace`."""

    def __init__(self, ctx: Context, ws: Workspace, inp: Any, env: dict[str, Any],
                 keep: frozenset[str], sums: dict[str, Any] | None, flat: bool, per_site: bool,
                 modes: dict[str, str] | None = None):
        self.ctx, self.ws, self.inp, self.xp, self.env = ctx, ws, inp, inp.xp, env
        #: Names made as new arrays (returned or saved); the others are workspace buffers.
        self.keep = keep
        #: The backward binds (batch, seq, d_model) tensors as (batch*seq, d_model).
        self.flat = flat
        self.per_site = per_site
        #: Site -> its check mode in this step, drawn from the plan once (a replay reuses them).
        self.modes = {} if modes is None else modes
        self.sums: dict[str, Any] = dict(sums or {})
        self.report = Report()
        self.trace: list[tuple[Step, str | None]] = []
        self._pending: list[tuple[str, str, Any]] = []
        self._consumers: dict[str, tuple[str, Any]] = {}  # "gemm rows": (site, plan) to observe
        self._heads: dict[str, Any] = {}  # a backward merge's heads' encodings
        self._stack_slots: dict[str, tuple[str, int, int]] = {}  # part: (stack, index, parts)
        self._placed: dict[str, tuple[Any, int]] = {}  # part: (its stack, first column)
        self._fused_state: dict[str, Any] | None = None  # the fused core's, for its final check
        self._fused_defer: Deferred | None = None  # its checks, read at the settle (CuPy)

    def run(self, table: tuple[Step, ...]) -> None:
        self._stack_slots = {part: (s.out, i, len(s.ins)) for s in table if s.op == "stack"
                             for i, part in enumerate(s.ins)}
        for step in table:
            self.trace.append((step, _OPS[step.op](self, step)))

    def tensor(self, name: str | None) -> Any:
        if name is None:
            return None
        t = self.env[name.removesuffix("^T")]
        if name.endswith("^T"):
            return t.T if t.ndim == 2 else t.transpose(0, 2, 1)
        return t

    def target(self, step: Step, shape: tuple[int, ...], dtype: Any = None) -> Any:
        """Where ``step.out`` goes: the caller's array (a gradient buffer), a new array (a
        result, or saved for the backward: :meth:`attention.workspace.Workspace.recycled`), or a
        workspace buffer reused by every call."""
        out = self.env.get(step.out)
        if out is None:
            dtype = self.inp.dtype if dtype is None else dtype
            out = self._in_stack(step.out, shape, dtype)
            if out is None:
                out = self._new(step.out, shape, dtype)
            self.env[step.out] = out
        return out

    def _new(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        get = self.ws.recycled if name in self.keep else self.ws.buffer
        return get(name, self.xp, shape, dtype)

    def _in_stack(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any | None:
        """Where a later ``stack`` step takes ``name`` as a part: its column block of that
        step's output (made here for the first part), so that the stack has nothing to copy;
        None for other names."""
        slot = self._stack_slots.get(name)
        if slot is None or name in self.keep and slot[0] not in self.keep:
            return None  # (a kept part must not live in a buffer the next call reuses)
        stack, i, count = slot
        rows, width = math.prod(shape[:-1]), shape[-1]
        whole = self.env.get(stack)
        if whole is None:
            whole = self.env[stack] = self._new(stack, (rows, count * width), dtype)
        if whole.shape != (rows, count * width) or whole.dtype != dtype:
            return None
        self._placed[name] = whole, i * width
        return whole.reshape(shape[:-1] + whole.shape[-1:])[..., i * width:(i + 1) * width]

    def mode(self, site: str) -> str:
        """``site``'s check mode in this step (each site runs once per pass): drawn from the
        checking plan at its first run, reused by the replay, which must not advance an every-N
        schedule or redraw a probabilistic check."""
        if site not in self.modes:
            self.modes[site] = self.ctx.mode(site)
        return self.modes[site]

    # ---------------------------------------------------------------- the ops

    def gemm(self, step: Step) -> str | None:
        """A ``transposed`` step writes ``b^T a^T`` into the transpose of its buffer (PyTorch's
        ``W`` layout: no copy); that product's ``a``, ``b^T``, is encoded; nothing handed on."""
        a, b = self.tensor(step.ins[0]), self.tensor(step.ins[1])
        bias = self.tensor(step.bias)
        out = self.target(step, a.shape[:-1] + b.shape[-1:])
        target, mode = out, self.mode(step.site)
        a_sums = self.sums.get(step.sums) if step.sums else None
        if step.transposed:
            a, b, target, a_sums = b.T, a.T, out.T, None
        if mode == "off":
            _plain(self.xp, a, b, bias, target, step.site, self.ctx.fault_hook, step.a_triangle)
            return None
        plan = self.ws.product(step.site, a, b, bias, mode, step.a_triangle)
        if a_sums is not None:  # (3, batch or 1, k), a view; an empty operand needs none
            a_sums = Checksums(cols=a_sums.reshape(3, -1, a.shape[-1])) if a.size else None
        plan.execute(a, b, bias=bias, out=target, fault_hook=self.ctx.fault_hook,
                     a_checksums=a_sums)
        if a_sums is None and not step.transposed:  # encoded a: later steps of that a take it
            made = plan.a_encoding()
            if made is not None:
                self.sums.setdefault(step.ins[0], made.cols)
        if self.per_site:
            report, sums = plan.settle(checksums=True)
            self.report.extend(report)
        else:
            sums = plan.observed_checksums()
            self._pending.append(("plan", step.site, plan))
        if not step.transposed:
            self.sums[step.out] = sums.cols
        return None if a_sums is None else step.sums

    def gemm_rows(self, step: Step) -> str | None:
        a, b = self.tensor(step.ins[0]), self.tensor(step.ins[1])
        out = self.target(step, a.shape[:-1] + b.shape[-1:])
        mode, rows = self.mode(step.site), self.sums.get(step.rows)
        if mode == "off":
            _plain(self.xp, a, b, None, out, step.site, self.ctx.fault_hook,
                   out_triangle=step.out_triangle)
            self._consumers[step.out] = (step.site, None)
            return None
        plan = self.ws.product(step.site, a, b, None, mode, directions=CONSUMER_ROWS,
                               out_triangle=step.out_triangle)
        given = None if rows is None else Checksums(rows=rows.reshape(3, -1, b.shape[-2]))
        plan.execute(a, b, out=out, fault_hook=self.ctx.fault_hook, b_rows=given)
        self._consumers[step.out] = (step.site, plan)
        return None if rows is None else step.rows

    def softmax(self, step: Step) -> str | None:
        scores = self.env[step.ins[0]]
        probs = self.target(step, scores.shape)
        site, plan = self._consumers.pop(step.ins[0])
        run = softmax_steps.forward_step(self.inp, scores, probs, self.ctx, self.ws, plan)
        return self._softmax_checked(step, site, plan, run)

    def softmax_backward(self, step: Step) -> str | None:
        d_probs, probs = (self.env[n] for n in step.ins)
        d_scores = self.target(step, d_probs.shape)
        site, plan = self._consumers.pop(step.ins[0])
        run = softmax_steps.backward_step(d_probs, probs, d_scores, self.inp.scale, self.ctx,
                                          self.ws, plan, causal=self.inp.causal,
                                          dropout=self.inp.dropout)
        return self._softmax_checked(step, site, plan, run)

    def _softmax_checked(self, step: Step, site: str, plan: Any, run: Any) -> str | None:
        self.consumed(site, plan, run.run)
        self.invariant(step.site, run.verdict, run.recompute)
        if run.encodings is None:
            return None
        self.sums[step.out], self.sums[step.out + "^T"] = run.encodings  # made on its write
        return step.out

    def fused_core(self, step: Step) -> None:
        """The fused core (:mod:`attention.fused`): ``context_h`` and the rows' log-sum-exp
        ``lse``, every tile checked (its own sites; its findings go to this pass's report).
        ``core="auto"`` on non-finite Q, K or V, or an output past the data's dtype: the unfused
        core's steps instead (``lse`` None)."""
        inp, (q, k, v) = self.inp, (self.env[n] for n in step.ins)
        scanned = (inp.core == "auto" or not self.per_site) and not self._defers()
        if scanned and finite_reason(q=q, k=k, v=v) is not None:
            if inp.core != "auto" and self.ctx.check == "correct":
                # A projection's fault (found now, repaired in the replay), or the caller's data
                # (the replay's fused core raises). Detect and off modes leave such a fault in
                # place: the unfused steps pass it through, as under "auto".
                raise _Replay(self.settle())
            self._unfused_core()
            return
        defer = self._defer("fused core forward")
        visible = inp.key_visible
        if visible is not None:  # (batch, seq_k) -> (batch * heads, seq_k)
            visible = inp.xp.repeat(visible, inp.n_heads, axis=0)
        p, seed = inp.fused_dropout or (0.0, None)
        ctx = self._fused_context()
        before = len(ctx.report.events)
        out, state = fused_forward(q, k, v, ctx, scale=inp.scale,
                                   causal=inp.causal, key_visible=visible, attn_mask=inp.mask_add,
                                   dropout=p, dropout_seed=seed, workspace=self.ws, defer=defer,
                                   key_add=inp.key_add, check_finite=not scanned)
        if defer is None and inp.core == "auto" and ctx.check != "off" \
                and overflowed(ctx.report, before, (out,)):
            # an output past the data's dtype (float16): the unfused steps pass a genuine
            # overflow through and tell it from a fault
            self._unfused_core()
            return
        self.env.update(zip(step.out.split(", "), (out, state["lse"])))
        # what the backward takes besides the pass's arrays (the step's inputs and outputs)
        inp.fused = {n: x for n, x in state.items() if n not in ("q", "k", "v", "out", "lse")}
        self._fused_state = state

    def _unfused_core(self) -> None:
        """The unfused core's steps in place of the fused core's (``lse`` None)."""
        self.env["lse"] = None
        self.run(steps(CORE_FORWARD, self._unfused_variant()))

    def fused_check(self, step: Step) -> None:
        """The fused core's final check (:mod:`attention.fused_final`): forward, the output rows
        against the row checksums the kernel carried; backward, the step's site: ``dV``'s column
        sums against ``dO``'s (weighted by the forward's kept sums with dropout) or ``dK``'s
        against 0, and their rows against the row checksums the backward kernel carried. A
        repair recomputes the core's pass. Nothing where the unfused steps ran."""
        state = self._fused_state
        if state is None:
            return
        ctx, defer = self._fused_context(), self._fused_defer
        if step.site == OUTPUT_SITE:
            if defer is not None:
                defer_output(self.env[step.ins[0]], state, ctx, defer)
                return
            out, state = verify_output(self.env[step.ins[0]], state, ctx)
            self.env.update(zip(step.out.split(", "), (out, state["lse"])))
            # a recomputation's, with its lse (and the kept sums that dV's check reads)
            self.inp.fused.update(lse_lo=state["lse_lo"], sums=state["sums"])
            self._fused_state = state
            return
        grads = tuple(self.env[n] for n in step.out.split(", "))
        if defer is not None:
            defer_grads(state, self.env[step.ins[-1]], grads, ctx, (step.site,), defer)
            return
        self.env.update(zip(step.out.split(", "),
                            verify_grads(state, self.env[step.ins[-1]], grads, ctx,
                                         sites=(step.site,))))

    def fused_core_backward(self, step: Step) -> None:
        """The fused core's backward after its forward where it can take the gradient
        (:func:`attention.fused_choice.backward_reason`); else (as the unfused core passes
        non-finite gradients through, where the forward ran the unfused steps, and where the
        fused gradients overflowed: :func:`attention.fused_choice.overflowed`) the unfused
        scores and softmax again, then the unfused backward."""
        d_out, q, k, v, out, lse = (self.env[n] for n in step.ins)
        # A non-finite d_out: judged here, or on the device with the settle (which replays).
        if lse is not None and (self._defers() or backward_reason(d_out) is None):
            defer = self._defer("fused core backward")
            state = {**self.inp.fused, "q": q, "k": k, "v": v, "out": out, "lse": lse}
            before = len(self.report.events)
            grads = fused_backward(state, d_out, self._fused_context(), self.ws, defer,
                                   check_finite=defer is not None)
            # check="off" leaves faults in place, as the forward does (no fallback there)
            if defer is not None or self.ctx.check == "off" \
                    or not overflowed(self.report, before, grads):
                self.env.update(zip(step.out.split(", "), grads))
                self._fused_state = state
                return
        self.run(steps(_RECOMPUTED_CORE, self._unfused_variant()))

    def _defers(self) -> bool:
        """Whether the fused core's checks are left on the device until this pass's settle:
        CuPy data, ``check="correct"``, not a replay (:mod:`attention.fused_deferred`; detect
        mode reads them as it goes, and reports what it leaves in place)."""
        return not self.per_site and self.xp is not np and self.ctx.check == "correct"

    def _defer(self, name: str) -> Deferred | None:
        """A new :class:`attention.fused_deferred.Deferred` for the fused core's checks of this
        pass, settled under ``name`` (None where they are read at once: :meth:`_defers`)."""
        self._fused_defer = Deferred() if self._defers() else None
        if self._fused_defer is not None:
            self._pending.append(("fused", name, self._fused_defer))
        return self._fused_defer

    def _unfused_variant(self) -> Variant:
        """The unfused core's steps in place of the fused core's: with the fused core's dropout,
        its keep decisions materialized (:func:`attention.dropout_hash.keep_mask`)."""
        inp = self.inp
        if inp.fused_dropout is not None and inp.dropout is None:
            p, seed = inp.fused_dropout
            inp.dropout = Dropout(p, keep_mask(seed, p, inp.shape))
        return Variant(causal=inp.causal, dropout=inp.dropout is not None)

    def _fused_context(self) -> Context:
        """The fused core's context: its findings go to this pass's report (a replay replaces
        them as it replaces the sites')."""
        return Context(self.ctx.check, self.ctx.plan, self.ctx.fault_hook, self.report)

    def dropout(self, step: Step) -> None:
        probs = self.env[step.ins[0]]
        run = DropoutStep(probs, self.inp.dropout, self.target(step, probs.shape), self.ctx)
        self.invariant(step.site, run.verdict, run.recompute)

    def split(self, step: Step) -> str | None:
        t, h = self.env[step.ins[0]], self.inp.n_heads
        if t.ndim == 2:  # the backward's (batch*seq_q, d_model)
            t = t.reshape(self.inp.x.shape)
        b, s, d = t.shape
        split_heads(t.reshape(b * s, d), 0,
                    self.target(step, (b * h, s, d // h)).reshape(b, h, s, d // h))
        return self._hand_on(step)

    def merge(self, step: Step) -> str | None:
        t, h = self.env[step.ins[0]], self.inp.n_heads
        bh, s, hd = t.shape
        out = self.target(step, (bh // h, s, h * hd))
        merge_heads(t.reshape(bh // h, h, s, hd), *self._rows(step.out, out))
        if self.flat:
            self.env[step.out] = out.reshape(-1, h * hd)
        return self._hand_on(step)

    def _rows(self, name: str, out: Any) -> tuple[Any, int]:
        """``(rows, col0)``: the 2-D matrix whose columns ``col0 ..`` are the target ``out``
        ``(batch, seq, width)`` of ``name``: the stack that takes it as a part where it lies
        there (:meth:`_in_stack`), else ``out``'s rows (a buffer of the pass: C-contiguous)."""
        placed = self._placed.get(name)
        if placed is not None:
            return placed
        if not out.flags.c_contiguous:  # (its reshape would be a copy, the merge lost)
            raise AssertionError(f"{name}: a merge's target that is not one matrix's rows")
        return out.reshape(-1, out.shape[-1]), 0

    def _hand_on(self, step: Step) -> str | None:
        """A split's or merge's encoding: its input's (composed over the batch items in a flat
        pass, whose splits take none)."""
        enc = self.sums.get(step.sums) if step.sums else None
        if enc is None or self.flat and (step.op == "split" or not self.inp.batch):
            return None
        if self.flat:
            self._heads[step.out] = enc
            enc = _stacked_encoding(self.xp, [enc], self.inp.batch,
                                    self.ws.buffer(step.out + "^sums", self.xp,
                                                   (3, 1, self.inp.d_model), np.float64),
                                    self.ws, step.out)
        self.sums[step.out] = enc
        return step.sums

    def stack(self, step: Step) -> str | None:
        """Columns side by side (nothing to copy where the parts are already there: the caller
        bound the result as the memory of the parts side by side, such as PyTorch's
        ``in_proj_weight``, or the steps that made the parts wrote them there,
        :meth:`_in_stack`)."""
        parts = [self.env[n] for n in step.ins]
        out = self.target(step, (parts[0].shape[0], sum(t.shape[1] for t in parts)))
        at = 0
        for t in parts:
            block = out[:, at:at + t.shape[1]]
            if not _same_view(block, t):
                block[...] = t
            at += t.shape[1]
        heads = [self._heads.get(n) for n in step.ins]  # composed again side by side: no copy
        if any(e is None for e in heads):
            return None
        self.sums[step.out] = _stacked_encoding(self.xp, heads, self.inp.batch, self.ws.buffer(
            step.out + "^sums", self.xp, (3, 1, out.shape[1]), np.float64), self.ws, step.out)
        return " ".join(step.ins)

    def column_sum(self, step: Step) -> None:
        """A bias gradient into its buffer: column sums accumulated in float32/float64."""
        t, out = self.env[step.ins[0]], self.env[step.out]
        acc = accumulation_dtype(t.dtype)
        if acc == t.dtype:
            t.sum(axis=0, out=out)
        else:
            out[...] = t.sum(axis=0, dtype=acc)

    # ---------------------------------------------------------------- verdicts

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

    def invariant(self, site: str, verdict: Verdict | None, recheck: Any) -> None:
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
        fused = [(self.ws.slot(name, self.xp, len(d)), d)
                 for kind, name, d in self._pending if kind == "fused"]
        for slot, deferred in fused:  # on the device, before the ledger's one fetch
            deferred.commit(slot)
        reports = iter(settle_all(plans))
        slots = iter(slot for slot, _ in fused)
        origin = None
        for kind, site, item in self._pending:
            found = Report()
            if kind == "plan":
                found = next(reports)
            elif kind == "fused":
                ctx = Context(self.ctx.check, self.ctx.plan, self.ctx.fault_hook, found)
                if item.look(next(slots), ctx) and origin is None:
                    origin = found
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


#: The unfused core's backward after a fused forward: the scores, softmax (and dropout) again
#: first.
_RECOMPUTED_CORE = CORE_FORWARD[:3] + CORE_BACKWARD
#: The executor's method of each ``Step.op``.
_OPS = {op: getattr(_Pass, op.replace(" ", "_")) for op in (
    "gemm", "gemm rows", "split", "merge", "softmax", "softmax backward", "dropout", "stack",
    "column sum", "fused core", "fused core backward", "fused check")}


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
    """Validated inputs of a forward call (kept in ``saved`` for backward). The masks: ``mask_add``
    (``attn_mask`` as a float64 additive array, or None) and ``key_add`` (the float key padding
    mask, float64 ``(batch, seq_k)``, or None) as the fused core takes them, and
    :attr:`attn_add`, both folded into one, as the unfused core's steps read it."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)
        self._folded: Any | None = None

    @property
    def attn_add(self) -> Any | None:
        """The unfused core's additive mask: ``mask_add``, a mask given per batch item made
        whole and ``key_add`` folded in as a float64 ``(batch * heads, seq_q, seq_k)`` array, on
        first use (never where only the fused core runs)."""
        return folded_mask(self, self.batch * self.n_heads, self.x.shape[1])

    @classmethod
    def of(cls, params: dict[str, Any], x: Any, key: Any | None, value: Any | None,
           key_visible: Any | None, attn_mask: Any | None, n_heads: int,
           causal: bool, key_add: Any | None = None) -> "_Inputs":
        xp = array_module(x)
        wq = params["wq"]
        d_model = wq.shape[0]
        if n_heads <= 0 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads "
                             f"({n_heads})")
        for k in PARAM_KEYS:
            p = params[k]
            if array_module(p) is not xp:
                raise TypeError(f"x is a {xp.__name__} array; parameter {k} is not")
            if p.dtype != wq.dtype:  # a promoted product would not fit the pass's buffers
                raise TypeError(f"parameter {k} has dtype {p.dtype}; the layer's (wq's) is "
                                f"{wq.dtype}")
            shape = (d_model,) if k.startswith("b") else (d_model, d_model)
            if p.shape != shape:
                raise ValueError(f"parameter {k} must have shape {shape}, got {p.shape}")
        w_qkv = params.get("w_qkv")
        if w_qkv is not None and (array_module(w_qkv) is not xp
                                  or w_qkv.shape != (d_model, 3 * d_model)
                                  or not all(_same_view(w_qkv[:, i * d_model:(i + 1) * d_model],
                                                        params[w])
                                             for i, w in enumerate(("wq", "wk", "wv")))):
            raise ValueError(f"params['w_qkv'] must be a {xp.__name__} array of shape "
                             f"{(d_model, 3 * d_model)} whose column blocks are wq, wk and wv "
                             "(the same memory: they are its views)")
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
                   cross=cross, key_visible=key_visible, mask_add=add,
                   key_add=_key_additive(xp, key_add, batch, seq_k), n_heads=n_heads,
                   head_dim=d_model // n_heads, d_model=d_model, causal=causal,
                   dtype=x.dtype, params=params, batch=batch,
                   scale=1 / math.sqrt(d_model // n_heads))


def _additive(xp: Any, mask: Any | None, rows: int, seq_q: int, seq_k: int) -> Any | None:
    """``attn_mask`` as an additive float64 ``(m, seq_q, seq_k)`` array (or None), ``m`` its
    groups of rows (:func:`attention.fused_rules.mask_groups`)."""
    if mask is None:
        return None
    if array_module(mask) is not xp:
        raise TypeError("attn_mask must live on the same array module as x")
    groups = mask_groups(mask.shape, rows, seq_q, seq_k)
    if mask.dtype == bool:
        add = xp.where(mask, -np.inf, 0.0)
    elif mask.dtype in SUPPORTED_DTYPES:  # float16, bfloat16, float32, float64
        add = astype(mask, np.float64)
    else:
        raise TypeError(f"attn_mask must be boolean (True = not allowed) or float, got "
                        f"{mask.dtype}")
    # explicit leading length: -1 is ambiguous when seq_q or seq_k is 0
    return xp.ascontiguousarray(add.reshape((groups, seq_q, seq_k)))


def _key_additive(xp: Any, mask: Any | None, batch: int, seq_k: int) -> Any | None:
    """The float key padding mask ``key_add`` as a C-contiguous float64 ``(batch, seq_k)`` array
    (or None)."""
    if mask is None:
        return None
    if array_module(mask) is not xp:
        raise TypeError("key_add must live on the same array module as x")
    if mask.shape != (batch, seq_k):
        raise ValueError(f"key_add must have shape {(batch, seq_k)} (batch, seq_k), got "
                         f"{mask.shape}")
    if mask.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"key_add must be float (added to the scores), got {mask.dtype}")
    return xp.ascontiguousarray(astype(mask, np.float64))


def folded_mask(inp: Any, rows: int, seq_q: int) -> Any | None:
    """The unfused core's additive mask of the inputs ``inp`` (``xp``, ``mask_add``,
    ``key_add``, ``_folded``): ``mask_add`` as the unfused softmax reads it, ``(1 or rows,
    seq_q, seq_k)``, with ``key_add`` ``(m, seq_k)`` folded in (``rows / m`` rows per row of
    ``key_add``); a ``mask_add`` given per group of rows, and any fold, made once as a float64
    ``(rows, seq_q, seq_k)`` array and kept in ``inp._folded``."""
    add = inp.mask_add
    if inp.key_add is None and (add is None or add.shape[0] in (1, rows)):
        return add
    if inp._folded is None:
        inp._folded = _folded(inp.xp, add, inp.key_add, rows, seq_q)
    return inp._folded


def _folded(xp: Any, add: Any | None, keys: Any | None, rows: int, seq_q: int) -> Any:
    """``add`` ``(m, seq_q, seq_k)`` (None: 0; row ``b`` reads ``add[b // (rows / m)]``) plus the
    per-key mask ``keys`` ``(m', seq_k)`` (None: 0) on every query row of each of its ``rows /
    m'`` rows, float64 ``(rows, seq_q, seq_k)``: ``0 + add``, then ``+ keys``, as PyTorch merges
    ``attn_mask`` and a float ``key_padding_mask``."""
    seq_k = (add if keys is None else keys).shape[-1]
    out = xp.zeros((rows, seq_q, seq_k))
    if add is not None:
        out.reshape(add.shape[0], rows // add.shape[0], seq_q, seq_k)[...] += add[:, None]
    if keys is not None:
        out.reshape(keys.shape[0], rows // keys.shape[0], seq_q, seq_k)[...] += \
            keys[:, None, None, :]
    return out


def check_mask_grad(attn_mask: Any | None, core: str) -> None:
    """Raise ``ValueError`` where ``mask_grad=True`` cannot be honoured: it needs a float
    ``attn_mask``, and the unfused core (whose checked ``dS`` is the mask's gradient)."""
    if attn_mask is None or attn_mask.dtype == bool:
        raise ValueError("mask_grad=True needs a float attn_mask")
    if core == "fused":
        raise refused(f"mask_grad=True ({MASK_GRAD.format('attn_mask')})")


def mask_gradient(inp: Any, d_scores: Any, shape: tuple[int, ...]) -> Any:
    """The gradient of an additive ``attn_mask`` of ``shape`` (2-D: summed over the batch; ``(m,
    seq_q, seq_k)``: over each of its groups of rows) from
    the checked ``dS`` ``(n, seq_q, seq_k)``, which is ``1 / sqrt(inp.head_dim)`` times the
    gradient of the masked scores; with ``inp.causal``, entries above the diagonal (never
    written) are 0."""
    xp = inp.xp
    grad = d_scores.astype(np.float64) * math.sqrt(inp.head_dim)
    if inp.causal:
        grad = xp.where(xp.tri(*grad.shape[1:], dtype=bool), grad, 0.0)
    if len(shape) == 2:
        return grad.sum(axis=0)
    return grad.reshape(shape[0], grad.shape[0] // shape[0], *grad.shape[1:]).sum(axis=1)


def _gradient_buffers(given: dict[str, Any], inp: "_Inputs") -> dict[str, Any]:
    """Validated ``grads_out``, completed with new arrays for the gradients not given; the
    weight gradients all in one layout (``x @ w``, or all transposed: PyTorch's ``W``)."""
    unknown = set(given) - set(PARAM_KEYS)
    if unknown:
        raise ValueError(f"grads_out has unknown keys {sorted(unknown)}; expected {PARAM_KEYS}")
    xp, par = inp.xp, inp.params
    layouts = {_transposed_2d(g) for k, g in given.items() if k in _WEIGHTS}
    if len(layouts) > 1:
        raise ValueError("grads_out: give the weight gradients in one layout, every one "
                         "C-contiguous or every one the transpose of a C-contiguous array")
    w_layout = layouts == {True}
    out = {}
    for k in PARAM_KEYS:
        g = given.get(k)
        if g is None:
            g = xp.empty(par[k].shape[::-1], inp.dtype).T if w_layout and k in _WEIGHTS else \
                xp.empty(par[k].shape, inp.dtype)
        elif array_module(g) is not xp or g.shape != par[k].shape or g.dtype != inp.dtype:
            raise ValueError(f"grads_out[{k!r}] must be a {xp.__name__} {inp.dtype} array of "
                             f"shape {par[k].shape}")
        elif xp is np and not g.flags.writeable:
            raise ValueError(f"grads_out[{k!r}] is read-only")
        out[k] = g
    names = list(given)
    for i, k in enumerate(names):  # each written whole, while the parameters are read
        g = given[k]
        clash = [f"params[{p!r}]" for p, w in par.items() if xp.may_share_memory(g, w)] + \
            [f"grads_out[{o!r}]" for o in names[i + 1:] if xp.may_share_memory(g, given[o])]
        if clash:
            raise ValueError(f"grads_out[{k!r}] shares memory with {', '.join(clash)}")
    return out


def _same_view(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same view of memory: shape, strides and first address."""
    address = (lambda t: t.__array_interface__["data"][0]) if isinstance(a, np.ndarray) else \
        (lambda t: t.data.ptr)
    return a.shape == b.shape and a.strides == b.strides and address(a) == address(b)


def _stacked_encoding(xp: Any, parts: list[Any], batch: int, out: Any, ws: Workspace,
                      name: str) -> Any:
    """Column encoding ``out`` ``(3, 1, width)`` of a ``(batch * seq, width)`` matrix from the
    column encodings of its head blocks over each batch item's ``seq`` rows (``parts``, side by
    side, each ``(3, batch * heads, head_dim)``, as the per-head products observe them). Plain
    and absolute sums add up over the items; the location weight of row ``s`` of item ``b``,
    ``(b * seq + s + 1) / (batch * seq)``, is ``b / batch`` plus the item's own ``(s + 1) /
    seq`` over ``batch`` (numba on the CPU: :func:`attention._cpu_encodings.stack`; on CuPy in
    ``ws``'s buffers, named after ``name``: no allocation after the first call)."""
    if xp is np:
        from attention import _cpu_encodings  # numba: loaded with the CPU path only

        _cpu_encodings.stack(tuple(parts), batch, out)
        return out
    e = ws.buffer(name + "^items", xp, (3, batch, out.shape[2]), np.float64)
    xp.concatenate([x.reshape(3, batch, -1) for x in parts], axis=2, out=e)
    e[0].sum(axis=0, out=out[0, 0])
    e[2].sum(axis=0, out=out[2, 0])
    xp.divide(e[1], batch, out=e[1])
    if batch > 1:  # item 0's weight is 0: left out, no 0 * inf = NaN
        item = ws.constant(f"item weights {batch}", xp, lambda: (
            xp.arange(1, batch, dtype=np.float64) / batch)[:, None])
        xp.multiply(item, e[0, 1:], out=e[0, 1:])
        xp.add(e[1, 1:], e[0, 1:], out=e[1, 1:])
    e[1].sum(axis=0, out=out[1, 0])
    return out
