"""Under torch.autocast an optimized model computes what the model without gemmtune computes:
autocast casts the operands of torch's linear ops (an autocast op's bfloat16 output meets a float32
weight), so gemmtune's layers and functions run torch's op there, and the dtypes and values are
torch's. Before, the second layer of an optimized model raised "gemmtune does not mix dtypes"."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemmtune
from gemmtune import nn as gnn

from .test_conv1d import Conv1D
from .test_joined import Block

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def autocast(device):
    return torch.autocast(device, dtype=torch.bfloat16)


def twins(make, device):
    """A model and its copy, the first optimized (no tuning: every layer stays gemmtune's)."""
    torch.manual_seed(0)
    reference = make().to(device).eval()
    model = copy.deepcopy(reference)
    return gemmtune.optimize(model, check=False), reference


def same(got, expected):
    assert got.dtype == expected.dtype
    assert torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dims", [(16, 32), (7, 33)])  # the second stored padded (AlignedLinear)
def test_an_optimized_mlp_under_autocast_computes_what_the_model_does(device, dims):
    model, reference = twins(lambda: nn.Sequential(nn.Linear(dims[0], dims[1]), nn.GELU(), nn.LayerNorm(dims[1]),
                                                   nn.Linear(dims[1], dims[0]), nn.ReLU()), device)
    assert model[0].activation == "gelu" and type(model[1]) is nn.Identity
    x = torch.randn(5, dims[0], device=device)
    with torch.no_grad(), autocast(device):
        same(model(x), reference(x))


@pytest.mark.parametrize("device", DEVICES)
def test_joined_siblings_under_autocast_compute_what_the_model_does(device):
    torch.manual_seed(0)
    reference = Block().to(device)
    model = copy.deepcopy(reference)
    gemmtune.optimize(model, (torch.randn(2, 16, device=device),), siblings=True, check=False)
    assert type(model.q) is gnn.JoinedLinear
    x = torch.randn(3, 16, device=device)
    with torch.no_grad(), autocast(device):
        same(model(x), reference(x))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_and_a_conv1d_under_autocast_compute_what_the_model_does(device):
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
            self.proj = Conv1D(32, 16)

        def forward(self, x):
            # contiguous: under CUDA autocast torch's own attention takes its slow path, whose
            # batch-first output is a transposed view that Conv1D's ``view`` refuses (torch's too)
            return self.proj(self.attn(x, x, x, need_weights=False)[0].contiguous())

    model, reference = twins(Layer, device)
    assert type(model.attn) is not nn.MultiheadAttention
    x = torch.randn(2, 5, 16, device=device)
    with torch.no_grad(), autocast(device):
        same(model(x), reference(x))


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_under_autocast_are_the_models(device):
    model, reference = twins(lambda: nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 8)), device)
    model.train(), reference.train()
    x = torch.randn(4, 16, device=device)
    for m in (model, reference):
        with autocast(device):
            loss = m(x).float().square().sum()
        loss.backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=2e-2, atol=2e-2), name


@pytest.mark.parametrize("device", DEVICES)
def test_the_functions_under_autocast_are_torchs_ops_with_their_checks(device):
    torch.manual_seed(0)
    x, w, w2, b2 = (torch.randn(*shape, device=device) for shape in ((3, 16), (8, 16), (4, 8), (4,)))
    with autocast(device):
        half = F.linear(x, w)  # an autocast op's bfloat16 output, for a float32 weight
        assert half.dtype == torch.bfloat16
        same(gemmtune.linear(half, w2, b2, "gelu"), F.gelu(F.linear(half, w2, b2)))
        same(gemmtune.matmul(x, w.t()), torch.matmul(x, w.t()))
        with pytest.raises(ValueError, match="activation='tanh'"):
            gemmtune.linear(x, w, None, "tanh")
        with pytest.raises(ValueError, match="last dimension"):
            gemmtune.linear(x, w.t())
    with pytest.raises(TypeError, match="does not mix dtypes"):  # outside autocast, as before
        gemmtune.linear(half, w2)
