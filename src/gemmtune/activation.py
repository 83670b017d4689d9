"""The activations of ``Problem.activation`` in torch: the cuBLAS candidates' epilogue and the
reference the fused Triton epilogues are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply(x: torch.Tensor, name: str, *, inplace: bool = True) -> torch.Tensor:
    """``x`` through the activation ``name``; in place where torch allows, unless ``inplace``
    is False (autograd needs the input of silu's backward)."""
    if name == "none":
        return x
    if name == "relu":
        return x.relu_() if inplace else x.relu()
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu(x, inplace=inplace)
    raise ValueError(f"activation {name!r} is not supported; accepted: none, relu, gelu, gelu_tanh, silu")
