"""``ScaledLinear``: a linear layer whose weight its owner has already quantized to fp8, served by
``gemmtune.scaled_mm``. gemmtune invents no quantization recipe: the weight and its scales are
taken as given, and each call's input is quantized as serving stacks do it, matching the
weight's scaling (``gemmtune.scaling.quantize``: per tensor, per token, or per 1 x 128 block,
each scale the amax of what it scales), or with a fixed per-tensor ``input_scale`` where one is
given (static activation scaling)."""

from __future__ import annotations

import torch
from torch import nn

from gemmtune import api, scaling
from gemmtune.problem import SCALE_BLOCK

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class ScaledLinear(nn.Module):
    """``act(x @ dequantized(weight).T + bias)`` for x (..., K) in a 16- or 32-bit float dtype.

    ``weight`` (N, K) in float8_e4m3fn or float8_e5m2; ``weight_scale`` float32, its layout says
    the scaling: one element (per tensor), N elements ((N,) or (N, 1): per output channel, the
    input then per token), or (ceil(N/128), ceil(K/128)) (per 128 x 128 block, the input per
    1 x 128 block). ``bias`` (N,) in ``out_dtype``, the output's dtype. Inference only."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                 input_scale: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 activation: str | None = None) -> None:
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.dtype not in FP8 or weight.dim() != 2:
            raise TypeError(f"ScaledLinear: weight must be a 2-D (N, K) tensor in {', '.join(map(str, FP8))}, "
                            f"got {_described(weight)}")
        self.scaling = scaling_of(weight, weight_scale)
        if input_scale is not None and (self.scaling != "tensor" or input_scale.numel() != 1):
            raise ValueError("ScaledLinear: input_scale (a fixed per-tensor scale of the input) goes with a per-tensor "
                             f"weight_scale only; this weight is scaled per {self.scaling}")
        self.register_buffer("weight", weight)
        # kept in the orientation gemmtune.scaled_mm (as torch._scaled_mm) takes for weight.t()
        self.register_buffer("weight_scale", _as_taken(weight_scale.float(), self.scaling))
        self.register_buffer("bias", bias)
        self.register_buffer("input_scale", input_scale)
        self.out_dtype, self.activation = out_dtype, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.input_scale is not None:
            largest = scaling.FP8_MAX[self.weight.dtype]
            xq = (rows.float() / self.input_scale).clamp_(-largest, largest).to(self.weight.dtype)
            sx = self.input_scale.reshape(())
        else:
            xq, sx = scaling.quantize(rows, self.weight.dtype, self.scaling, weight=False)
        out = api.scaled_mm(xq, self.weight.t(), sx, self.weight_scale, bias=self.bias, out_dtype=self.out_dtype,
                            activation=self.activation)
        return out.reshape(*x.shape[:-1], self.weight.shape[0])

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"in_features={k}, out_features={n}, dtype={self.weight.dtype}, scaling={self.scaling}" + \
            ("" if self.activation is None else f", activation={self.activation}")


def scaling_of(weight: torch.Tensor, scale: torch.Tensor) -> str:
    """The scaling a weight's scales' layout says (see ``ScaledLinear``)."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise TypeError(f"ScaledLinear: weight_scale must be a float tensor, got {_described(scale)}")
    n, k = weight.shape
    blocks = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK))
    if scale.numel() == 1:
        return "tensor"
    if tuple(scale.shape) in ((n,), (n, 1)):
        return "row"
    if tuple(scale.shape) == blocks:
        return "block"
    raise ValueError(f"ScaledLinear: weight_scale {tuple(scale.shape)} is no scaling of a ({n}, {k}) weight; accepted: "
                     f"one element (per tensor), ({n},) or ({n}, 1) (per output channel), {blocks} "
                     "(per 128 x 128 block)")


def _as_taken(scale: torch.Tensor, how: str) -> torch.Tensor:
    """A weight's scales as ``scaled_mm`` takes them for b = weight.t(): (1, N) per row, the
    (K/128, N/128) transpose per block."""
    if how == "tensor":
        return scale.reshape(())
    return scale.reshape(1, -1) if how == "row" else scale.t()


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return type(value).__name__
