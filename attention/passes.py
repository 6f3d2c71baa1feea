"""The attention pass as data: every step of a forward and a backward pass, in the order it runs.

:data:`FORWARD` and :data:`BACKWARD` are the layer's passes. The attention core inside them
(:data:`CORE_FORWARD`, :data:`CORE_BACKWARD`) is one contiguous part of each: what
:mod:`attention.core` runs alone, and what a fused core replaces (:func:`with_core`). One
executor (:class:`attention.functional._Pass`) runs a table that :func:`steps` resolved for one
call (:class:`Variant`); :func:`checksums` follows it with the executor's rules to say where each
step's checksums come from. ``CheckingPlan().table()``, docs/checking_plan.md and the counted
costs of :mod:`attention.experiments.check_costs` are printed from these; a pass records what it
ran (``Context.trace``) in the same words.

Tensor names: ``x`` (query input), ``key``, ``value`` (``x`` in self-attention), the parameters
(``wq`` ... ``bo``), their gradients (``d_wq`` ... ``d_bo``), ``qh``-like names for tensors split
into heads ``(batch*heads, seq, head_dim)``, and ``probs_dropped`` (``probs`` without dropout); a
trailing ``^T`` transposes the last two axes. The backward binds every ``(batch, seq, d_model)``
tensor as ``(batch*seq, d_model)``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import wraps
from typing import Any, Callable

from attention.dropout import DROPOUT_SITE

@dataclass(frozen=True)
class Step:
    """One step of a pass.

    Attributes
    ----------
    op : str
        What the step does (the executor's method of that name, spaces as ``_``):

        - ``"gemm"``: a planned product verified by its column checksums; hands on the column
          encoding it observed of its product and, on the CPU, the one it made of its ``a``;
        - ``"gemm rows"``: a planned product verified by its row checksums only, which the next
          softmax step observes on its one read of the product;
        - ``"split"``, ``"merge"``: heads to and from the leading axis; hand on the encoding
          named ``sums`` (per batch item; a backward merge composes it over the items of the
          ``(batch*seq, d_model)`` matrix);
        - ``"softmax"``, ``"softmax backward"``: the checked softmax steps (invariants); they
          observe the row checksums of the product they read and, on the CPU, make the column
          encodings of what they write and of its transpose;
        - ``"dropout"``: ``P * keep / (1 - p)``, recomputed and compared bit for bit;
        - ``"stack"``: columns side by side, with their encodings when every part has one;
        - ``"column sum"``: a bias gradient (not checked);
        - ``"fused core"``, ``"fused core backward"``: the fused attention core
          (:mod:`attention.fused`) in place of :data:`CORE_FORWARD` and :data:`CORE_BACKWARD`,
          every tile checked inside it (its own fault-hook sites,
          :data:`attention.fused.FUSED_SITES`); it encodes its operands itself;
        - ``"fused check"``: the fused core's final check of what it returned
          (:mod:`attention.fused_final`: forward, the output rows against the row checksums its
          kernel carried from V's row encodings; backward, ``dV``'s column sums against
          ``dO``'s, and ``dK``'s against 0), its site the fault hook's too.
    out : str
        Name of what the step makes (names joined by ``", "`` where it makes several).
    ins : tuple of str
        Names of what it reads (for a GEMM ``(a, b)``).
    site : str or None
        The checking plan's and the fault hook's site (GEMMs, softmax, dropout).
    bias : str or None
        A GEMM's bias, added inside the protection.
    sums : str or None
        The name whose column encoding is ``a``'s (an earlier step hands it on; when none did,
        ``a`` is encoded); a split's or merge's: the one it hands on.
    rows : str or None
        A ``"gemm rows"``: the name whose column encoding is the row encoding of ``b`` (``b``
        is that name transposed); without it ``b`` is read for it.
    a_triangle : {None, "lower", "upper"}
        Causal layers: ``a`` is zero outside this triangle; the product multiplies only the
        blocks that can hold non-zeros.
    out_triangle : {None, "lower"}
        Causal layers: only this triangle of the product is read (computed and verified up to
        each row block's last column).
    when : {None, "self", "cross", "dropout"}
        Only in self-attention, only in cross-attention, only with dropout; None: always.
    weight : bool
        A weight gradient: in the ``W`` layout (:attr:`Variant.w_layout`) it is ``transposed``.
    transposed : bool
        (Resolved) the product is written as ``b^T a^T`` into the transpose of the caller's
        buffer; that product's ``a``, ``b^T``, is encoded (no step hands its encoding on).
    """

    op: str
    out: str
    ins: tuple[str, ...]
    site: str | None = None
    bias: str | None = None
    sums: str | None = None
    rows: str | None = None
    a_triangle: str | None = None
    out_triangle: str | None = None
    when: str | None = None
    weight: bool = False
    transposed: bool = False

    def computes(self) -> str:
        """The step as a formula of its names."""
        a, b = (self.ins + ("",))[:2]
        if self.op in ("gemm", "gemm rows"):
            if self.transposed:
                return f"{self.out} = ({transpose(b)} {transpose(a)})^T"
            return f"{self.out} = {a} {b}" + (f" + {self.bias}" if self.bias else "") + \
                (f" ({a} {self.a_triangle} triangular)" if self.a_triangle else "") + \
                (f" ({self.out_triangle} triangle only)" if self.out_triangle else "")
        return self.out + " = " + _FORMULAS.get(self.op, self.op + "({a})").format(
            a=a, b=b, ins=" ".join(self.ins))


_FORMULAS = {"softmax backward": "softmax_backward({a}, {b})", "stack": "[{ins}]",
             "column sum": "column sums of {a}", "dropout": "{a} * keep / (1 - p)",
             "fused core": "fused_attention({ins})",
             "fused core backward": "fused_attention_backward({ins})",
             "fused check": "{a}, verified"}


def transpose(name: str) -> str:
    """The name of ``name`` transposed."""
    return name[:-2] if name.endswith("^T") else name + "^T"


#: The attention core's forward: ``qh``, ``kh``, ``vh`` -> ``context_h`` (and ``probs``).
CORE_FORWARD = (
    Step("gemm rows", "scores", ("qh", "kh^T"), site="scores", rows="kh", out_triangle="lower"),
    Step("softmax", "probs", ("scores",), site="softmax"),
    Step("dropout", "probs_dropped", ("probs",), site=DROPOUT_SITE, when="dropout"),
    Step("gemm", "context_h", ("probs_dropped", "vh"), site="context", sums="probs_dropped",
         a_triangle="lower"),
)
#: The attention core's backward: ``d_context_h`` -> ``d_qh``, ``d_kh``, ``d_vh``.
CORE_BACKWARD = (
    Step("gemm rows", "d_probs", ("d_context_h", "vh^T"), site="d_probs", rows="vh",
         out_triangle="lower"),
    Step("gemm", "d_vh", ("probs_dropped^T", "d_context_h"), site="d_v", sums="probs_dropped^T",
         a_triangle="upper"),
    Step("softmax backward", "d_scores", ("d_probs", "probs"), site="softmax_backward"),
    Step("gemm", "d_qh", ("d_scores", "kh"), site="d_q", sums="d_scores", a_triangle="lower"),
    Step("gemm", "d_kh", ("d_scores^T", "qh"), site="d_k", sums="d_scores^T", a_triangle="upper"),
)
#: The fused core (:mod:`attention.fused`) in place of :data:`CORE_FORWARD`: ``context_h`` and
#: the rows' log-sum-exp ``lse``, no ``L x L`` array kept.
FUSED_FORWARD = (Step("fused core", "context_h, lse", ("qh", "kh", "vh")),
                 Step("fused check", "context_h, lse", ("context_h",),
                      site="fused:out"))
#: The fused core's backward in place of :data:`CORE_BACKWARD`.
FUSED_BACKWARD = (Step("fused core backward", "d_qh, d_kh, d_vh",
                       ("d_context_h", "qh", "kh", "vh", "context_h", "lse")),
                  Step("fused check", "d_qh, d_kh, d_vh", ("d_vh", "d_context_h"),
                       site="fused:dV_out"),
                  Step("fused check", "d_qh, d_kh, d_vh", ("d_kh", "d_context_h"),
                       site="fused:dK_out"))
#: The layer's forward: ``x`` (``key``, ``value``) -> ``y``.
FORWARD = (
    Step("gemm", "q", ("x", "wq"), site="q_proj", bias="bq"),
    Step("gemm", "k", ("key", "wk"), site="k_proj", bias="bk", sums="key"),
    Step("gemm", "v", ("value", "wv"), site="v_proj", bias="bv", sums="value"),
    Step("split", "qh", ("q",), sums="q"),
    Step("split", "kh", ("k",), sums="k"),
    Step("split", "vh", ("v",), sums="v"),
    *CORE_FORWARD,
    Step("merge", "context", ("context_h",), sums="context_h"),
    Step("gemm", "y", ("context", "wo"), site="out_proj", bias="bo", sums="context"),
)
#: The layer's backward: ``dy`` -> ``dx`` (``d_key``, ``d_value``) and the parameter gradients.
BACKWARD = (
    Step("gemm", "d_wo", ("context^T", "dy"), site="d_wo", weight=True),
    Step("column sum", "d_bo", ("dy",)),
    Step("gemm", "d_context", ("dy", "wo^T"), site="d_context"),
    Step("split", "d_context_h", ("d_context",)),
    *CORE_BACKWARD,
    Step("merge", "dq", ("d_qh",), sums="d_qh"),
    Step("merge", "dk", ("d_kh",), sums="d_kh"),
    Step("merge", "dv", ("d_vh",), sums="d_vh"),
    Step("gemm", "d_wq", ("x^T", "dq"), site="d_wq", weight=True),
    Step("column sum", "d_bq", ("dq",)),
    Step("gemm", "d_wk", ("key^T", "dk"), site="d_wk", sums="key^T", weight=True),
    Step("column sum", "d_bk", ("dk",)),
    Step("gemm", "d_wv", ("value^T", "dv"), site="d_wv", sums="value^T", weight=True),
    Step("column sum", "d_bv", ("dv",)),
    Step("stack", "d_qkv", ("dq", "dk", "dv"), when="self"),
    Step("stack", "w_qkv", ("wq", "wk", "wv"), when="self"),
    Step("gemm", "dx", ("d_qkv", "w_qkv^T"), site="d_x", sums="d_qkv", when="self"),
    Step("gemm", "dx", ("dq", "wq^T"), site="d_x", sums="dq", when="cross"),
    Step("gemm", "d_key", ("dk", "wk^T"), site="d_key", sums="dk", when="cross"),
    Step("gemm", "d_value", ("dv", "wv^T"), site="d_value", sums="dv", when="cross"),
)


#: The layer's parameters, in the order its API lists them.
PARAM_KEYS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
#: What the caller binds before each pass (``w_qkv`` as well where it has that memory: the
#: ``stack`` step then takes it as it is) and what it takes from the pass. The backward also
#: reads what the forward kept for it (:func:`carried`), and binds ``context`` and every
#: ``(batch, seq, d_model)`` tensor as ``(batch*seq, d_model)``.
FORWARD_INPUTS = ("x", "key", "value", *PARAM_KEYS)
FORWARD_OUTPUT = "y"
BACKWARD_INPUTS = ("x", "key", "value", "dy", "context", *PARAM_KEYS,
                   *("d_" + p for p in PARAM_KEYS))
BACKWARD_OUTPUTS = ("dx", "d_key", "d_value")


def _by_identity(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` memoized on its arguments, tables by identity (a table of steps is slow to hash at
    every call, and the tables are constants)."""
    memo: dict[tuple, tuple[tuple, Any]] = {}

    @wraps(fn)
    def cached(*args: Any) -> Any:
        key = tuple([id(a) if type(a) is tuple else a for a in args])
        hit = memo.get(key)
        if hit is None or not all([h is a or type(a) is not tuple for h, a in zip(hit[0], args)]):
            hit = memo[key] = (args, fn(*args))  # the arguments kept: their ids stay theirs
        return hit[1]

    return cached


def with_core(table: tuple[Step, ...], core: tuple[Step, ...],
              replacement: tuple[Step, ...]) -> tuple[Step, ...]:
    """``table`` with its part ``core`` (:data:`CORE_FORWARD` or :data:`CORE_BACKWARD`, a
    contiguous run of its steps) replaced by ``replacement``, such as one fused step."""
    at = table.index(core[0])
    if table[at:at + len(core)] != core:
        raise ValueError("the core is not a contiguous part of the table")
    return table[:at] + replacement + table[at + len(core):]


@dataclass(frozen=True)
class Variant:
    """What one call's steps depend on.

    Attributes
    ----------
    cross : bool
        Cross-attention (``key`` and ``value`` are other inputs; else they are ``x``).
    causal : bool
        The triangles of :class:`Step` apply.
    dropout : bool
        Attention dropout (``probs_dropped`` is its own tensor; else it is ``probs``).
    w_layout : bool
        The weight gradients go to buffers in PyTorch's ``W`` layout (``w^T``, as
        :mod:`attention.torch` hands them): their steps are ``transposed``.
    gpu : bool
        CuPy arrays: the softmax kernels make no encodings, and a GPU plan keeps no whole
        encoding of an ``a`` it encoded (:meth:`abftgemm.ProtectedMatmul.a_encoding`).
    fused : bool
        The fused core runs in place of the layer's core (:func:`layer`).
    """

    cross: bool = False
    causal: bool = False
    dropout: bool = False
    w_layout: bool = False
    gpu: bool = False
    fused: bool = False


_FUSED_LAYER = (with_core(FORWARD, CORE_FORWARD, FUSED_FORWARD),
                with_core(BACKWARD, CORE_BACKWARD, FUSED_BACKWARD))


def layer(variant: Variant) -> tuple[tuple[Step, ...], tuple[Step, ...]]:
    """The layer's forward and backward tables in ``variant``: :data:`FORWARD` and
    :data:`BACKWARD`, with :data:`FUSED_FORWARD` and :data:`FUSED_BACKWARD` in place of their
    core where ``variant.fused``."""
    return _FUSED_LAYER if variant.fused else (FORWARD, BACKWARD)


@_by_identity
def steps(table: tuple[Step, ...], variant: Variant) -> tuple[Step, ...]:
    """The steps of ``table`` that run in ``variant``, with its names and attributes."""
    names = {} if variant.dropout else {"probs_dropped": "probs"}
    if not variant.cross:
        names.update(key="x", value="x")

    def name(n: str | None) -> str | None:
        if n is None:
            return None
        base = n.removesuffix("^T")
        return names.get(base, base) + n[len(base):]

    keep = {None, "dropout" if variant.dropout else None, "cross" if variant.cross else "self"}
    out = []
    for s in table:
        if s.when not in keep:
            continue
        out.append(replace(s, ins=tuple(name(n) for n in s.ins), sums=name(s.sums),
                           rows=name(s.rows), when=None,
                           a_triangle=s.a_triangle if variant.causal else None,
                           out_triangle=s.out_triangle if variant.causal else None,
                           transposed=s.weight and variant.w_layout))
    return tuple(out)


#: The invariants that check the softmax steps (they receive ``fault_hook`` calls too).
INVARIANT_SITES = {
    "softmax": "rows of P sum to 1; log P_ij - z_ij is the same for every visible j",
    "softmax_backward": "rows of dS sum to 0; their dP-weighted sums equal sum P dP^2 - r^2",
}


#: The fused core's final checks (:mod:`attention.fused_final`), O(L d) a head.
FUSED_CHECKS = {
    "fused:out": "final check of O as returned (16-bit rounding included): its row checksums "
                 "against P [V1, Vw, abs(V)1] / l, carried by the kernel from V's row encodings",
    "fused:dV_out": "final check of dV as returned: 1^T dV = (P 1)^T dO, the column sums of dO "
                    "over the rows that see a key (P's rows sum to 1; with dropout weighted by "
                    "the kept sums the forward carried), and its rows against the row checksums "
                    "the backward kernel carried",
    "fused:dK_out": "final check of dK as returned: 1^T dK = scale (dS 1)^T Q = 0, the column sums "
                    "of dK are 0 (dS's rows sum to 0: sum_j P_ij dP_ij = rowsum(dO O)_i = D_i), "
                    "with dropout too, and its rows against the row checksums the backward "
                    "kernel carried",
}


def checksums(table: tuple[Step, ...], gpu: bool = False,
              given: frozenset[str] = frozenset()) -> list[str | None]:
    """Per resolved step, what it takes or makes of the encodings (the executor records the same
    in ``Context.trace``), following the executor's rules (``Step.op``) on names, every site
    checked, float32 or float64, no fault hook: a GEMM, split or merge: the name whose encoding
    it takes (its ``rows`` for a ``"gemm rows"``, else its ``sums``) when an earlier step handed
    it on, else None; a stack: its inputs when each has one; a softmax step: its output, whose
    encodings it makes (not on the GPU). ``given``: names whose encodings the pass starts with
    (saved by the forward)."""
    return _follow(table, gpu, given)[0]


def describe(step: Step, taken: str | None) -> str:
    """The ``checksums`` column of the plan's table for ``step`` and what it took (or made)."""
    if step.op == "gemm":
        if step.transposed:
            return (f"encoded: written transposed into the W-layout buffer; its a, "
                    f"{transpose(step.ins[1])}, is no step's")
        return f"passed: column encoding of {taken}" if taken else "encoded"
    if step.op == "gemm rows":
        source = f"column encoding of {taken} passed" if taken else "b read"
        return f"row checksums only, observed by the softmax on its one read; b's rows: {source}"
    if step.op in ("split", "merge", "stack"):
        return f"hands on the column encodings of {taken}" if taken else "-"
    if step.op in ("softmax", "softmax backward"):
        made = f"; makes the column encodings of {taken} and {taken}^T" if taken else ""
        return f"invariant: {INVARIANT_SITES[step.site]}{made}"
    if step.op == "dropout":
        return "recomputed from P and the mask, compared bit for bit"
    if step.op.startswith("fused core"):
        return "every tile checked inside the fused core; it encodes its operands itself"
    if step.op == "fused check":
        return FUSED_CHECKS[step.site]
    return "not checked"


@_by_identity
def carried(forward: tuple[Step, ...], backward: tuple[Step, ...],
            gpu: bool = False) -> tuple[frozenset[str], frozenset[str]]:
    """What a forward keeps for its backward: the tensors it makes that the backward reads, and
    the names whose encodings it hands on that the backward takes."""
    made = {n for s in forward for n in s.out.split(", ")}
    read = {n.removesuffix("^T") for s in backward for n in s.ins}
    wanted = {s.rows if s.op == "gemm rows" else s.sums for s in backward}
    return frozenset(made & read), frozenset(wanted & _follow(forward, gpu, frozenset())[1])


def _follow(table: tuple[Step, ...], gpu: bool,
            given: frozenset[str]) -> tuple[list[str | None], set[str]]:
    have, taken = set(given), []
    for s in table:
        if s.op == "stack":
            t = " ".join(s.ins) if all(n in have for n in s.ins) else None
        elif s.op in ("softmax", "softmax backward"):
            t = None if gpu else s.out
        else:
            want = s.rows if s.op == "gemm rows" else s.sums
            t = want if want in have and not s.transposed else None
        taken.append(t)
        if s.op == "gemm" and not s.transposed:
            have |= {s.out} if t or gpu else {s.out, s.ins[0]}
        elif t and s.op in ("split", "merge", "stack"):
            have.add(s.out)
        elif t and s.op in ("softmax", "softmax backward"):
            have |= {s.out, s.out + "^T"}
    return taken, have
