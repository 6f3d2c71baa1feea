"""A protected linear layer's products on PyTorch tensors: ``y = x M + b`` and its gradients.

:class:`ProtectedLinearCore` holds what one projection's products run under (check mode, fault
hook, last report, plans and buffers per device, the weight's encodings) and computes them through
the custom operators of :mod:`attention._torch_linear_op` on the tensors' memory (CPU tensors as
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
  consumes it (measured: GPT-2's GELU backward fed by ``mlp.c_proj``'s ``dx``, about 25% of a
  ``mlp=True`` step), which costs more than reading ``dy`` once when ``dy`` is not the wider of
  the two (:func:`weight_on_left`).
- ``d_weight``: ``dW`` written straight into the Parameter's layout (``dy^T x`` for ``nn.Linear``,
  ``x^T dy`` for ``Conv1D``).
- ``d_bias``: ``db = 1^T dy``, a product whose constant ``a`` is a row of ones.

A stale weight encoding (a weight changed behind the version counter, through ``.data``) cannot
pass wrong data: its prediction disagrees with the product, the plan's rare path verifies the
product in both directions from the operands themselves, and the encoding is remade on the next
call.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np
import torch

import abftgemm
from abftgemm._torch import device_scope
from abftgemm.plan import ProtectedMatmul, settle_all
from abftgemm.report import Report
from attention import _torch_linear_op, _torch_state
from attention._torch_linear_op import weight_on_left
from attention._torch_arrays import array, threads
from attention.workspace import Workspace

FaultHook = Callable[[str, Any], None]
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
    fault_hook : callable ``(site, c)`` or None
        Sees every raw product (a NumPy or CuPy array sharing its memory) before verification;
        ``site`` one of :data:`LINEAR_SITES`: ``forward`` ``(N, out)``, ``d_input`` ``(N, in)``,
        ``d_weight`` in the weight's layout, ``d_bias`` ``(1, out)``.
    last_report : abftgemm.Report
        Findings of the last forward, extended by the backward that follows it.
    """

    def __init__(self, check: str = "correct"):
        if check not in abftgemm.CHECK_MODES:
            raise ValueError(f"check must be one of {abftgemm.CHECK_MODES}, got {check!r}")
        self.check = check
        self.fault_hook: FaultHook | None = None
        self.last_report = Report()
        self._workspaces: dict[torch.device, Workspace] = {}
        #: What each constant-``a`` plan's encoding was made from (by ``id`` of the plan).
        self._encoded: dict[int, tuple] = {}
        self._ones: dict[tuple, torch.Tensor] = {}
        self.op_id = _torch_state.register(self)

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
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.is_floating_point():  # as nn.Linear runs
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        n_in, n_out = weight.shape if weight_in_out else weight.shape[::-1]
        _check_operands(x, weight, bias, n_in, n_out)
        y = _torch_linear_op.apply_linear(self.op_id, x.reshape(-1, n_in).contiguous(), weight,
                                          bias, weight_in_out)
        return y.view(*x.shape[:-1], n_out)

    def __getstate__(self) -> dict[str, Any]:
        """Without its plans, buffers and encodings (``copy.deepcopy``, ``torch.save`` and
        ``pickle`` work after a forward; a copy builds its own on first use)."""
        state = self.__dict__.copy()
        state["_workspaces"], state["_encoded"], state["_ones"] = {}, {}, {}
        del state["op_id"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.op_id = _torch_state.register(self)

    # ------------------------------------------------------------------ passes

    def run_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    weight_in_out: bool) -> torch.Tensor:
        """The body of ``abftgemm::linear``: ``y (N, out)`` of ``x (N, in)``."""
        m = _matrix(weight, weight_in_out)
        y = x.new_empty(x.shape[0], m.shape[1])
        report = Report()
        with device_scope(x), threads(x), np.errstate(all="ignore"):
            pass_ = _Pass(self, x.device, report)
            pass_.product("forward", x, m, y, bias)
            pass_.settle()
        self.last_report = report
        return y

    def run_backward(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     weight_in_out: bool, need_input: bool, need_weight: bool,
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
        with device_scope(dy), threads(dy), np.errstate(all="ignore"):
            pass_ = _Pass(self, dy.device, report)
            if need_input and left:
                pass_.product("d_input", m, dy.t(), dx.t(), constant=weight,
                              present=np.transpose)
            elif need_input:
                pass_.product("d_input", dy, m.t(), dx)
            if need_weight:
                pass_.product("d_weight", *((x.t(), dy) if weight_in_out else (dy.t(), x)), dw)
            if need_bias:
                ones = self._ones_for(dy)
                pass_.product("d_bias", ones, dy, db.view(1, n_out), constant=ones)
            pass_.settle()
        self.last_report.extend(report)
        return dx, dw, db

    # ------------------------------------------------------------------ helpers

    def _workspace_for(self, device: torch.device) -> Workspace:
        ws = self._workspaces.get(device)
        if ws is None:
            ws = self._workspaces[device] = Workspace()
        return ws

    def _ones_for(self, dy: torch.Tensor) -> torch.Tensor:
        """A row of ``dy.shape[0]`` ones (the constant ``a`` of ``d_bias``), kept per layout."""
        key = (dy.device, dy.dtype, dy.shape[0])
        ones = self._ones.get(key)
        if ones is None:
            ones = self._ones[key] = dy.new_ones(1, dy.shape[0])
        return ones

    def _fresh_encoding(self, plan: ProtectedMatmul, source: torch.Tensor, a: Any,
                        b: Any) -> None:
        """Remake ``plan``'s encoding of its constant ``a`` (a view of tensor ``source``)
        unless it was made from this very tensor as it is now (same object, memory, layout and
        version: a new tensor at a freed one's address, such as autocast's copy of the weight,
        is re-encoded)."""
        key = (source.data_ptr(), source._version, source.dtype, tuple(source.shape),
               source.stride())
        made = self._encoded.get(id(plan))
        if made is None or made[0]() is not source or made[1] != key:
            plan.reset_constant(a, b)
            self._encoded[id(plan)] = (weakref.ref(source), key)


class _Pass:
    """The products of one forward or backward call, settled together at its end."""

    def __init__(self, core: ProtectedLinearCore, device: torch.device, report: Report):
        self.core, self.report = core, report
        self.ws = core._workspace_for(device)
        self.plans: list[ProtectedMatmul] = []
        self.constants: list[ProtectedMatmul] = []

    def product(self, site: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                bias: torch.Tensor | None = None, *, constant: torch.Tensor | None = None,
                present: Callable[[Any], Any] | None = None) -> None:
        """Execute ``out = a @ b (+ bias)`` as ``site`` (2-D tensors, ``out`` C-contiguous):
        PyTorch's own GEMM (on its threads, as the unprotected layer), verified by a planned
        product; ``constant``: the tensor ``a`` views, whose encoding the plan keeps;
        ``present``: how the fault hook sees ``out``."""
        core = self.core
        hook = core.fault_hook
        if hook is not None and present is not None:
            hook = _presenting(hook, present)
        gemm = (lambda: torch.mm(a, b, out=out)) if bias is None else \
            (lambda: torch.addmm(bias, a, b, out=out))
        arrays = [array(t) for t in (a, b, out)]
        if core.check == "off":
            gemm()
            if hook is not None:
                hook(site, arrays[2])
            return
        a_arr, b_arr, out_arr = arrays
        bias_arr = None if bias is None else array(bias)
        plan = self.ws.product(site, a_arr, b_arr, bias_arr, core.check,
                               constant_a=constant is not None)
        if constant is not None:
            core._fresh_encoding(plan, constant, a_arr, b_arr)
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
                    self.core._encoded.pop(id(plan), None)
        for report in reports:
            self.report.extend(report)


def _presenting(hook: FaultHook, present: Callable[[Any], Any]) -> FaultHook:
    return lambda site, c: hook(site, present(c))


def _matrix(weight: torch.Tensor, weight_in_out: bool) -> torch.Tensor:
    """``M`` of ``y = x M``: the weight, or its transpose (a view)."""
    return weight if weight_in_out else weight.t()


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
