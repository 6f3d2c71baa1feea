"""The protected linear layer (:mod:`attention.torch_linear`) as PyTorch custom operators.

``abftgemm::linear`` and ``abftgemm::linear_backward`` (``torch.library.custom_op`` with
``register_fake`` and ``register_autograd``), so ``torch.compile`` keeps each one opaque node. As for
``abftgemm::attention_core`` (:mod:`attention._torch_core_op`), every argument is explicit: the
:class:`attention._torch_state.LinearProtection` a call runs under (check mode, fault hook, last
report, plans and buffers per device, the weight's encodings) is named by its ``id``. The backward
needs no state from the forward: it reads the input and the weight from autograd's saved tensors.
The operators' bodies (:func:`run_forward`, :func:`run_backward`) run the products on the
tensors' memory.

:func:`apply_linear` is what the layer calls: outside ``torch.compile`` and tracing, on plain
tensors, the same bodies run under a ``torch.autograd.Function`` (:class:`_EagerLinear`), which
skips the dispatch of a custom operator (measured: about half of the fixed cost of a protected
layer's forward and backward at the sizes of small transformer models).
"""
import weakref
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from abftgemm.tensors import device_scope
from abftgemm.plan import ProtectedMatmul, settle_all
from abftgemm.report import Report
from attention._torch_arrays import array, eager, first_order, recomputing, threads
from attention._torch_state import LinearProtection, registered

FaultHook = Callable[[str, Any], None]


def weight_on_left(n_in: int, n_out: int) -> bool:
    """Whether ``d_input`` runs as ``dx^T = M dy^T`` (the weight's encoding kept, ``dx`` a
    transposed view) rather than ``dx = dy M^T`` (``dy`` encoded every call, ``dx``
    contiguous): when the layer widens (``n_in < n_out``), so that the ``dy`` read saved is wider
    than the transposed ``dx`` its consumers pay for."""
    return n_in < n_out


@torch.library.custom_op("abftgemm::linear", mutates_args=())
def linear(protection: int, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           weight_in_out: bool) -> torch.Tensor:
    """``x M + bias`` ``(N, out)`` of a contiguous ``x`` ``(N, in)``; ``M`` is ``weight``
    ``(in, out)`` when ``weight_in_out``, else ``weight.T`` (``weight`` ``(out, in)``);
    ``protection`` the ``id`` of the :class:`attention._torch_state.LinearProtection` the call
    runs under."""
    return run_forward(registered(protection), x, weight, bias, weight_in_out)


@linear.register_fake
def _(protection, x, weight, bias, weight_in_out):
    return x.new_empty(x.shape[0], weight.shape[1] if weight_in_out else weight.shape[0])


@torch.library.custom_op("abftgemm::linear_backward", mutates_args=())
def linear_backward(protection: int, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    weight_in_out: bool, need_input: bool, need_weight: bool,
                    need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_x, d_weight, d_bias)`` of one :func:`linear` call, each empty where not needed;
    ``d_x`` ``(N, in)`` is the transpose of a contiguous ``(in, N)`` tensor where
    :func:`weight_on_left`."""
    return run_backward(registered(protection), dy, x, weight, weight_in_out, need_input,
                        need_weight, need_bias)


@linear_backward.register_fake
def _(protection, dy, x, weight, weight_in_out, need_input, need_weight, need_bias):
    n, n_in = x.shape
    left = weight_on_left(n_in, dy.shape[1])
    dx = (x.new_empty(n_in, n).t() if left else x.new_empty(n, n_in)) if need_input \
        else x.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    db = dy.new_empty(dy.shape[1]) if need_bias else dy.new_empty(0)
    return dx, dw, db


def apply_linear(protection: int, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 weight_in_out: bool) -> torch.Tensor:
    """:func:`linear`, differentiable: the custom operator where a compiler or tracer may see it,
    else :class:`_EagerLinear` on the same bodies."""
    if eager(x, weight, bias):
        return _EagerLinear.apply(protection, x, weight, bias, weight_in_out)
    return linear(protection, x, weight, bias, weight_in_out)


class _EagerLinear(torch.autograd.Function):
    """:func:`linear` and its backward without a custom operator's dispatch."""

    @staticmethod
    def forward(ctx: Any, protection: int, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], weight_in_out: bool) -> torch.Tensor:
        _setup_context(ctx, (protection, x, weight, bias, weight_in_out), None)
        return run_forward(registered(protection), x, weight, bias, weight_in_out)

    @staticmethod
    @first_order
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return _gradients(ctx, dy, lambda *args: run_backward(registered(ctx.protection), *args))


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    protection, x, weight, bias, weight_in_out = inputs
    ctx.save_for_backward(x, weight)
    ctx.protection, ctx.weight_in_out, ctx.has_bias = protection, weight_in_out, bias is not None


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    return _gradients(ctx, dy, lambda *args: linear_backward(ctx.protection, *args))


def _gradients(ctx: Any, dy: torch.Tensor, run: Any) -> tuple:
    """The backward of either path: ``run(dy, x, weight, weight_in_out, need_x, need_w,
    need_b)`` is :func:`linear_backward`'s body or the operator itself."""
    x, weight = ctx.saved_tensors
    _, need_x, need_w, need_b, _ = ctx.needs_input_grad
    need_b = need_b and ctx.has_bias
    dx, dw, db = run(dy.contiguous(), x, weight, ctx.weight_in_out, need_x, need_w, need_b)
    return (None, dx if need_x else None, dw if need_w else None, db if need_b else None, None)


linear.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------- the bodies


def run_forward(protection: LinearProtection, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], weight_in_out: bool) -> torch.Tensor:
    """The body of ``abftgemm::linear``: ``y (N, out)`` of ``x (N, in)``."""
    m = _matrix(weight, weight_in_out)
    y = x.new_empty(x.shape[0], m.shape[1])
    report = Report()
    with protection.errors_recorded(), device_scope(x), threads(x), np.errstate(all="ignore"):
        pass_ = _Pass(protection, x.device, report)
        pass_.product("forward", x, m, y, bias)
        pass_.settle()
    protection.record(report)
    if recomputing():  # a checkpointed forward again: the step's findings so far stay
        protection.last_report.extend(report)
    else:
        protection.last_report = report
    return y


def run_backward(protection: LinearProtection, dy: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor, weight_in_out: bool, need_input: bool, need_weight: bool,
                 need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of ``abftgemm::linear_backward``: ``(dx, dW, db)`` of ``dy (N, out)``,
    each an empty tensor where not needed; ``dx`` is the transpose of a C-contiguous
    ``(in, N)`` tensor where :func:`weight_on_left`."""
    m = _matrix(weight, weight_in_out)
    n, (n_in, n_out) = x.shape[0], m.shape
    empty = dy.new_empty(0)
    left = weight_on_left(n_in, n_out)
    dx = (x.new_empty(n_in, n).t() if left else x.new_empty(n, n_in)) if need_input \
        else empty
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight \
        else empty.clone()
    db = dy.new_empty(n_out) if need_bias else empty.clone()
    report = Report()
    with protection.errors_recorded(), device_scope(dy), threads(dy), \
            np.errstate(all="ignore"):
        pass_ = _Pass(protection, dy.device, report)
        if need_input and left:
            pass_.product("d_input", m, dy.t(), dx.t(), constant=weight,
                          present=np.transpose)
        elif need_input:
            pass_.product("d_input", dy, m.t(), dx)
        if need_weight:
            pass_.product("d_weight", *((x.t(), dy) if weight_in_out else (dy.t(), x)), dw)
        if need_bias:
            ones = _ones_for(protection, dy)
            pass_.product("d_bias", ones, dy, db.view(1, n_out), constant=ones)
        pass_.settle()
    protection.record(report)
    protection.last_report.extend(report)
    return dx, dw, db


def _ones_for(protection: LinearProtection, dy: torch.Tensor) -> torch.Tensor:
    """A row of ``dy.shape[0]`` ones (the constant ``a`` of ``d_bias``), kept per layout."""
    key = (dy.device, dy.dtype, dy.shape[0])
    ones = protection.ones.get(key)
    if ones is None:
        ones = protection.ones[key] = dy.new_ones(1, dy.shape[0])
    return ones


def _fresh_encoding(protection: LinearProtection, plan: ProtectedMatmul, source: torch.Tensor,
                    a: Any, b: Any) -> None:
    """Remake ``plan``'s encoding of its constant ``a`` (a view of tensor ``source``) unless it
    was made from this very tensor as it is now (same object, memory, layout and version: a new
    tensor at a freed one's address, such as autocast's copy of the weight, is re-encoded)."""
    key = (source.data_ptr(), source._version, source.dtype, tuple(source.shape),
           source.stride())
    made = protection.encoded.get(id(plan))
    if made is None or made[0]() is not source or made[1] != key:
        plan.reset_constant(a, b)
        protection.encoded[id(plan)] = (weakref.ref(source), key)


class _Pass:
    """The products of one forward or backward call, settled together at its end."""

    def __init__(self, protection: LinearProtection, device: torch.device, report: Report):
        self.protection, self.report = protection, report
        self.ws = protection.workspace(device)
        self.plans: list[ProtectedMatmul] = []
        self.constants: list[ProtectedMatmul] = []

    def product(self, site: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                bias: torch.Tensor | None = None, *, constant: torch.Tensor | None = None,
                present: Callable[[Any], Any] | None = None) -> None:
        """Execute ``out = a @ b (+ bias)`` as ``site`` (2-D tensors, ``out`` C-contiguous):
        PyTorch's own GEMM (on its threads, as the unprotected layer), verified by a planned
        product; ``constant``: the tensor ``a`` views, whose encoding the plan keeps;
        ``present``: how the fault hook sees ``out``."""
        protection = self.protection
        hook = protection.fault_hook
        if hook is not None and present is not None:
            hook = _presenting(hook, present)
        gemm = (lambda: torch.mm(a, b, out=out)) if bias is None else \
            (lambda: torch.addmm(bias, a, b, out=out))
        arrays = [array(t) for t in (a, b, out)]
        if protection.check == "off":
            gemm()
            if hook is not None:
                hook(site, arrays[2])
            return
        a_arr, b_arr, out_arr = arrays
        bias_arr = None if bias is None else array(bias)
        plan = self.ws.product(site, a_arr, b_arr, bias_arr, protection.check,
                               constant_a=constant is not None)
        if constant is not None:
            _fresh_encoding(protection, plan, constant, a_arr, b_arr)
            self.constants.append(plan)
        try:
            plan.execute(a_arr, b_arr, bias=bias_arr, out=out_arr, fault_hook=hook,
                         gemm=gemm)
        except BaseException:
            self.ws.abandon()
            raise
        self.plans.append(plan)

    def settle(self) -> None:
        """Settle every product with one synchronization; a rare path (a repair, or a weight
        changed behind its version counter) has the constant encodings remade next call."""
        rare = self.ws.counters.rare_paths
        try:
            reports = settle_all(self.plans)
        except BaseException:
            self.ws.abandon()
            raise
        finally:
            if self.ws.counters.rare_paths != rare:
                for plan in self.constants:
                    self.protection.encoded.pop(id(plan), None)
        for report in reports:
            self.report.extend(report)


def _presenting(hook: FaultHook, present: Callable[[Any], Any]) -> FaultHook:
    return lambda site, c: hook(site, present(c))


def _matrix(weight: torch.Tensor, weight_in_out: bool) -> torch.Tensor:
    """``M`` of ``y = x M``: the weight, or its transpose (a view)."""
    return weight if weight_in_out else weight.t()
