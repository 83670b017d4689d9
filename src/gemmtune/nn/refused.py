"""The layers ``optimize`` leaves untouched, and why: what gemmtune cannot take without risking a
wrong output or a slower call.

- A parameter held by another module too, or by the layer under two names (tied weights, an
  ``nn.Embedding`` sharing a head's weight): joining or padding stores a layer's parameters as
  views of a buffer of its own, and the other holder would then read or update another copy.
- A weight on the meta device: nothing to serve yet; optimize once the weights are loaded.
- A dtype gemmtune does not serve (fp8, float64, integers, a quantized layer's storage): every
  call would fall back to torch and pay gemmtune's host path for nothing.
- A weight that is not contiguous (an ``nn.Linear``'s; a Conv1D's is contiguous once transposed):
  gemmtune serves any strides, but a layout it was not tuned for costs a copy or a slower kernel
  on every call.
- A forward set on the module itself (accelerate's hooks for a model dispatched over devices, any
  wrapper put on the instance): calls go to it, not to the class's, so gemmtune's forward would
  never run, and an activation fused into the layer would be lost.

A model whose parameters all lie on the CPU while a CUDA GPU is present is left unchanged as a
whole (``on_the_cpu``): its calls would run torch's kernels, so optimize after ``model.cuda()``.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from gemmtune.problem import torch_dtypes


def holders(model: nn.Module) -> Counter:
    """id(parameter) -> how many (module, name) slots of ``model`` hold it."""
    return Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)


def reason(layer: nn.Module, held: Counter, *, restored: bool = False,
           weight: torch.Tensor | None = None) -> str | None:
    """Why ``layer`` (an ``nn.Linear``, or a Conv1D where ``restored``: its weight is stored anew
    when taken, so its layout does not matter) is left to torch, or None where gemmtune can take
    it; ``held``: ``holders`` of the model. ``weight``: the one its GEMM reads, where it is not
    ``layer.weight`` (an attention's input projection)."""
    if "forward" in vars(layer):
        return "a forward set on the module itself (a wrapper, such as accelerate's hooks)"
    weight = layer.weight if weight is None else weight
    own = [p for p in layer._parameters.values() if p is not None]
    if any(held[id(p)] > 1 for p in own):
        return "a parameter shared with another module"
    if weight.is_meta:
        return "weights on the meta device (optimize once they are loaded)"
    if weight.dtype not in torch_dtypes().values():
        return f"dtype {str(weight.dtype).removeprefix('torch.')}, which gemmtune does not serve"
    if not restored and not weight.is_contiguous():
        return "a weight that is not contiguous"
    return None


def on_the_cpu(model: nn.Module) -> bool:
    """Whether ``model`` has parameters, all of them on the CPU, while a CUDA GPU is present."""
    params = list(model.parameters())
    return bool(params) and all(p.device.type == "cpu" for p in params) and torch.cuda.is_available()


def summary(refusals: dict[str, str]) -> str:
    """One log line's text: how many layers were left to torch, each reason with its layers."""
    by_reason: dict[str, list[str]] = {}
    for name, why in refusals.items():
        by_reason.setdefault(why, []).append(name or "(the model itself)")
    parts = [f"{why}: {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
             for why, names in by_reason.items()]
    count = len(refusals)
    return f"gemmtune.optimize: {count} layer{'' if count == 1 else 's'} left to torch ({'; '.join(parts)})"
