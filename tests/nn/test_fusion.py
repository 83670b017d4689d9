"""Activations fused across module boundaries (gemmtune.nn.fusion): a layer's output going to an
activation module alone, as its parent's forward says, traced with torch.fx; transformers' and
timm's activation classes recognised by what they compute; what is not fused, and the release."""

import copy
import functools
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemmtune
from gemmtune import nn as gnn
from gemmtune.nn import fusion, keep


class Mlp(nn.Module):
    """timm's Mlp: fc1 -> act -> drop1 -> norm -> fc2 -> drop2, called in forward."""

    def __init__(self, act_layer=nn.GELU, dims=(16, 32, 8)):
        super().__init__()
        self.fc1 = nn.Linear(dims[0], dims[1])
        self.act = act_layer()
        self.drop1 = nn.Dropout(0.5)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(dims[1], dims[2])
        self.drop2 = nn.Dropout(0.5)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        return self.drop2(x)


def _gelu_python(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class GELUActivation(nn.Module):
    """As transformers' (ACT2FN["gelu"])."""

    def __init__(self, use_gelu_python: bool = False):
        super().__init__()
        self.act = _gelu_python if use_gelu_python else nn.functional.gelu

    def forward(self, input):
        return self.act(input)


class NewGELUActivation(nn.Module):
    """As transformers' (ACT2FN["gelu_new"], GPT-2's)."""

    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


class PytorchGELUTanh(nn.Module):
    def forward(self, input):
        return nn.functional.gelu(input, approximate="tanh")


class SiLUActivation(nn.Module):
    def forward(self, input):
        return input * torch.sigmoid(input)


class BertIntermediate(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.dense = nn.Linear(16, 64)
        self.intermediate_act_fn = act

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        return self.intermediate_act_fn(hidden_states)


def made(cls, *args):
    torch.manual_seed(0)
    return cls(*args).eval()


def test_a_timm_mlp_gets_fc1_fused_and_computes_what_it_did():
    model, reference = made(Mlp), made(Mlp)
    act = model.act
    gemmtune.optimize(model)
    assert type(model.fc1) is gnn.Linear and model.fc1.activation == "gelu"
    assert type(model.act) is nn.Identity and model.fc1.fused == (model, "act", act)
    assert model.fc2.activation == "none" and type(model.drop1) is nn.Dropout  # fc2 is followed by no activation
    assert list(model.state_dict()) == list(reference.state_dict())
    x = torch.randn(3, 5, 16)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act, epilogue", [(nn.ReLU, "relu"), (nn.SiLU, "silu"), (lambda: nn.GELU("tanh"), "gelu_tanh")])
def test_each_fusable_kind_in_a_forward(act, epilogue):
    model = gemmtune.optimize(made(Mlp, act))
    assert model.fc1.activation == epilogue and type(model.act) is nn.Identity


def test_a_dropout_between_them_means_no_fusion():
    class DropFirst(Mlp):
        def forward(self, x):
            return self.fc2(self.act(self.drop1(self.fc1(x))))

    model = gemmtune.optimize(made(DropFirst))
    assert model.fc1.activation == "none" and type(model.act) is nn.GELU


def test_an_activation_shared_by_two_layers_is_not_fused():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            return self.act(self.a(x)) + self.act(self.b(x))

    model, reference = made(Shared), made(Shared)
    gemmtune.optimize(model)
    assert type(model.a) is gnn.Linear and type(model.act) is nn.ReLU
    assert model.a.activation == model.b.activation == "none"
    x = torch.randn(4, 8)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_a_layer_whose_output_also_feeds_a_residual_is_not_fused():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(8, 8), nn.SiLU()

        def forward(self, x):
            h = self.fc(x)
            return self.act(h) + h

    model, reference = made(Residual), made(Residual)
    gemmtune.optimize(model)
    assert model.fc.activation == "none" and type(model.act) is nn.SiLU
    x = torch.randn(4, 8)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_a_layer_called_twice_is_not_fused():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            return self.act(self.fc(x)) + self.fc(-x)

    model = gemmtune.optimize(made(Twice))
    assert model.fc.activation == "none" and type(model.act) is nn.ReLU


def test_a_layer_registered_in_two_parents_is_not_fused():
    """The same Linear object under two parents: the other parent's call would get the activation."""
    model = made(Mlp)
    model.other = nn.Sequential(model.fc1)
    gemmtune.optimize(model)
    assert model.fc1.activation == "none" and type(model.act) is nn.GELU


def test_a_forward_that_branches_on_training_fuses_only_what_both_modes_show():
    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            h = self.fc(x)
            return self.act(h) + h if self.training else self.act(h)

    model, reference = made(Branching), made(Branching)
    gemmtune.optimize(model)
    assert model.fc.activation == "none" and type(model.act) is nn.ReLU and not model.training
    x = torch.randn(4, 8)
    model.train(), reference.train()
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)


def _doubled(module, args, output):
    return output * 2


@pytest.mark.parametrize("hook", ["forward", "backward", "backward_pre"])
@pytest.mark.parametrize("on", ["layer", "activation"])
@pytest.mark.parametrize("parent", ["traced", "sequential"])
def test_a_pair_with_a_hook_that_would_see_the_fusion_is_not_fused(hook, on, parent):
    """A forward hook of the layer would get the activation's output (this one changes it: the
    model's output would too), a backward hook its gradient; the activation's would not run."""
    if parent == "traced":
        model, reference = made(Mlp), made(Mlp)
        pick = (lambda m: m.fc1) if on == "layer" else (lambda m: m.act)
    else:
        model, reference = (made(lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU())) for _ in range(2))
        pick = (lambda m: m[0]) if on == "layer" else (lambda m: m[1])
    for m in (model, reference):
        if hook == "forward":
            pick(m).register_forward_hook(_doubled)
        elif hook == "backward":
            pick(m).register_full_backward_hook(lambda *args: None)
        else:
            pick(m).register_full_backward_pre_hook(lambda *args: None)
    gemmtune.optimize(model, check=False)
    layer = model.fc1 if parent == "traced" else model[0]
    assert layer.activation == "none"
    x = torch.randn(4, 16)
    model.eval(), reference.eval()
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)


class StoresAside(nn.Module):
    """fc -> act, with fc's output also kept where the graph does not show it: as an attribute,
    in a list or dict attribute, or on the layer itself."""

    def __init__(self, where):
        super().__init__()
        self.fc, self.act, self.where = nn.Linear(8, 8), nn.GELU(), where
        self.cache, self.seen, self.by_name = None, [], {"kept": None}

    def forward(self, x):
        y = self.fc(x)
        if self.where == "attribute":
            self.cache = y
        elif self.where == "list":
            self.seen.append(y)
        elif self.where == "dict":
            self.by_name["fc"] = y
        elif self.where == "child":
            self.fc.last = y
        return self.act(y)


@pytest.mark.parametrize("where", ["attribute", "list", "dict", "child"])
def test_a_forward_that_stores_an_output_aside_is_not_fused_and_its_state_is_put_back(where):
    """Fused, what it keeps would be the activation's output; traced, it would keep fx proxies."""
    model, reference = made(StoresAside, where), made(StoresAside, where)
    gemmtune.optimize(model, check=False)
    assert model.fc.activation == "none" and type(model.act) is nn.GELU
    assert model.cache is None and model.seen == [] and model.by_name == {"kept": None}
    assert not hasattr(model.fc, "last")
    x = torch.randn(4, 8)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)
    kept = {"attribute": lambda m: m.cache, "list": lambda m: m.seen[-1], "dict": lambda m: m.by_name["fc"],
            "child": lambda m: m.fc.last}[where]
    assert torch.allclose(kept(model), kept(reference), rtol=1e-5, atol=1e-6)  # the layer's own output


def test_a_forward_that_reads_its_state_without_changing_it_is_fused():
    model, reference = made(StoresAside, "nowhere"), made(StoresAside, "nowhere")
    gemmtune.optimize(model, check=False)
    assert model.fc.activation == "gelu"
    x = torch.randn(4, 8)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_a_forward_pre_hook_of_the_layer_does_not_keep_it_apart():
    """It sees the layer's input, which fusing does not change."""
    model, reference = made(Mlp), made(Mlp)
    for m in (model, reference):
        m.fc1.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    gemmtune.optimize(model, check=False)
    assert model.fc1.activation == "gelu"
    x = torch.randn(4, 16)
    model.eval(), reference.eval()
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_a_forward_fx_cannot_trace_is_left_alone(caplog):
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            h = self.fc(x)
            if h.sum() > 0:  # control flow on a tensor: fx cannot trace it
                return self.act(h)
            return h

    model, reference = made(DataDependent), made(DataDependent)
    with caplog.at_level(logging.DEBUG, logger="gemmtune"):
        gemmtune.optimize(model)
    assert type(model.fc) is gnn.Linear and model.fc.activation == "none" and type(model.act) is nn.ReLU
    assert "DataDependent's forward not traced" in caplog.text
    x = torch.randn(4, 8)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_a_sequential_with_a_forward_of_its_own_is_traced():
    class Reversed(nn.Sequential):
        def forward(self, x):
            return self[0](self[1](x))

    model = gemmtune.optimize(made(Reversed, nn.Linear(8, 8), nn.ReLU()))
    assert model[0].activation == "none" and type(model[1]) is nn.ReLU
    plain = gemmtune.optimize(made(nn.Sequential, nn.Linear(8, 8), nn.ReLU()))
    assert plain[0].activation == "relu" and type(plain[1]) is nn.Identity


@pytest.mark.parametrize("act, epilogue", [
    (GELUActivation(), "gelu"), (GELUActivation(use_gelu_python=True), "gelu"), (NewGELUActivation(), "gelu_tanh"),
    (PytorchGELUTanh(), "gelu_tanh"), (SiLUActivation(), "silu"), (nn.ReLU(inplace=True), "relu"),
])
def test_transformers_activations_are_recognised_by_what_they_compute(act, epilogue):
    assert fusion.epilogue(act) == epilogue


def test_an_activation_class_that_computes_something_else_is_not():
    class QuickGELU(nn.Module):
        def forward(self, input):
            return input * torch.sigmoid(1.702 * input)

    class Clipped(GELUActivation):  # as GELUActivation, clipped: differs only on large values
        def forward(self, input):
            return torch.clip(F.gelu(input), -10, 10)

    class Learned(NewGELUActivation):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

    Clipped.__name__ = QuickGELU.__name__ = "GELUActivation"
    for act in (QuickGELU(), Clipped(), Learned()):
        assert fusion.epilogue(act) is None, type(act)
    assert fusion.epilogue(nn.Sigmoid()) is None
    assert fusion._computed(GELUActivation()) == "gelu"  # the check itself accepts the real one


def test_a_bert_intermediate_with_a_transformers_gelu_is_fused():
    model, reference = made(BertIntermediate, GELUActivation()), made(BertIntermediate, GELUActivation())
    act = model.intermediate_act_fn
    gemmtune.optimize(model)
    assert model.dense.activation == "gelu" and type(model.intermediate_act_fn) is nn.Identity
    x = torch.randn(2, 3, 16)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)
    keep.Form(model.dense).release()
    assert model.intermediate_act_fn is act and type(model.dense) is nn.Linear


def test_after_release_the_original_structure_is_back():
    model, reference = made(Mlp), made(Mlp)
    act = model.act
    gemmtune.optimize(model)
    for layer in (model.fc1, model.fc2):
        keep.Form(layer).release()
    assert model.act is act and [type(m) for m in model.children()] == [type(m) for m in reference.children()]
    assert "activation" not in vars(model.fc1) and "fused" not in vars(model.fc1)
    x = torch.randn(3, 16)
    assert torch.equal(model(x), reference(x))
    again = gemmtune.optimize(copy.deepcopy(model))  # and can be optimized anew
    assert again.fc1.activation == "gelu" and torch.allclose(again(x), reference(x), rtol=1e-5, atol=1e-6)


def test_fusion_keeps_gradients_and_the_training_mode():
    model, reference = made(Mlp).train(), made(Mlp).train()
    for m in (model, reference):
        m.drop1.p = m.drop2.p = 0.0
    gemmtune.optimize(model)
    assert model.training and model.fc1.activation == "gelu"
    x = torch.randn(5, 16)
    reference(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def checkpointing(forward):
    """A wrapper hiding the forward's parameters, as transformers' checkpointing layers have."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper


class Layer(nn.Module):
    """As transformers' encoder layers (Whisper, BART, OPT): attention then fc1 -> act -> fc2 in
    one forward that takes ``**kwargs`` and clamps float16 outputs; its class's forward wrapped when
    subclassed (transformers' ``GradientCheckpointingLayer.__init_subclass__``)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.forward = checkpointing(cls.__dict__["forward"])


class EncoderLayer(Layer):
    def __init__(self):
        super().__init__()
        self.attn, self.fc1, self.act, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 32), GELUActivation(), nn.Linear(32, 16)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        residual = hidden_states
        hidden_states = residual + self.attn(hidden_states, **kwargs)
        hidden_states = self.fc2(self.act(self.fc1(hidden_states)))
        if hidden_states.dtype == torch.float16:
            hidden_states = torch.clamp(hidden_states, min=-6e4, max=6e4)
        return hidden_states


def test_a_wrapped_forward_with_keywords_and_a_dtype_branch_is_traced():
    model, reference = made(EncoderLayer), made(EncoderLayer)
    assert type(model).forward.__wrapped__ is not None  # wrapped, as in transformers
    gemmtune.optimize(model)
    assert model.fc1.activation == "gelu" and type(model.act) is nn.Identity and model.attn.activation == "none"
    x = torch.randn(3, 16)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
    assert not model.training and type(model) is EncoderLayer and "forward" not in vars(model)


def test_a_forward_that_reads_its_keywords_is_not_traced():
    class Reads(EncoderLayer):
        def forward(self, hidden_states, **kwargs):
            h = self.fc1(hidden_states)
            return self.fc2(self.act(h)) + (h.sum() if kwargs.get("extra") else 0)

    model = gemmtune.optimize(made(Reads))
    assert model.fc1.activation == "none" and type(model.act) is GELUActivation


def test_a_branch_on_one_dtype_that_uses_the_output_elsewhere_means_no_fusion():
    class HalfOnly(EncoderLayer):
        def forward(self, hidden_states, **kwargs):
            h = self.fc1(hidden_states)
            out = self.act(h)
            if h.dtype == torch.float16:  # only float16 tensors take this path: it keeps h
                out = out + h
            return self.fc2(out)

    model, reference = made(HalfOnly), made(HalfOnly)
    gemmtune.optimize(model)
    assert model.fc1.activation == "none" and type(model.act) is GELUActivation
    x = torch.randn(2, 16)
    torch.testing.assert_close(model.half()(x.half()), reference.half()(x.half()))


def test_an_activation_class_is_recognised_by_a_name_that_names_one():
    class BloomGelu(nn.Module):  # as BLOOM's: the tanh approximation, written out
        def forward(self, x):
            return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    class QuickGELUActivation(nn.Module):  # named so, computes something else
        def forward(self, input):
            return input * torch.sigmoid(1.702 * input)

    class Identity(nn.Module):  # computes relu, but its name does not say so: never probed
        def forward(self, x):
            return x.clamp(min=0)

    assert fusion.epilogue(BloomGelu()) == "gelu_tanh"
    assert fusion.epilogue(QuickGELUActivation()) is None and fusion.epilogue(Identity()) is None
