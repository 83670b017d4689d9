"""gemmtune's torch operators: registration (opcheck), gradients against torch's, the
activations' derivatives, and torch.compile(fullgraph=True) tracing them through fake tensors.
On the CPU the ops compute with torch; on the GPU the same tests run the tuned kernels."""

import pytest
import torch
import torch.nn.functional as F

import gemmtune
from gemmtune import activation
from gemmtune.serving import torch_ops

ACTS = ["none", "relu", "gelu", "gelu_tanh", "silu"]
TORCH_ACTS = {"none": lambda t: t, "relu": torch.relu, "gelu": F.gelu,
              "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


def leaves(*shapes, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("act", ACTS)
def test_linear_op_registration(act):
    x, w, b = leaves((5, 7), (3, 7), (3,), dtype=torch.float32)
    torch.library.opcheck(torch.ops.gemmtune.linear.default, (x, w, b, act))
    torch.library.opcheck(torch.ops.gemmtune.linear.default, (x.detach(), w.detach(), None, act))


def test_mm_op_registration():
    a, b = leaves((6, 4), (4, 9), dtype=torch.float32)
    torch.library.opcheck(torch.ops.gemmtune.mm.default, (a, b))


@pytest.mark.parametrize("act", ACTS)
def test_linear_gradients_are_exact(act):
    x, w, b = leaves((2, 3, 7), (5, 7), (5,))  # x with a batch dimension, as in a model
    assert torch.autograd.gradcheck(lambda x, w, b: torch_ops.linear(x, w, b, act), (x, w, b))


def test_mm_gradients_are_exact():
    assert torch.autograd.gradcheck(torch_ops.mm, tuple(leaves((4, 7), (7, 3))))


@pytest.mark.parametrize("act", ACTS)
def test_activation_backward_matches_autograd(act):
    z = torch.randn(1000, dtype=torch.float64) * 3
    g = torch.randn(1000, dtype=torch.float64)
    zz = z.clone().requires_grad_()
    expected, = torch.autograd.grad(TORCH_ACTS[act](zz), zz, g)
    assert torch.allclose(activation.backward(z, g, act).double(), expected, rtol=1e-6, atol=1e-6)


def backward_nodes(out) -> str:
    """The names of every node of ``out``'s backward graph, joined."""
    names, todo = [], [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            names.append(node.name())
            todo += [next_node for next_node, _ in node.next_functions]
    return " ".join(names)


@pytest.mark.parametrize("act", ["none", "gelu"])
def test_public_linear_with_autograd_matches_torch(act):
    x, w, b = leaves((4, 7), (3, 7), (3,), dtype=torch.float32)
    out = gemmtune.linear(x, w, b, activation=None if act == "none" else act)
    assert "GemmtuneLinear" in backward_nodes(out)  # through gemmtune's function, not a torch fallback
    out.square().sum().backward()
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    TORCH_ACTS[act](F.linear(x, w, b)).square().sum().backward()
    for mine, theirs in zip(got, (x.grad, w.grad, b.grad)):
        assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-5)


def test_compiled_fullgraph_traces_the_ops():
    x, w, b = leaves((8, 16), (4, 16), (4,), dtype=torch.float32)
    w2 = torch.randn(16, 4, requires_grad=True)

    def mlp(x):
        return torch.ops.gemmtune.mm(torch.ops.gemmtune.linear(x, w, b, "relu"), w2.t())

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert torch.allclose(out, mlp(x), rtol=1e-6, atol=1e-6)
    out.sum().backward()  # the backward graph, traced by AOT autograd, runs the ops' backward
    assert x.grad is not None and w.grad is not None and w2.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["none", "silu"])
def test_on_the_gpu_tuned_forward_and_backward_match_float64(act):
    from gemmtune.tuning import verify

    gen = torch.Generator(device="cuda").manual_seed(1)
    x, w, b = (torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
               for s in ((33, 256), (96, 256), (96,)))
    out = gemmtune.linear(x, w, b, activation=None if act == "none" else act)
    g = torch.randn(out.shape, generator=gen, device="cuda").to(torch.bfloat16)
    out.backward(g)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = TORCH_ACTS[act](F.linear(x64, w64, b64))
    ref.backward(g.double())
    assert verify.rel_err(out.detach(), ref.detach()) < 1e-2
    for mine, theirs in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert verify.rel_err(mine, theirs) < 2e-2


def test_compiling_the_public_functions_keeps_the_ops_whole():
    """torch.compile must not trace into the dispatcher (its dict, its launchers): under
    compilation gemmtune.linear and gemmtune.matmul emit the custom ops."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    w, w2 = torch.randn(4, 16), torch.randn(4, 3)

    @torch.compile(fullgraph=True, backend=backend)
    def model(x):
        return gemmtune.matmul(gemmtune.linear(x, w, activation="silu"), w2)

    x = torch.randn(8, 16)
    with torch.no_grad():
        out = model(x)
    assert torch.allclose(out, F.silu(F.linear(x, w)) @ w2, rtol=1e-5, atol=1e-6)
    (graph,) = graphs
    assert "gemmtune.linear" in graph and "gemmtune.mm" in graph


@pytest.mark.parametrize("x_shape, w_shape", [((4, 0), (3, 0)), ((4, 5), (0, 5)), ((2, 3, 0), (6, 0)), ((0,), (2, 0))])
@pytest.mark.parametrize("act", ["none", "silu"])
def test_backward_with_k_or_n_zero_matches_torch(x_shape, w_shape, act):
    """Finding 4 (issue 26): the backward reshaped x to (-1, 0), which torch cannot infer."""
    x, w, b = leaves(x_shape, w_shape, (w_shape[0],))
    out = gemmtune.linear(x, w, b, activation=None if act == "none" else act)
    grad = torch.randn(out.shape, dtype=out.dtype)
    mine = torch.autograd.grad(out, (x, w, b), grad)
    theirs = torch.autograd.grad(TORCH_ACTS[act](F.linear(x, w, b)), (x, w, b), grad)
    for got, expected in zip(mine, theirs):
        assert got.shape == expected.shape and torch.allclose(got, expected)


@pytest.mark.parametrize("a, b, message", [
    (torch.ones(3), torch.ones(3, 2), r"mm: a must be 2-D, got shape \(3,\)"),
    (torch.ones(2, 3), torch.ones(1, 3, 2), r"mm: b must be 2-D, got shape \(1, 3, 2\)"),
])
def test_the_mm_op_names_an_operand_that_is_not_2d(a, b, message):
    """Finding 5: the op has no torch.matmul fallback for other ranks (gemmtune.matmul does);
    it said 'not enough values to unpack'. Its fake says the same as it."""
    with pytest.raises(ValueError, match=message):
        torch.ops.gemmtune.mm(a, b)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, pytest.raises(ValueError, match=message):
        torch.ops.gemmtune.mm(mode.from_tensor(a), mode.from_tensor(b))


def test_a_compiled_malformed_call_fails_with_the_public_error():
    """Finding 5: torch.compile runs the fake implementation, which checks as the op does; the
    compiler wraps the error, its message stays."""
    @torch.compile(fullgraph=True, backend="aot_eager")
    def layer(x, w):
        return torch.ops.gemmtune.linear(x, w, None, "none")

    with pytest.raises(Exception, match="its last dimension must be weight's K=5"):
        layer(torch.ones(2, 3), torch.ones(4, 5))
