"""Protected projections of Hugging Face transformers models (:func:`protect_projections`).

In each transformer layer (a module of a ``ModuleList``, such as ``transformer.h.0`` or
``bert.encoder.layer.0``), the ``nn.Linear`` and GPT-2 ``Conv1D`` modules inside the layer's child
that holds the attention module are its attention projections (BERT/RoBERTa: ``query``, ``key``,
``value`` and ``output.dense``; GPT-2: ``c_attn`` and ``c_proj``; GPT-Neo: ``q_proj``, ``k_proj``,
``v_proj``, ``out_proj``; Falcon's ``FalconLinear`` modules too); the layer's other ones are its
feed-forward layers (BERT/RoBERTa: ``intermediate.dense`` and ``output.dense``; GPT-2 and
GPT-Neo: ``mlp.c_fc`` and ``mlp.c_proj``), as are, with ``mlp``, the linear layers of the
``ModuleList``'s items that hold no attention module (a hybrid model's other layers).

A protected projection has its class swapped for :class:`ProtectedLinear`,
:class:`ProtectedConv1D` or (Falcon's ``FalconLinear``) :class:`ProtectedFalconLinear` (a
subclass whose forward runs the checked products of
:class:`attention.torch_linear.ProtectedLinearCore`, kept in its attribute ``abft_linear``): the
module, its Parameters, ``state_dict`` keys and ``save_pretrained`` files stay the same.
"""
from __future__ import annotations

import types
from typing import Iterator

import torch
from torch import nn
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.pytorch_utils import Conv1D

from attention.torch_linear import ProtectedLinearCore

__all__ = ["ProtectedLinear", "ProtectedConv1D", "ProtectedFalconLinear", "protect_projections",
           "projection_cores", "check_swappable", "swap_class", "unprotected_weights"]


class ProtectedLinear(nn.Linear):
    """``nn.Linear`` on checked products (``y = x W^T + b`` and its gradients)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.abft_linear(x, self.weight, self.bias, weight_in_out=False)


class ProtectedConv1D(Conv1D):
    """GPT-2's ``Conv1D`` (weight stored ``(in, out)``) on checked products (``y = x W + b``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.abft_linear(x, self.weight, self.bias, weight_in_out=True)


class ProtectedFalconLinear(ProtectedLinear, FalconLinear):
    """Falcon's ``FalconLinear`` (``x W^T``, then ``+ b``: ``nn.Linear``'s product, its bias
    added after the product's rounding) on checked products (the bias inside the protection)."""


_PROTECTED = {nn.Linear: ProtectedLinear, Conv1D: ProtectedConv1D,
              FalconLinear: ProtectedFalconLinear}
#: The module classes that are protected (exactly these: not other subclasses), or already are.
_KINDS = (*_PROTECTED, *_PROTECTED.values())


def protect_projections(model: nn.Module, attention: list[str], *, check: str = "correct",
                        mlp: bool = False) -> list[str]:
    """Swap the projections of the layers holding the attention modules named in ``attention``
    (and with ``mlp``, their feed-forward layers) for protected ones, in place.

    Parameters
    ----------
    model : torch.nn.Module
    attention : list of str
        Module names of the attention modules (those that compute the attention product).
    check : {"correct", "detect", "off"}
    mlp : bool
        Also protect the feed-forward layers.

    Returns
    -------
    list of str
        The names of the protected modules.

    Raises
    ------
    ValueError
        When an attention module is in no layer of a ``ModuleList`` (nothing is changed).
    """
    chosen = check_projections(model, attention, mlp)
    cores = [ProtectedLinearCore(check) for _ in chosen]  # validates check before any swap
    for (_, module), core in zip(chosen, cores):
        swap_class(module, _PROTECTED.get(type(module), type(module)))
        module.abft_linear = core
    return [name for name, _ in chosen]


def check_projections(model: nn.Module, attention: list[str],
                      mlp: bool) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the projections :func:`protect_projections` would swap, checked
    (``ValueError`` as it raises; nothing is changed)."""
    chosen = list(_projections(model, attention, mlp))
    for name, module in chosen:
        check_swappable(name, module)
    return chosen


def check_swappable(name: str, module: nn.Module) -> None:
    """Raise ``ValueError`` when swapping ``module``'s class would not change what it runs: a
    ``forward`` set on the module itself, other than an accelerate hook's (which
    :func:`swap_class` rebinds)."""
    if "forward" in vars(module) and "_old_forward" not in vars(module):
        raise ValueError(f"protect: {name or type(module).__name__} has a forward set on the "
                         "module itself, which would keep running unprotected")


def swap_class(module: nn.Module, cls: type) -> None:
    """``module.__class__ = cls``, and an accelerate hook's saved forward (``_old_forward``,
    which the hook's wrapper calls: ``device_map`` offloading, ``cpu_offload``) rebound to
    ``cls.forward``, so the hooked module runs the protected forward."""
    module.__class__ = cls
    if "_old_forward" in vars(module):
        module._old_forward = types.MethodType(cls.forward, module)


def unprotected_weights(model: nn.Module, attention: list[str], mlp: bool) -> list[str]:
    """Names of the modules in the scope :func:`protect_projections` covers (:func:`_scopes`)
    that hold a weight of their own (a parameter of two or more dimensions; not an embedding's
    table) and are not protected projections: weights whose products run unprotected (JetMoE's
    attention experts, the experts and routers of mixture-of-experts feed-forward layers), in the
    order of ``model.named_modules()``."""
    scopes = _scopes(model, attention, mlp)
    return [name for name, m in model.named_modules()
            if any(name.startswith(scope + ".") for scope in scopes)
            and type(m) not in _KINDS and not isinstance(m, nn.Embedding)
            and any(p.dim() >= 2 for p in m.parameters(recurse=False))]


def projection_cores(model: nn.Module) -> dict[str, ProtectedLinearCore]:
    """The :class:`ProtectedLinearCore` of every protected projection, by module name."""
    return {name: m.abft_linear for name, m in model.named_modules()
            if isinstance(m.__dict__.get("abft_linear"), ProtectedLinearCore)}


def _projections(model: nn.Module, attention: list[str],
                 mlp: bool) -> Iterator[tuple[str, nn.Module]]:
    scopes = _scopes(model, attention, mlp)
    for name, m in model.named_modules():
        if type(m) in _KINDS and any(name.startswith(scope + ".") for scope in scopes):
            yield name, m


def _scopes(model: nn.Module, attention: list[str], mlp: bool) -> list[str]:
    """The names of the modules whose linear layers :func:`protect_projections` protects: the
    attention block of each attention module named in ``attention``; with ``mlp``, each one's
    whole layer, and the other items of the ``ModuleList`` holding it (a hybrid model's layers
    without attention: LFM2's convolution layers, Qwen3-Next's linear attention, Jamba's Mamba
    layers, with feed-forward layers of their own)."""
    modules = dict(model.named_modules())
    scopes = [_layer_of(modules, name)[0 if mlp else 1] for name in attention]
    if mlp:
        for layer in list(scopes):
            stack = layer.rsplit(".", 1)[0]
            scopes += [f"{stack}.{key}" for key, _ in modules[stack].named_children()]
    return list(dict.fromkeys(scopes))


def _layer_of(modules: dict[str, nn.Module], name: str) -> tuple[str, str]:
    """``(layer, block)``: the names of the ``ModuleList`` item holding module ``name`` that holds
    the layer's feed-forward layers, and of the child of the innermost such item holding it (the
    attention block). The layer is the innermost item holding a projection outside the block:
    T5's blocks keep their sublayers (attention, feed-forward) in a ``ModuleList`` of their own,
    whose attention item holds no feed-forward layer."""
    parts = name.split(".")
    items = [".".join(parts[:i + 1]) for i in range(len(parts) - 1, 0, -1)
             if isinstance(modules[".".join(parts[:i])], nn.ModuleList)]
    if not items:
        raise ValueError(f"protect: the attention module {name!r} is in no layer of a "
                         "ModuleList, so its projections cannot be found")
    block = ".".join(parts[:items[0].count(".") + 2])
    layer = next((item for item in items
                  if any(type(m) in _KINDS and not sub.startswith(block + ".")
                         for sub, m in modules[item].named_modules(prefix=item))), items[0])
    return layer, block
