"""What optimize leaves untouched (gemmtune.nn.refused): shared parameters, meta weights, dtypes
gemmtune does not serve, non-contiguous weights, a forward set on the instance, a Conv1D computing
something else, and a CPU model beside a GPU; one log line, outputs unchanged, the other layers
taken."""

import copy
import logging

import pytest
import torch
from torch import nn

import gemmtune
from gemmtune import nn as gnn
from gemmtune.nn import refused

from .test_conv1d import Conv1D


def two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))


def optimized(model, caplog):
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        gemmtune.optimize(model)
    return [r.getMessage() for r in caplog.records if r.name == "gemmtune"]


def test_layers_sharing_a_weight_are_left_to_torch_and_the_rest_taken(caplog):
    model = two_layers()
    model[2].weight = model[0].weight  # tied
    reference = copy.deepcopy(model)
    messages = optimized(model, caplog)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear and type(model[1]) is nn.ReLU
    assert type(model[4]) is gnn.Linear
    assert messages == ["gemmtune.optimize: 2 layers left to torch (a parameter shared with another module: 0, 2)"]
    assert model[0].weight is model[2].weight
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), reference(x))


def test_a_head_tied_to_an_embedding_is_left_to_torch(caplog):
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    model = LM()
    messages = optimized(model, caplog)
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight
    assert messages == ["gemmtune.optimize: 1 layer left to torch (a parameter shared with another module: head)"]


def test_a_layer_registered_twice_is_not_refused_for_it():
    """One module under two names holds its parameters once: its own slots count once each."""
    model = two_layers()
    model.again = model[4]
    gemmtune.optimize(model)
    assert type(model[4]) is gnn.Linear


@pytest.mark.parametrize("dtype", [torch.float64, getattr(torch, "float8_e4m3fn", torch.int8)])
def test_a_dtype_gemmtune_does_not_serve_is_left_to_torch(dtype, caplog):
    model = two_layers()
    model[4].to(dtype)
    messages = optimized(model, caplog)
    assert type(model[4]) is nn.Linear and type(model[0]) is gnn.Linear
    name = str(dtype).removeprefix("torch.")
    assert messages == [f"gemmtune.optimize: 1 layer left to torch (dtype {name}, which gemmtune does not serve: 4)"]


def test_meta_weights_are_left_to_torch(caplog):
    with torch.device("meta"):
        model = two_layers()
    messages = optimized(model, caplog)
    assert all(type(m) is nn.Linear for m in model[::2]) and type(model[1]) is nn.ReLU
    assert messages == ["gemmtune.optimize: 3 layers left to torch "
                        "(weights on the meta device (optimize once they are loaded): 0, 2, 4)"]


def test_a_weight_that_is_not_contiguous_is_left_to_torch(caplog):
    model = two_layers()
    model[2].weight = nn.Parameter(torch.randn(8, 8).t())
    reference = copy.deepcopy(model)
    messages = optimized(model, caplog)
    assert type(model[2]) is nn.Linear and type(model[3]) is nn.GELU and type(model[0]) is gnn.Linear
    assert messages == ["gemmtune.optimize: 1 layer left to torch (a weight that is not contiguous: 2)"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), reference(x))


def test_a_conv1d_s_layout_does_not_matter_but_what_it_computes_does(caplog):
    class Scaled(Conv1D):
        def forward(self, x):
            return super().forward(x) * 2.0

    Scaled.__name__ = "Conv1D"
    transposed = Conv1D(8, 8)
    transposed.weight = nn.Parameter(torch.randn(8, 8).t())  # its storage is made anew when taken
    model = nn.Sequential(transposed, Scaled(8, 8))
    messages = optimized(model, caplog)
    assert isinstance(model[0], gnn.TransposedLinear) and not isinstance(model[1], gnn.TransposedLinear)
    assert messages == ["gemmtune.optimize: 1 layer left to torch "
                        "(a Conv1D whose forward does not compute x @ weight + bias: 1)"]


@pytest.mark.cpu_rule
def test_a_cpu_model_beside_a_gpu_is_left_unchanged(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = two_layers()
    reference = copy.deepcopy(model)
    messages = optimized(model, caplog)
    assert [type(m) for m in model] == [type(m) for m in reference]
    assert len(messages) == 1 and "on the CPU" in messages[0] and "nothing changed" in messages[0]
    assert not refused.on_the_cpu(nn.ReLU())  # no parameters: nothing to say


def test_the_summary_names_a_few_layers_per_reason():
    text = refused.summary({f"l{i}": "why" for i in range(5)} | {"": "other"})
    assert text == "gemmtune.optimize: 6 layers left to torch (why: l0, l1, l2 and 2 more; other: (the model itself))"


def wrapped(module: nn.Module) -> nn.Module:
    """A forward set on the instance, as accelerate's hooks set one on a model dispatched over
    devices: it calls the forward the module had."""
    old = module.forward

    def forward(*args, **kwargs):
        return old(*args, **kwargs)

    module.forward = forward
    return module


def test_a_layer_whose_forward_is_set_on_the_instance_is_left_to_torch(caplog):
    """Its calls go to that forward, never to gemmtune's: taken over, the ReLU fused into it
    was lost (the model's output changed)."""
    model = two_layers()
    wrapped(model[0])
    reference = copy.deepcopy(model)
    messages = optimized(model, caplog)
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.ReLU and type(model[2]) is gnn.Linear
    assert messages == ["gemmtune.optimize: 1 layer left to torch (a forward set on the module itself "
                        "(a wrapper, such as accelerate's hooks): 0)"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), reference(x))


def test_an_activation_whose_forward_is_set_on_the_instance_is_not_fused():
    model = two_layers()
    wrapped(model[3])
    reference = copy.deepcopy(model)
    gemmtune.optimize(model, check=False)
    assert model[0].activation == "relu" and model[2].activation == "none" and type(model[3]) is nn.GELU
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), reference(x))


def test_attention_whose_forward_is_set_on_the_instance_is_left_to_torch():
    model = wrapped(nn.MultiheadAttention(8, 2))
    gemmtune.optimize(model, check=False)
    assert type(model) is nn.MultiheadAttention
