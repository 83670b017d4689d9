"""transformers' Conv1D (GPT-2's projections) taken over by optimize (gemmtune.nn.conv1d): which
layers are taken, the parameters and outputs unchanged, the activation after it fused, gradients,
copies and pickles, and the way back to the class it was."""

import copy
import io
import math

import pytest
import torch
from torch import nn

import gemmtune
from gemmtune.nn import conv1d, keep
from gemmtune.problem import Problem

from .test_fusion import made


class Conv1D(nn.Module):
    """As transformers' ``pytorch_utils.Conv1D``: weight (nx, nf), ``addmm(bias, x, weight)``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)
        nn.init.normal_(self.bias, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class NewGELUActivation(nn.Module):
    """As transformers' (GPT-2's ``gelu_new``)."""

    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


class GPT2MLP(nn.Module):
    def __init__(self, width=24, inner=40):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(inner, width), Conv1D(width, inner)
        self.act, self.dropout = NewGELUActivation(), nn.Dropout(0.1)

    def forward(self, hidden_states):
        hidden_states = self.c_fc(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states)
        return self.dropout(hidden_states)


def test_a_conv1d_is_taken_over_keeping_its_parameters_and_outputs():
    layer, reference = made(Conv1D, 40, 24), made(Conv1D, 40, 24)
    weight, bias = layer.weight, layer.bias
    gemmtune.optimize(nn.Sequential(layer))
    assert isinstance(layer, conv1d.TransposedLinear) and isinstance(layer, Conv1D)
    assert type(layer).torch_class is Conv1D and type(layer).__name__ == "GemmtuneConv1D"
    assert layer.weight is weight and layer.bias is bias and weight.shape == (24, 40)
    assert weight.t().is_contiguous() and torch.equal(weight, reference.weight)
    assert list(layer.state_dict()) == ["weight", "bias"]
    for shape in [(1, 24), (7, 24), (2, 33, 24)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-6)


def test_gpt2_s_mlp_gets_its_gelu_fused_into_c_fc():
    model, reference = made(GPT2MLP), made(GPT2MLP)
    act = model.act
    gemmtune.optimize(model)
    assert model.c_fc.activation == "gelu_tanh" and model.c_fc.fused == (model, "act", act)
    assert type(model.act) is nn.Identity and model.c_proj.activation == "none"
    assert "activation=gelu_tanh" in repr(model.c_fc)
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_gradients_flow_to_the_conv1d_s_parameters():
    model, reference = made(GPT2MLP).train(), made(GPT2MLP).train()
    for m in (model, reference):
        m.dropout.p = 0.0
    gemmtune.optimize(model)
    x = torch.randn(4, 24)
    reference(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert q.grad is not None and q.grad.shape == p.shape, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)


def test_layers_that_only_look_like_conv1d_are_left_alone():
    class Scaled(Conv1D):  # a Conv1D that computes something else
        def forward(self, x):
            return super().forward(x) * 2.0

    class Extra(Conv1D):  # a parameter beyond weight and bias
        def __init__(self, nf, nx):
            super().__init__(nf, nx)
            self.scale = nn.Parameter(torch.ones(nf))

    Scaled.__name__ = Extra.__name__ = "Conv1D"
    wrong_nf = made(Conv1D, 40, 24)
    wrong_nf.nf = 41
    as_int = made(Conv1D, 8, 8)
    as_int.weight = nn.Parameter(torch.ones(8, 8, dtype=torch.int32), requires_grad=False)
    for layer in (made(Scaled, 40, 24), made(Extra, 40, 24), wrong_nf, as_int):
        before = type(layer)
        gemmtune.optimize(nn.Sequential(layer))
        assert type(layer) is before and not isinstance(layer, conv1d.TransposedLinear)


def test_the_filter_sees_conv1d_layers_too():
    model = gemmtune.optimize(made(GPT2MLP), filter=lambda name, layer: name != "c_proj")
    assert isinstance(model.c_fc, conv1d.TransposedLinear) and type(model.c_proj) is Conv1D


def test_copies_and_pickles_keep_the_layer_and_its_values():
    model = gemmtune.optimize(made(GPT2MLP))
    x = torch.randn(2, 24)
    expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert type(other.c_fc) is type(model.c_fc) and other.c_fc.activation == "gelu_tanh"
        torch.testing.assert_close(other(x), expected)


def test_load_state_dict_copies_into_the_transposed_storage():
    model, source = made(GPT2MLP), GPT2MLP()
    gemmtune.optimize(model)
    model.load_state_dict(source.state_dict())
    assert model.c_fc.weight.t().is_contiguous()
    x = torch.randn(3, 24)
    torch.testing.assert_close(model(x), source.eval()(x), rtol=1e-5, atol=1e-6)


def test_release_gives_back_the_conv1d_and_its_activation():
    model, reference = made(GPT2MLP), made(GPT2MLP)
    act = model.act
    gemmtune.optimize(model)
    for layer in (model.c_fc, model.c_proj):
        keep.Form(layer).release()
    assert type(model.c_fc) is Conv1D and type(model.c_proj) is Conv1D and model.act is act
    assert "activation" not in vars(model.c_fc) and "fused" not in vars(model.c_fc)
    x = torch.randn(3, 24)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_the_example_run_tunes_the_conv1d_gemms_and_keeps_what_pays(fake_tuning):
    """Both GEMMs are recorded per layer as linear problems on the (N, K) weight; the one tuned
    to cuBLAS goes back to Conv1D, the other stays gemmtune's (the model's timing is not asked
    for: no GPU here, so the check cannot time and keeps what was tuned)."""
    model = made(GPT2MLP)
    tuned = fake_tuning(lambda p: "cublas" if p.n == 24 else "triton_tiled")
    gemmtune.optimize(model, (torch.randn(3, 5, 24),))
    assert sorted(tuned, key=lambda p: p.n) == [
        Problem(15, 24, 40, "float32", "linear", True, False, "none"),
        Problem(15, 40, 24, "float32", "linear", True, False, "gelu_tanh"),
    ]
    assert type(model.c_proj) is Conv1D
    assert isinstance(model.c_fc, conv1d.TransposedLinear) and model.c_fc.activation == "gelu_tanh"


@pytest.mark.gpu
def test_on_the_gpu_gpt2_runs_its_conv1d_gemms_through_gemmtune():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=512, n_positions=128)
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).cuda().to(torch.bfloat16).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 512, (4, 64), device="cuda")
    gemmtune.optimize(model, (ids,), check=False)
    layers = [m for m in model.modules() if isinstance(m, conv1d.TransposedLinear)]
    assert len(layers) == 8 and sum(m.activation == "gelu_tanh" for m in layers) == 2
    with torch.no_grad():
        got, expected = model(ids).last_hidden_state.float(), reference(ids).last_hidden_state.float()
    assert (got - expected).norm() / expected.norm() < 2e-2
