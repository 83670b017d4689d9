"""Eager autograd of gemmtune.linear and gemmtune.matmul (``gemmtune.serving.autograd``):
gradients and second derivatives against finite differences, the activation run unfused as
torch's own op, and the backward's GEMMs served (recorded) by gemmtune. On the CPU the GEMMs
compute with torch; on the GPU the same tests run the tuned kernels."""

import pytest
import torch
import torch.nn.functional as F

import gemmtune
from gemmtune.serving import autograd, recording

ACTS = ["none", "relu", "gelu", "gelu_tanh", "silu"]


def leaves(*shapes, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("act", ACTS)
def test_linear_gradients_and_second_derivatives_are_exact(act):
    x, w, b = leaves((2, 3, 7), (5, 7), (5,))  # x with a batch dimension, as in a model
    assert torch.autograd.gradcheck(lambda x, w, b: autograd.linear(x, w, b, act), (x, w, b))
    if act != "relu":  # relu's second derivative is 0 almost everywhere, and gradgradcheck's steps cross its kink
        assert torch.autograd.gradgradcheck(lambda x, w, b: autograd.linear(x, w, b, act), (x, w, b))


@pytest.mark.parametrize("a_shape, b_shape, transpose", [((4, 7), (7, 3), False), ((7, 4), (3, 7), True),
                                                         ((1, 33), (33, 1), False)])
def test_mm_gradients_and_second_derivatives_are_exact(a_shape, b_shape, transpose):
    a, b = leaves(a_shape, b_shape)

    def product(a, b):
        return autograd.mm(a.t(), b.t()) if transpose else autograd.mm(a, b)

    assert torch.autograd.gradcheck(product, (a, b))
    assert torch.autograd.gradgradcheck(product, (a, b))


def test_linear_without_a_bias_and_with_frozen_operands():
    x, w = leaves((6, 5), (4, 5))
    frozen = w.detach()
    out = autograd.linear(x, frozen, None, "silu")
    (dx,) = torch.autograd.grad(out.sum(), (x,))
    (expected,) = torch.autograd.grad(F.silu(F.linear(x, frozen)).sum(), (x,))
    assert torch.allclose(dx, expected)


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_an_activation_runs_unfused_as_torch_op(act):
    """With a gradient, the product is gemmtune's and the activation torch's own, whose backward
    reads the saved pre-activation: no GEMM is recomputed in the backward."""
    x, w, b = leaves((8, 16), (4, 16), (4,), dtype=torch.float32)  # a dtype gemmtune serves
    out = gemmtune.linear(x, w, b, activation=act)
    assert out.grad_fn.name() == {"gelu": "GeluBackward0", "silu": "SiluBackward0"}[act]
    assert out.grad_fn.next_functions[0][0].name() == "GemmtuneLinearBackward"
    with recording.record() as seen:
        out.sum().backward()
    assert sorted(p.layout for p, _ in seen.problems()) == ["nn", "nn"]  # dx and dweight, nothing more


def test_matmul_with_a_gradient_goes_through_gemmtune():
    a, b = leaves((5, 3), (3, 4), dtype=torch.float32)
    out = gemmtune.matmul(a, b)
    assert out.grad_fn.name() == "GemmtuneMmBackward"
    with recording.record() as seen:
        out.sum().backward()
    assert len(seen.problems()) == 2
    assert torch.allclose(a.grad, torch.ones(5, 4) @ b.detach().t())
