"""Misaligned layers: linear layers whose weight rows (K) or output rows (N) are not whole
multiples of 16 bytes, as cuBLAS's fast path needs (K or N not a multiple of 8 in 16-bit types).

Such a GEMM pays copies on every call: ``cublas_padded`` copies x and the weight into zero-padded
buffers and cuts the result out of the padded product. Neither half can be skipped by re-striding
alone: on the H200, cuBLAS on rows re-strided to 16-byte multiples but with K left odd ran as
slowly as on the raw operands, and so did one writing an odd N into a padded output
(``padded-paths-h200-20261123.json``). But a layer's weight is a parameter, so its copy can be
made once: ``optimize`` stores the weight (and bias) zero-padded to aligned sizes, and the
parameters become views of those buffers. Only the padding is added, and an in-place update of a
parameter writes the buffer, so the padded weight is never stale. A call then copies only x into
K's padding, runs the aligned GEMM (tuned like any other), and cuts N's padding off the result.

Whether that pays depends on the rows and the GPU. On the H200, against the layer with its weight
copied every call (``aligned-layers-h200-20261123c.json``, ``-sm38-``): with K or N odd 1.14-1.26x
at 2048 rows; with K odd 1.92x at 16 rows at 38 SMs but 0.97x at 132; at one row with K odd the
padded GEMM is 0.87x at 132 SMs (the copy of x costs a launch) and 1.19x at 38, where the plain
layer on the padded parameter reads 0.86x. No rule fits both GPUs, so the first call of each row
count measures the two ways, the padded GEMM and the plain layer on the parameter as it is (its
rows now 16-byte aligned), and keeps the faster; the plain layer stays unless the padded GEMM beats
it beyond the noise. So chosen, every row of those layers was within 1% of the faster way at 132
and 38 SMs (``aligned-layers-h200-20261123d.json`` and ``e``). A way's cost is the longer of its GPU
time and the host's own time per call, since a call queued behind others waits for both: the
padded way's copies and separate steps cost the host more, which a model whose host paces its
eager forward pays (MLP-Mixer's token mixing, K = 196 on a transposed x: 78-131 us of host time
a call against the plain layer's 36, for about 68 us on the GPU either way,
``eager-layers-h200-mixer_b16_224-rows-20261129.json``). ``GEMMTUNE_MODE=lookup`` measures
too, the two ways as the store serves them (a miss by cuBLAS). Where nothing can be measured (under
torch.compile, inside CUDA graph capture) a rule serves, without being kept: the padded GEMM from
MIN_ROWS_K_ODD rows with K odd, from MIN_ROWS rows with only N odd. While gemmtune records
(``gemmtune.record``, optimize's example run) the rule's way serves and the other runs too, so
that both GEMMs are recorded and tuned.

A call also runs as a plain layer where gradients are wanted (the padded buffer is not what autograd
tracks), and where the layer no longer holds the parameters padded, of the buffer's dtype and
device, viewing the buffer (``load_state_dict(..., assign=True)``, ``model.to(...)``, ``.data``
assigned). Under torch.compile the last of these is not seen for a tensor of the same dtype and
device, as with sibling layers. The parameters are views with padded rows: ``torch.save`` keeps
them as they are; safetensors wants contiguous tensors (``.contiguous()`` each first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemmtune import api
from gemmtune.backends.cublas_padded import copy_padded
from gemmtune.device import current
from gemmtune.problem import torch_dtypes
from gemmtune.serving import recording
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.tuning import measure

MIN_ROWS_K_ODD = 2  # rows from which a call takes the padded GEMM with K odd, where none is measured
MIN_ROWS = 65  # and with K aligned (only N odd): past the decode GEMMs' 64
DEVICE_TYPES = ("cuda",)  # where padding pays: cuBLAS's fast path
DTYPES = tuple(torch_dtypes().values())


def misaligned(layer: nn.Linear) -> bool:
    """Whether ``layer``'s GEMM leaves cuBLAS's fast path, and padding its weight can bring it back."""
    w = layer.weight
    if w.device.type not in DEVICE_TYPES or w.dtype not in DTYPES or w.dim() != 2 or min(w.shape) == 0:
        return False
    step = 16 // w.element_size()
    return any(size % step for size in w.shape)


def _epilogue(layer: nn.Linear) -> str | None:
    return None if layer.activation == "none" else layer.activation


class Aligned:
    """A layer's weight and bias stored zero-padded; the layer holds it as ``layer.aligned``
    (``gemmtune.nn.AlignedLinear``)."""

    def __init__(self, layer: nn.Linear) -> None:
        w, b = layer.weight, layer.bias
        step = 16 // w.element_size()
        self.n, self.k = w.shape
        n_padded, k_padded = (-(-size // step) * step for size in w.shape)
        with torch.no_grad():
            self.weight = w.new_zeros(n_padded, k_padded)
            self.weight[:self.n, :self.k] = w
            layer.weight.data = self.weight[:self.n, :self.k]
            self.bias = None
            if b is not None:
                self.bias = b.new_zeros(n_padded)
                self.bias[:self.n] = b
                layer.bias.data = self.bias[:self.n]
        self._params = (layer.weight, layer.bias)  # the objects padded
        self.padded_for: dict[int, bool] = {}  # rows -> whether the padded GEMM measured faster

    def output(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
        """``layer``'s output on ``x`` through the padded GEMM, or None where the layer must run
        as a plain one (see the module's docstring)."""
        if x.dim() == 0 or x.shape[-1] != self.k:
            return None  # the plain layer's error names what is wrong
        rows = x.numel() // self.k
        padded = self.padded_for.get(rows)
        if padded is False:
            return None  # the plain layer, measured faster: the checks below concern the buffers alone
        if torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad
                                        or layer.bias is not None and layer.bias.requires_grad):
            return None
        compiling = torch.compiler.is_compiling()
        if not self._held(layer) or not compiling and not self._in_place(layer):
            return None
        if padded is None:
            padded = self._choose(layer, x, rows, compiling)
        return self.padded(layer, x) if padded else None

    def _choose(self, layer: nn.Linear, x: torch.Tensor, rows: int, compiling: bool) -> bool:
        """Whether calls of ``rows`` rows take the padded GEMM: measured and kept where it can be
        (see the module's docstring), else the rule."""
        k_odd = self.weight.shape[1] != self.k
        rule = rows >= (MIN_ROWS_K_ODD if k_odd else MIN_ROWS)
        if compiling:  # before the checks below, which dynamo does not trace
            return rule
        if x.device.type not in DEVICE_TYPES or x.is_cuda and torch.cuda.is_current_stream_capturing():
            return rule
        ways = {"plain": lambda: api.linear(x, layer.weight, layer.bias, _epilogue(layer)),
                "padded": lambda: self.padded(layer, x)}
        if recording.active() is not None or DISPATCHER.is_deferring():
            ways["padded" if not rule else "plain"]()  # recorded too: a tuning of the recording covers both
            return rule
        for way in ways.values():
            way()  # the first call of each tunes its GEMM (in lookup mode: the store's kernel, or cuBLAS)
        self.padded_for[rows] = measure.beats(ways, "padded", current())
        return self.padded_for[rows]

    def padded(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``layer``'s output on ``x`` (..., K) through the padded GEMM, unconditionally."""
        rows = x.reshape(-1, self.k)
        copies = x.is_cuda and not torch.compiler.is_compiling()  # gemmtune's copy kernels; torch's ops where traced
        k_padded = self.weight.shape[1]
        if k_padded != self.k:
            if copies and rows.stride(-1) == 1:
                rows = copy_padded(rows, rows.shape[0], k_padded)
            else:
                rows = F.pad(rows, (0, k_padded - self.k))
        out = api.linear(rows, self.weight, self.bias, _epilogue(layer))
        if out.shape[1] != self.n:
            out = copy_padded(out, out.shape[0], self.n) if copies else out[:, :self.n].contiguous()
        return out.reshape(*x.shape[:-1], self.n)

    def _held(self, layer: nn.Linear) -> bool:
        """Whether the layer still holds the parameters padded, of the buffer's dtype and device
        (checks torch.compile traces too)."""
        w = self.weight
        return (layer.weight is self._params[0] and layer.bias is self._params[1]
                and layer.weight.dtype == w.dtype and layer.weight.device == w.device)

    def _in_place(self, layer: nn.Linear) -> bool:
        """Whether the parameters still view the buffers where they were put."""
        if layer.weight.data_ptr() != self.weight.data_ptr() or layer.weight.stride() != self.weight.stride():
            return False
        return self.bias is None or (layer.bias.data_ptr() == self.bias.data_ptr()
                                     and layer.bias.dtype == self.bias.dtype)
