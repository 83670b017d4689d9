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
    """``grad * act'(z)``: the gradient through the activation at its input ``z``, computed in
    fp32 at least and returned in ``grad``'s dtype. Plain torch ops, so torch.compile traces it."""
    if name == "none":
        return grad
    wide = torch.promote_types(z.dtype, torch.float32)
    zf, g = z.to(wide), grad.to(wide)
    if name == "relu":  # as torch's: a NaN input passes the gradient on (NaN <= 0 is false)
        d = (~(zf <= 0)).to(wide)
    elif name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(zf * 0.7071067811865476))
        d = cdf + zf * torch.exp(-0.5 * zf * zf) * 0.3989422804014327  # + z * pdf(z)
    elif name == "gelu_tanh":
        c, a = 0.7978845608028654, 0.044715  # sqrt(2 / pi)
        t = torch.tanh(c * (zf + a * zf ** 3))
        d = 0.5 * (1.0 + t) + 0.5 * zf * (1.0 - t * t) * c * (1.0 + 3.0 * a * zf * zf)
    elif name == "silu":
        s = torch.sigmoid(zf)
        d = s * (1.0 + zf * (1.0 - s))
    else:
        raise ValueError(f"activation {name!r} is not supported; accepted: none, relu, gelu, gelu_tanh, silu")
    return (g * d).to(grad.dtype)
