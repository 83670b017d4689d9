"""transformers' ``Conv1D`` (GPT-2's projections): a linear layer whose weight is stored (K, N),
transposed from ``nn.Linear``'s (N, K), and whose forward is ``addmm(bias, x, weight)``.

``optimize`` takes such a layer (found by its class name, ``Conv1D``, and its attributes: ``nf``
the out features, a 2-D ``weight`` (K, nf), a ``bias`` (nf,) or None; transformers is never
imported) where ``gemmtune.nn.refused`` finds nothing against it (a dtype gemmtune serves, no
meta weight, no parameter shared), once a call of its own forward on two fixed rows agrees with
``x @ weight + bias``. Its parameter objects
stay, and so do their shapes, values and state_dict keys, but the weight's storage becomes a
contiguous (N, K) buffer of which the parameter is the transposed view, so that ``weight.t()`` is
the (N, K) weight ``gemmtune.linear`` takes, contiguous, without a copy per call. The layer's
class becomes a subclass of its own (made once per class, so ``isinstance(layer, Conv1D)`` holds)
whose forward calls ``gemmtune.linear(x, weight.t(), bias)``, with the activation fused into it
where ``optimize`` fused one (gradients flow through ``gemmtune.linear`` to the parameter), and
runs the class's own forward (and that activation) where torch.compile traces it, as
``gemmtune.nn.Linear`` does. ``torch_class`` names the class it was.

A parameter whose ``.data`` is assigned later, or a model moved with ``.to(...)`` in a way that
does not keep the strides, still computes right: ``weight.t()`` is whatever the parameter holds,
and ``gemmtune.linear`` serves any strides (a non-contiguous weight at the cost of its layout).
The parameters are non-contiguous views: ``torch.save`` keeps them as they are; safetensors wants
contiguous tensors (``.contiguous()`` each first). ``load_state_dict`` copies into them in place.
"""

from __future__ import annotations

import torch
from torch import nn

from gemmtune import activation as activations
from gemmtune import api
from gemmtune.nn import keep

CLASS_NAME = "Conv1D"
TOLERANCE = 2e-2  # of the largest output: the agreement asked of the layer's own forward (TF32, half types)

_is_compiling, _capturing = keep.is_compiling, keep.capturing


class TransposedLinear(keep.TakenOver, nn.Module):
    """The forward of a Conv1D taken over by ``optimize``: the first base of the subclass made for
    each Conv1D class (``subclass``), so that its forward is this one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_compiling() or self.torch_when_capturing is not None and self.torch_when_capturing == _capturing():
            return self.torch_forward(x)
        return api.linear(x, self.weight.t(), self.bias, None if self.activation == "none" else self.activation)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        return activations.apply(self.torch_class.forward(self, x), self.activation, inplace=False)

    def extra_repr(self) -> str:
        own = super().extra_repr()
        return own if self.activation == "none" else ", ".join(filter(None, (own, f"activation={self.activation}")))

    def __reduce_ex__(self, protocol):
        """Pickled as an instance of its class's subclass, made anew where unpickled."""
        return _new, (self.torch_class,), self.__getstate__()


_subclasses: dict[type, type] = {}


def subclass(cls: type) -> type:
    """The subclass of ``cls`` (a Conv1D class) whose forward is ``TransposedLinear``'s; one per class."""
    if cls not in _subclasses:
        _subclasses[cls] = type(f"Gemmtune{cls.__name__}", (TransposedLinear, cls),
                                {"torch_class": cls, "__module__": __name__})
    return _subclasses[cls]


def _new(cls: type) -> nn.Module:
    return TransposedLinear.__new__(subclass(cls))


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is shaped as a Conv1D (its class's name and attributes; see the module's
    docstring). ``optimize`` takes it where ``gemmtune.nn.refused`` finds nothing against it and
    ``computes_linear`` holds."""
    if type(module).__name__ != CLASS_NAME or isinstance(module, TransposedLinear):
        return False
    w, b, nf = getattr(module, "weight", None), getattr(module, "bias", None), getattr(module, "nf", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 2 or nf != w.shape[1] or min(w.shape) == 0:
        return False
    if b is not None and (not isinstance(b, nn.Parameter) or b.shape != (nf,) or b.dtype != w.dtype
                          or b.device != w.device):
        return False
    if getattr(module, "nx", w.shape[0]) != w.shape[0] or set(module._parameters) - {"weight", "bias"}:
        return False
    return True


def computes_linear(module: nn.Module) -> bool:
    """Whether the module's own forward computes ``x @ weight + bias`` (in float32, on its device)
    on two fixed rows (its hooks not called, the caller's random state left alone)."""
    w, b = module.weight, module.bias
    x = torch.randn(2, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    try:
        with torch.no_grad():
            got = type(module).forward(module, x)
            expected = x.float() @ w.float() + (0.0 if b is None else b.float())
    except Exception:  # noqa: BLE001 - whatever fails, the layer is left alone
        return False
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return False
    error = (got.float() - expected).abs().max().item()
    return error <= TOLERANCE * (expected.abs().max().item() + 1e-6)


def take_over(layer: nn.Module) -> None:
    """Store ``layer``'s weight as the transposed view of a contiguous (N, K) buffer (its shape and
    values unchanged) and make its class the subclass that serves it through gemmtune."""
    w = layer.weight
    if not w.t().is_contiguous():
        with torch.no_grad():
            w.data = w.t().contiguous().t()
    layer.__class__ = subclass(type(layer))
