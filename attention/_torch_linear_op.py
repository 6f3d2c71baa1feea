"""The protected linear layer (:mod:`attention.torch_linear`) as PyTorch custom operators.

``abftgemm::linear`` and ``abftgemm::linear_backward`` (``torch.library.custom_op`` with
``register_fake`` and ``register_autograd``), so ``torch.compile`` keeps each one opaque node. The
owner of a call (check mode, hook, plans, the weight's encodings) is named by its ``op_id``, from
the registry of :mod:`attention._torch_state`. The backward needs no state from the forward: it
reads the input and the weight from autograd's saved tensors.

:func:`apply_linear` is what the layer calls: outside ``torch.compile`` and tracing, on plain
tensors, the same bodies run under a ``torch.autograd.Function`` (:class:`_EagerLinear`), which
skips the dispatch of a custom operator (measured: about half of the fixed cost of a protected
layer's forward and backward at the sizes of small transformer models).
"""
from typing import Any, Optional

import torch
from torch.autograd.function import once_differentiable

from attention._torch_arrays import eager
from attention._torch_state import registered as _module


def weight_on_left(n_in: int, n_out: int) -> bool:
    """Whether ``d_input`` runs as ``dx^T = M dy^T`` (the weight's encoding kept, ``dx`` a
    transposed view) rather than ``dx = dy M^T`` (``dy`` encoded every call, ``dx``
    contiguous): when the layer widens (``n_in < n_out``), so that the ``dy`` read saved is wider
    than the transposed ``dx`` its consumers pay for."""
    return n_in < n_out


@torch.library.custom_op("abftgemm::linear", mutates_args=())
def linear(op_id: int, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           weight_in_out: bool) -> torch.Tensor:
    """``x M + bias`` ``(N, out)`` of a contiguous ``x`` ``(N, in)``; ``M`` is ``weight``
    ``(in, out)`` when ``weight_in_out``, else ``weight.T`` (``weight`` ``(out, in)``)."""
    return _module(op_id).run_forward(x, weight, bias, weight_in_out)


@linear.register_fake
def _(op_id, x, weight, bias, weight_in_out):
    return x.new_empty(x.shape[0], weight.shape[1] if weight_in_out else weight.shape[0])


@torch.library.custom_op("abftgemm::linear_backward", mutates_args=())
def linear_backward(op_id: int, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    weight_in_out: bool, need_input: bool, need_weight: bool,
                    need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_x, d_weight, d_bias)`` of one :func:`linear` call, each empty where not needed;
    ``d_x`` ``(N, in)`` is the transpose of a contiguous ``(in, N)`` tensor where
    :func:`weight_on_left`."""
    return _module(op_id).run_backward(dy, x, weight, weight_in_out, need_input, need_weight,
                                       need_bias)


@linear_backward.register_fake
def _(op_id, dy, x, weight, weight_in_out, need_input, need_weight, need_bias):
    n, n_in = x.shape
    left = weight_on_left(n_in, dy.shape[1])
    dx = (x.new_empty(n_in, n).t() if left else x.new_empty(n, n_in)) if need_input \
        else x.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    db = dy.new_empty(dy.shape[1]) if need_bias else dy.new_empty(0)
    return dx, dw, db


def apply_linear(op_id: int, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 weight_in_out: bool) -> torch.Tensor:
    """:func:`linear`, differentiable: the custom operator where a compiler or tracer may see it,
    else :class:`_EagerLinear` on the same bodies."""
    if eager(x, weight, bias):
        return _EagerLinear.apply(op_id, x, weight, bias, weight_in_out)
    return linear(op_id, x, weight, bias, weight_in_out)


class _EagerLinear(torch.autograd.Function):
    """:func:`linear` and its backward without a custom operator's dispatch."""

    @staticmethod
    def forward(ctx: Any, op_id: int, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], weight_in_out: bool) -> torch.Tensor:
        _setup_context(ctx, (op_id, x, weight, bias, weight_in_out), None)
        return _module(op_id).run_forward(x, weight, bias, weight_in_out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return _gradients(ctx, dy, lambda *args: _module(ctx.op_id).run_backward(*args))


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    op_id, x, weight, bias, weight_in_out = inputs
    ctx.save_for_backward(x, weight)
    ctx.op_id, ctx.weight_in_out, ctx.has_bias = op_id, weight_in_out, bias is not None


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    return _gradients(ctx, dy, lambda *args: linear_backward(ctx.op_id, *args))


def _gradients(ctx: Any, dy: torch.Tensor, run: Any) -> tuple:
    """The backward of either path: ``run(dy, x, weight, weight_in_out, need_x, need_w,
    need_b)`` is :func:`linear_backward`'s body or the operator itself."""
    x, weight = ctx.saved_tensors
    _, need_x, need_w, need_b, _ = ctx.needs_input_grad
    need_b = need_b and ctx.has_bias
    dx, dw, db = run(dy.contiguous(), x, weight, ctx.weight_in_out, need_x, need_w, need_b)
    return (None, dx if need_x else None, dw if need_w else None, db if need_b else None, None)


linear.register_autograd(_backward, setup_context=_setup_context)
