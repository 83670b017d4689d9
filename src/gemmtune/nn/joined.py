"""Sibling layers: linear layers that a model calls one after another on the same input, such as
a Llama's q, k and v projections or its gate and up projections. One GEMM over their weights
side by side serves them all: on the H200 at batch 1, q + k + v take 29.9 us as three GEMMs and
18.1 us as one, gate + up 65.7 and 60.1 us (docs/performance.md, the Llama).

``optimize(..., siblings=True)`` finds them in its example run (``watching``, then ``groups``)
and joins each group (``Siblings``): the layers' weights (and biases) become views of one fused
tensor, so no memory is added and a weight updated in place updates the fused one. The first
layer's call computes the fused GEMM and keeps it; each later layer called on the same input
returns its own columns of it (a view whose rows are the fused width apart), and the last one
lets it go. Any call that cannot be served so (gradients wanted, another input, an input
changed in place since, a weight that no longer views the fused tensor, an input or parameter
made under ``torch.inference_mode``, which keeps no count of its changes) runs the layer alone,
and so does every call on more than MAX_ROWS rows: joining pays where the GEMMs stream their
weights (decoding), while a prefill's GEMMs are compute-bound already and the joined output's
strided columns cost the operators after them (the Llama's prefill read 0.96x with them joined).

The joined group checks that its layers still hold the parameters it joined, of its dtype and
device (``load_state_dict(..., assign=True)`` and ``model.to(...)`` are seen, and the layers run
alone: optimize again to join them anew). Under torch.compile two things are not seen: an input
changed in place between two sibling calls of one compiled graph, and a parameter whose ``.data``
is assigned a tensor of the same dtype and device; a model that does either must not be optimized
with siblings. Outside torch.compile both are seen, and the layer runs alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from gemmtune import api

MAX_ROWS = 64  # rows of the input above which each layer runs alone (the decode GEMMs' M <= 64)


@contextlib.contextmanager
def watching(layer_type: type) -> Iterator[list]:
    """While the block runs, each call of a module of exactly ``layer_type`` (in order): the
    layer, and whether its input is the previous such call's, unchanged (for ``groups``). A
    global forward pre-hook for the block alone: the layers' own forward is not touched, and only
    the previous input is kept alive."""
    calls: list = []
    previous: list = [None, None]  # the previous call's input and its version

    def note(module: nn.Module, args: tuple) -> None:
        if type(module) is not layer_type or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]
        version = None if x.is_inference() else x._version  # an inference tensor keeps no counter
        calls.append((module, previous[0] is x and version is not None and previous[1] == version))
        previous[:] = [x, version]

    handle = nn.modules.module.register_module_forward_pre_hook(note)
    try:
        yield calls
    finally:
        handle.remove()


def groups(calls: list) -> list[tuple[nn.Module, ...]]:
    """The groups of two or more layers called one after another on the same input (the same
    tensor, unchanged in between) whose weights can be joined (``_joinable``), each group
    counted only where its layers were never called otherwise (alone, in another order, with
    other layers): in the order first called."""
    runs: list[list] = []
    for layer, same_input in calls:
        run = runs[-1] if runs else None
        if same_input and run and _joinable(run[0], layer) and all(layer is not other for other in run):
            run.append(layer)
        else:
            runs.append([layer])
    together = [tuple(run) for run in runs]
    shown: dict[nn.Module, set] = {}  # layer -> every group it was called in
    for group in together:
        for layer in group:
            shown.setdefault(layer, set()).add(group)
    return [group for group in dict.fromkeys(together)
            if len(group) > 1 and all(shown[layer] == {group} for layer in group)]


def _joinable(first: nn.Module, other: nn.Module) -> bool:
    w, v = first.weight, other.weight
    return (w.shape[1] == v.shape[1] and w.dtype == v.dtype and w.device == v.device
            and (first.bias is None) == (other.bias is None) and first.activation == other.activation)


class Siblings:
    """A joined group; each of its layers holds it as ``layer.siblings`` (``gemmtune.nn.JoinedLinear``)."""

    def __init__(self, layers: tuple[nn.Module, ...]) -> None:
        self.layers = layers
        self.activation = None if layers[0].activation == "none" else layers[0].activation
        with torch.no_grad():
            self.weight = torch.cat([layer.weight for layer in layers])
            self.bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
        self.columns: dict[nn.Module, tuple[int, int]] = {}
        self._params = {layer: (layer.weight, layer.bias) for layer in layers}  # the objects joined
        start = 0
        for layer in layers:
            stop = start + layer.out_features
            layer.weight.data = self.weight[start:stop]  # the parameter stays; its storage is the fused one
            if self.bias is not None:
                layer.bias.data = self.bias[start:stop]
            self.columns[layer] = (start, stop)
            layer.siblings = self
            start = stop
        self._pending: tuple | None = None  # (input, _versions, the joined output) between calls

    def output(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``layer``'s output on ``x`` taken from the group's GEMM, or None where the layer must
        run alone (see the module's docstring)."""
        if torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad) \
                or x.numel() > MAX_ROWS * x.shape[-1]:
            return None
        compiling = torch.compiler.is_compiling()
        if layer is self.layers[0]:
            self._pending = None
            versions = None if compiling else self._versions(x)
            if not self._joined() or not compiling and (versions is None or not self._in_place()):
                return None
            out = api.linear(x, self.weight, self.bias, self.activation)
            self._pending = (x, versions, out)
        else:
            pending = self._pending
            if pending is None or pending[0] is not x or (not compiling and pending[1] != self._versions(x)):
                return None
            out = pending[2]
            if layer is self.layers[-1]:
                self._pending = None
        start, stop = self.columns[layer]
        return out[..., start:stop]

    def _versions(self, x: torch.Tensor) -> tuple | None:
        """What an in-place change of the input or of a layer's weight or bias since the first
        layer's call would change (a parameter whose ``.data`` is a view keeps its own counter);
        None where one of them keeps no counter (an inference tensor, made under
        ``torch.inference_mode``), whose changes cannot be seen: such calls run alone."""
        try:
            return (x._version, *(layer.weight._version for layer in self.layers),
                    *(() if self.bias is None else (layer.bias._version for layer in self.layers)))
        except RuntimeError:
            return None

    def _joined(self) -> bool:
        """Whether every layer still holds the parameters that were joined, of the joined
        tensors' dtype and device (``load_state_dict(..., assign=True)`` puts new ones in their
        place, ``model.to(...)`` converts them): checks that torch.compile can trace too."""
        w = self.weight
        return all(layer.weight is weight and layer.bias is bias and weight.dtype == w.dtype
                   and weight.device == w.device for layer, (weight, bias) in self._params.items())

    def _in_place(self) -> bool:
        """Whether every layer's weight and bias still view the joined tensors where they were put
        (an assignment to ``.data`` gives them storage of their own)."""
        row = self.weight.stride(0) * self.weight.element_size()
        for layer, (start, _) in self.columns.items():
            if layer.weight.dtype != self.weight.dtype or layer.weight.data_ptr() != self.weight.data_ptr() + start * row:
                return False
            if self.bias is not None and (layer.bias.dtype != self.bias.dtype or layer.bias.data_ptr()
                                          != self.bias.data_ptr() + start * self.bias.element_size()):
                return False
        return True
