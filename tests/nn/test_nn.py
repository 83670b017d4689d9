"""gemmtune.optimize: which layers it takes over, the activations it fuses, outputs and gradients
unchanged, and the GEMMs it tunes from example inputs."""

import pytest
import torch
from torch import nn

import gemmtune
from gemmtune import nn as gnn
from gemmtune.device import Device
from gemmtune.problem import Problem


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(approximate="tanh"),
                         nn.Linear(32, 8, bias=False), nn.Sigmoid())


def test_layers_are_taken_over_in_place_and_activations_fused():
    model = mlp()
    first, hooks = model[0], []
    first.register_forward_pre_hook(lambda *args: hooks.append(1))  # a forward hook would keep relu apart
    x = torch.randn(5, 16)
    expected = model(x)
    assert gemmtune.optimize(model) is model
    assert model[0] is first and type(first) is gnn.Linear and first.activation == "relu"
    assert isinstance(model[1], nn.Identity) and model[2].activation == "gelu_tanh"
    assert model[4].activation == "none" and isinstance(model[5], nn.Sigmoid)  # sigmoid is not fusable
    assert list(model.state_dict()) == list(mlp().state_dict())
    assert torch.allclose(model(x), expected, rtol=1e-5, atol=1e-6) and len(hooks) == 2
    assert "activation=relu" in repr(model)


def test_gradients_match_the_original_model():
    reference, model = mlp(), gemmtune.optimize(mlp())
    x = torch.randn(5, 16)
    reference(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_filter_and_no_fusion():
    model = gemmtune.optimize(mlp(), filter=lambda name, layer: layer.out_features == 32, fuse=False)
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear", "GELU", "Linear", "Sigmoid"]
    assert [type(model[i]) is gnn.Linear for i in (0, 2, 4)] == [True, True, False]


def test_example_inputs_tune_every_gemm_seen(monkeypatch):
    tuned = []
    monkeypatch.setattr(gnn, "current", lambda: Device("H100", (9, 0), 132, 232448, 50 << 20))
    monkeypatch.setattr(gnn.api, "tune", lambda problems, options=None: tuned.extend(problems) or [])
    model = gemmtune.optimize(mlp(), (torch.randn(3, 4, 16),))
    assert model[0].activation == "relu"  # fused before the example run, so the fused GEMM is tuned
    assert sorted(tuned, key=lambda p: (p.n, p.k)) == [
        Problem(12, 8, 32, "float32", "linear", False, False, "none"),
        Problem(12, 32, 16, "float32", "linear", True, False, "relu"),
        Problem(12, 32, 32, "float32", "linear", True, False, "gelu_tanh"),
    ]


def test_tune_calls_tunes_what_several_calls_performed_once_each(monkeypatch):
    """A run of several calls (a prefill, then decode steps at two batch sizes): every GEMM they
    performed is tuned, each shape once, and none is tuned while the run goes on."""
    tuned = []
    monkeypatch.setattr(gnn, "current", lambda: Device("H100", (9, 0), 132, 232448, 50 << 20))
    monkeypatch.setattr(gnn.api, "tune", lambda problems, options=None: tuned.append(list(problems)) or [])
    layer = gemmtune.optimize(nn.Sequential(nn.Linear(16, 32)))

    def steps():
        layer(torch.randn(1, 5, 16))
        for batch in (1, 4, 4):
            layer(torch.randn(batch, 1, 16))
        assert tuned == []

    gnn.tune_calls(steps)
    assert len(tuned) == 1 and sorted(p.m for p in tuned[0]) == [1, 4, 5]


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="model"):
        gemmtune.optimize(lambda x: x)
    with pytest.raises(TypeError, match="example_inputs"):
        gemmtune.optimize(mlp(), torch.randn(3, 16))


@pytest.mark.gpu
def test_on_the_gpu_an_optimized_mlp_matches_the_original():
    from gemmtune.serving.dispatch import DISPATCHER
    from gemmtune.tuning import verify

    model = mlp().to("cuda", torch.bfloat16)
    x = torch.randn(33, 16, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x).double()
        gemmtune.optimize(model, (x,), check=False)
        assert len(DISPATCHER.kernels) == 0  # tuned and stored; kernels are built on the next call
        got = model(x)
    assert len(DISPATCHER.kernels) == 3 and verify.rel_err(got, expected) < 2e-2
