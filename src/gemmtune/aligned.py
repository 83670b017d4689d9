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

Where K is odd this pays from MIN_ROWS_K_ODD rows: on the H200 at 16 rows 0.97-1.03x of the layer
with its weight as given at 132 SMs and 1.92-1.95x at 38 (where that layer copied the weight every
call), at 2048 rows 1.14-1.15x and 1.07x (``aligned-layers-h200-20261123b.json`` and ``c``, each
also at ``-sm38-``). A single row runs as a plain layer on the parameter as it is: at 132 SMs the
copy of x cost a launch (the padded GEMM 0.87x, the plain layer 0.98x); at 38 SMs the padded GEMM
would have been 1.19x and the plain layer reads 0.86x (noted in benchmarks/NOTES.md, step 21).
Where only N is odd the layer's weight needs no copy as given, and the padded GEMM pays from
MIN_ROWS rows (1.01-1.26x at 2048 rows but 0.98x for a GPT-2 head at 38 SMs; 0.87-0.96x on 1-16
rows at 132 SMs, where the cut of the result costs a launch).

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

MIN_ROWS_K_ODD = 2  # rows of the input from which a call goes through the padded GEMM, K odd
MIN_ROWS = 65  # and with K aligned (only N odd): past the decode GEMMs' 64
DEVICE_TYPES = ("cuda",)  # where padding pays: cuBLAS's fast path
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def misaligned(layer: nn.Linear) -> bool:
    """Whether ``layer``'s GEMM leaves cuBLAS's fast path, and padding its weight can bring it back."""
    w = layer.weight
    if w.device.type not in DEVICE_TYPES or w.dtype not in DTYPES or w.dim() != 2 or min(w.shape) == 0:
        return False
    step = 16 // w.element_size()
    return any(size % step for size in w.shape)


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
        self._k_odd = k_padded != self.k

    def output(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
        """``layer``'s output on ``x`` through the padded GEMM, or None where the layer must run
        as a plain one (see the module's docstring)."""
        least = MIN_ROWS_K_ODD if self._k_odd else MIN_ROWS
        if x.dim() == 0 or x.shape[-1] != self.k or x.numel() < least * self.k:
            return None  # few rows; or a wrong shape, which the plain layer's error names
        if torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad
                                        or layer.bias is not None and layer.bias.requires_grad):
            return None
        compiling = torch.compiler.is_compiling()
        if not self._held(layer) or not compiling and not self._in_place(layer):
            return None
        return self.padded(layer, x)

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
        act = None if layer.activation == "none" else layer.activation
        out = api.linear(rows, self.weight, self.bias, act)
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
