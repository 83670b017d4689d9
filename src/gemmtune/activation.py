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


def backward(z: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    """``grad * act'(z)``: the gradient through the activation at its input ``z``, by torch's own
    backward kernels (one pass each, computing in fp32 for 16-bit inputs, as torch's autograd of
    the unfused activation does), returned in ``grad``'s dtype. Plain aten ops, so torch.compile
    traces them."""
    if name == "none":
        return grad
    g = grad.to(z.dtype)
    if name == "relu":  # as torch's: a NaN input passes the gradient on (NaN <= 0 is false)
        d = torch.ops.aten.threshold_backward(g, z, 0)
    elif name == "gelu":
        d = torch.ops.aten.gelu_backward(g, z)
    elif name == "gelu_tanh":
        d = torch.ops.aten.gelu_backward(g, z, approximate="tanh")
    elif name == "silu":
        d = torch.ops.aten.silu_backward(g, z)
    else:
        raise ValueError(f"activation {name!r} is not supported; accepted: none, relu, gelu, gelu_tanh, silu")
    return d.to(grad.dtype)
