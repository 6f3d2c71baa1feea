"""A protected linear layer's products on PyTorch tensors: ``y = x M + b`` and its gradients.

:class:`ProtectedLinearCore` holds what one projection's products run under (check mode, fault
hook, last report, plans and buffers per device, the weight's encodings: a
:class:`attention._torch_state.LinearProtection`) and computes them through the custom operators
of :mod:`attention._torch_linear_op` on the tensors' memory (CPU tensors as
NumPy arrays, CUDA tensors as CuPy arrays): each product is PyTorch's own GEMM (``torch.mm`` into
the result, on PyTorch's threads as the unprotected layer; NumPy's BLAS would get one thread next
to them), verified and repaired by a planned product (:meth:`abftgemm.ProtectedMatmul.execute`
with ``gemm=``). ``M`` is the layer's weight as it multiplies: ``W^T``
for ``nn.Linear`` (weight stored ``(out, in)``), ``W`` itself for GPT-2's ``Conv1D`` (stored
``(in, out)``).

The products and where the weight sits (the fast column check encodes the left operand ``a``;
an encoding of a constant ``a`` is made once, :class:`abftgemm.ProtectedMatmul`'s ``constant_a``):

- ``forward``: ``y = x M + b`` with ``a = x``: the bias is added inside the protection, and the
  check multiplies the encoding of ``x`` (which it must read anyway) by ``M``; no weight encoding.
- ``d_input``: in a widening layer (``in < out``: GPT-2's ``c_attn``, the first feed-forward
  layer) ``dx^T = M dy^T`` with ``a = M``: the weight's column encoding is kept between calls and
  remade only when the weight changed (its memory, layout or ``_version``, which optimizer steps
  and every in-place write through the Parameter advance); ``dx`` goes to autograd as the
  transpose of that product (no copy). Otherwise ``dx = dy M^T`` with ``a = dy`` (encoded every
  call) and a contiguous ``dx``: a transposed ``dx`` slows the elementwise backward of what
  consumes it (GPT-2's GELU backward, fed by ``mlp.c_proj``'s ``dx``), which costs more than
  reading ``dy`` once when ``dy`` is not the wider of the two
  (:func:`attention._torch_linear_op.weight_on_left`).
- ``d_weight``: ``dW`` written straight into the Parameter's layout (``dy^T x`` for ``nn.Linear``,
  ``x^T dy`` for ``Conv1D``).
- ``d_bias``: ``db = 1^T dy``, a product whose constant ``a`` is a row of ones.

A stale weight encoding (a weight changed behind the version counter, through ``.data``) cannot
pass wrong data: its prediction disagrees with the product, the plan's rare path verifies the
product in both directions from the operands themselves, and the encoding is remade on the next
call.
"""
from __future__ import annotations

import math

import torch

from attention._torch_arrays import autocast
from attention._torch_linear_op import apply_linear
from attention._torch_state import LinearProtection, ProtectionAttribute

#: The products of one protected linear layer, in the order a step runs them.
LINEAR_SITES = ("forward", "d_input", "d_weight", "d_bias")
__all__ = ["LINEAR_SITES", "ProtectedLinearCore"]


class ProtectedLinearCore:
    """The checked products of one linear layer, forward and backward.

    Parameters
    ----------
    check : {"correct", "detect", "off"}
        As in :func:`abftgemm.matmul`, for every product.

    Attributes
    ----------
    protection : attention._torch_state.LinearProtection
        What its calls run under (plans and buffers per device, the weight's encodings);
        ``check``, ``fault_hook``, ``last_report`` and ``total_report`` are its attributes,
        read and set through the layer.
    fault_hook : callable ``(site, c)`` or None
        Sees every raw product (a NumPy or CuPy array sharing its memory) before verification;
        ``site`` one of :data:`LINEAR_SITES`: ``forward`` ``(N, out)``, ``d_input`` ``(N, in)``,
        ``d_weight`` in the weight's layout, ``d_bias`` ``(1, out)``.
    last_report : abftgemm.Report
        Findings of the last forward, extended by the backward that follows it.
    total_report : abftgemm.Report
        Every call's findings, forward and backward, since it was last replaced (a layer called
        twice in a step has both calls' here; see
        :attr:`attention.torch_functional.Protection.total_report`).
    """

    check = ProtectionAttribute()
    fault_hook = ProtectionAttribute()
    last_report = ProtectionAttribute()
    total_report = ProtectionAttribute()

    def __init__(self, check: str = "correct"):
        self.protection = LinearProtection(check)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 weight_in_out: bool) -> torch.Tensor:
        """``x M + bias``, differentiable in ``x``, ``weight`` and ``bias``.

        Parameters
        ----------
        x : tensor (..., in)
        weight : tensor (out, in), or (in, out) when ``weight_in_out``
            ``M`` is ``weight.T``, or ``weight`` when ``weight_in_out``.
        bias : tensor (out,), optional
        weight_in_out : bool

        Returns
        -------
        tensor (..., out)

        Raises
        ------
        TypeError, ValueError
            For operands of other dtypes, devices or shapes (nothing is computed).
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"the protected linear layer takes a torch.Tensor, got "
                            f"{type(x).__name__}")
        x, weight, bias = autocast(x, weight, bias)  # as nn.Linear runs under torch.autocast
        if weight.dim() != 2:
            raise ValueError(f"the protected linear layer takes a 2-D weight, got shape "
                             f"{tuple(weight.shape)}")
        n_in, n_out = weight.shape if weight_in_out else weight.shape[::-1]
        _check_operands(x, weight, bias, n_in, n_out)
        rows = math.prod(x.shape[:-1])
        y = apply_linear(self.protection.id, x.reshape(rows, n_in).contiguous(), weight, bias,
                         weight_in_out)
        return y.view(*x.shape[:-1], n_out)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    n_in: int, n_out: int) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"the protected linear layer takes float16, bfloat16, float32 or "
                        f"float64 input, got {x.dtype}")
    if x.dtype != weight.dtype or bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"input dtype {x.dtype} differs from the layer's weight "
                        f"{weight.dtype}" + ("" if bias is None else f" / bias {bias.dtype}")
                        + " (cast the input, or run under torch.autocast)")
    if x.device != weight.device:
        raise ValueError(f"input on {x.device}, the layer's weight on {weight.device}")
    if x.dim() < 1 or x.shape[-1] != n_in:
        raise ValueError(f"input of shape {tuple(x.shape)}: the last dimension must be the "
                         f"layer's {n_in} input features")
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(f"bias of shape {tuple(bias.shape)}, expected ({n_out},)")
