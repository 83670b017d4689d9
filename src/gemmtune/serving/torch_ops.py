"""gemmtune as torch operators: ``torch.ops.gemmtune.mm`` and ``torch.ops.gemmtune.linear``.

They are ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` keeps them whole
(their fake implementations give the output's shape without running anything) and autograd
differentiates them: the backward GEMMs go through the same ops, so they are tuned too. On
tensors gemmtune does not serve (CPU, float64, ...) they compute with torch, as
``gemmtune.linear`` and ``gemmtune.matmul`` document.

The ops check their operands as the public functions do (``calls.check_linear``,
``calls.check_mm``), their fake implementations too, so a malformed call raises the same error
naming the argument whether it runs, is traced or is compiled. ``import gemmtune`` imports this
module, which registers the ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gemmtune import activation as activations
from gemmtune.serving import calls


@torch.library.custom_op("gemmtune::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """``act(x @ weight.T + bias)``; x (..., K), weight (N, K), bias (N,) or None."""
    calls.check_linear(x, weight, bias, activation)
    return calls.linear_forward(x, weight, bias, activation)


@linear.register_fake
def _linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    calls.check_linear(x, weight, bias, activation)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.activation = activation


def _linear_backward(ctx, grad: Tensor):
    x, weight, bias = ctx.saved_tensors
    # as (M, K) and (M, N), M counted: reshape(-1, 0) cannot infer it where K or N is 0
    (n, k), rows = weight.shape, x.shape[:-1].numel()
    x2, g2 = x.reshape(rows, k), grad.reshape(rows, n)
    if ctx.activation != "none":  # the pre-activation is recomputed: one GEMM instead of a saved (M, N)
        g2 = activations.backward(linear(x2, weight, bias, "none"), g2, ctx.activation)
    dx = mm(g2, weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
    dweight = mm(g2.t(), x2) if ctx.needs_input_grad[1] else None
    dbias = g2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
    return dx, dweight, dbias, None


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


@torch.library.custom_op("gemmtune::mm", mutates_args=())
def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for a (M, K) and b (K, N)."""
    calls.check_mm(a, b)
    return calls.matmul_forward(a, b)


@mm.register_fake
def _mm_fake(a: Tensor, b: Tensor) -> Tensor:
    calls.check_mm(a, b)
    return a.new_empty((a.shape[0], b.shape[1]))


def _mm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _mm_backward(ctx, grad: Tensor):
    a, b = ctx.saved_tensors
    da = mm(grad, b.t()) if ctx.needs_input_grad[0] else None
    db = mm(a.t(), grad) if ctx.needs_input_grad[1] else None
    return da, db


mm.register_autograd(_mm_backward, setup_context=_mm_setup)
