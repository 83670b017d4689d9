"""Eager autograd for ``gemmtune.linear`` and ``gemmtune.matmul``: ``torch.autograd.Function``s
whose forward and backward serve their GEMMs directly, the backward's through ``mm`` again (so a
double backward is differentiable too). A ``torch.library`` custom op (``torch_ops``) costs its
dispatch in host time on every call, which a training step pays on every GEMM, forward and
backward; torch.compile traces the custom ops instead, which it keeps whole.

An activation is not fused when a gradient is needed: it runs as torch's own op after the GEMM,
whose backward reads the pre-activation autograd saved. Fused, the backward would have to
recompute the pre-activation (one more GEMM) and take the activation's derivative in several
elementwise passes: on an H100 a ViT-B/16 train step (batch 64) ran 2x slower that way than in
torch (docs/python.md, training).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gemmtune import activation as activations
from gemmtune.serving import calls


class GemmtuneLinear(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return calls.linear_forward(x, weight, bias, "none")

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, bias = ctx.saved_tensors
        # as (M, K) and (M, N), M counted: reshape(-1, 0) cannot infer it where K or N is 0
        (n, k), rows = weight.shape, x.shape[:-1].numel()
        x2, g2 = x.reshape(rows, k), grad.reshape(rows, n)
        dx = mm(g2, weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        dweight = mm(g2.t(), x2) if ctx.needs_input_grad[1] else None
        dbias = g2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias


class GemmtuneMm(torch.autograd.Function):
    @staticmethod
    def forward(a: Tensor, b: Tensor) -> Tensor:
        return calls.matmul_forward(a, b)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors
        da = mm(grad, b.t()) if ctx.needs_input_grad[0] else None
        db = mm(a.t(), grad) if ctx.needs_input_grad[1] else None
        return da, db


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(x @ weight.T + bias)`` on checked operands, differentiable."""
    return activations.apply(GemmtuneLinear.apply(x, weight, bias), act, inplace=False)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for 2-D operands, differentiable where one needs a gradient (a backward's GEMM
    while a double backward is being recorded); checked as ``torch.ops.gemmtune.mm`` checks."""
    calls.check_mm(a, b)
    if needs_grad(a, b):
        return GemmtuneMm.apply(a, b)
    return calls.matmul_forward(a, b)


_grad_enabled = torch.is_grad_enabled  # looked up once: every call asks it


def needs_grad(a: Tensor, b: Tensor, bias: Tensor | None = None) -> bool:
    """Whether autograd records a call on these operands."""
    if not _grad_enabled():  # inference under no_grad: one call, no attribute reads
        return False
    return a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)
