"""Layers at rest (gemmtune.nn.capture): a layer whose eager calls run torch's forward waits in
its torch form, and the hooks of the run's outermost modules put it in gemmtune's while a CUDA
graph is captured (on the CPU, a capture is stood in for by the capture test answering True)."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

import gemmtune
from gemmtune import nn as gnn
from gemmtune.nn import capture, keep, lean
from gemmtune.results import Status, Trial
from gemmtune.serving.dispatch import DISPATCHER


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 8))


@pytest.fixture(autouse=True)
def _one_call_rests(monkeypatch):
    """A resting layer called once in a model's call rests (the hooks' cost is not the subject)."""
    monkeypatch.setattr(capture, "REST_FROM", 1)


def called_by(model: nn.Module, *inputs: torch.Tensor) -> capture.Called:
    with capture.calls() as called:
        model(*inputs)
    return called


def resting_mlp():
    """``mlp`` optimized, its first layer (GELU fused) kept for CUDA graphs alone, the others
    gemmtune's in both modes."""
    model = gemmtune.optimize(mlp())
    first = keep.Form(model[0])
    first.graph_only, model[0].torch_when_capturing = True, False
    capture.rest([first, keep.Form(model[2]), keep.Form(model[4])], called_by(model, torch.randn(2, 16)))
    return model


def torch_linear(x, weight, bias=None, activation=None):
    """``gemmtune.linear`` as torch computes it."""
    out = F.linear(x, weight, bias)
    return out if activation is None else gemmtune.activation.apply(out, activation, inplace=False)


def fail(*args, **kwargs):
    raise RuntimeError("capture failed")


@pytest.fixture
def capturing(monkeypatch):
    """``set(True)``: every capture test (the hook's, the layers') answers that a CUDA graph is
    being captured; every gemmtune linear call from then on is recorded (its activation) and
    computed by torch."""
    calls = []

    def linear(x, weight, bias=None, activation=None):
        calls.append(activation)
        return torch_linear(x, weight, bias, activation)

    def set_to(value: bool) -> None:
        calls.clear()
        monkeypatch.setattr(keep, "capturing", lambda: value)
        monkeypatch.setattr(gnn, "_capturing", lambda: value)

    monkeypatch.setattr(gnn.api, "linear", linear)
    set_to.calls = calls
    return set_to


def test_the_roots_are_the_modules_no_other_call_contains_and_each_module_s_calls_are_counted():
    model, other = mlp(), nn.Linear(8, 4)
    with capture.calls() as called:
        model(torch.randn(2, 16))
        other(model[4](torch.randn(2, 32)))
        model(torch.randn(2, 16))
    assert called.roots == [model, model[4], other]
    assert called.root_calls == 4 and called.calls[model] == 2 and called.calls[model[4]] == 3
    assert called.per_root_call([model[0], model[2]]) == 4 / 4


class Thrice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x):
        return self.layer(self.layer(self.layer(x)))


@pytest.mark.parametrize("rest_from, rests", [(3, True), (4, False)])
def test_layers_rest_only_where_the_model_s_call_makes_enough_calls_of_them(monkeypatch, rest_from, rests):
    monkeypatch.setattr(capture, "REST_FROM", rest_from)
    model = gemmtune.optimize(Thrice())
    model.layer.torch_when_capturing = False
    capture.rest([keep.Form(model.layer)], called_by(model, torch.randn(2, 8)))
    assert (type(model.layer) is nn.Linear) == rests and bool(model._forward_pre_hooks) == rests


def test_a_layer_kept_for_graphs_alone_rests_in_its_torch_form_and_eager_calls_are_torch_s(capturing):
    reference, model = mlp(), resting_mlp()
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.GELU and model[0].torch_when_capturing is False
    assert type(model[2]) is gnn.Linear and isinstance(model[3], nn.Identity)
    capturing(False)
    x = torch.randn(7, 16)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)
    assert capturing.calls == ["silu", None]  # the other two layers only
    assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))  # torch's own call


def test_while_a_graph_is_captured_the_resting_layer_runs_gemmtune_s_forward_and_rests_after(capturing):
    reference, model = mlp(), resting_mlp()
    seen = []
    model[2].register_forward_pre_hook(lambda module, args: seen.append((type(model[0]), type(model[1]))))
    capturing(True)
    x = torch.randn(7, 16)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)
    assert capturing.calls == ["gelu", "silu", None] and seen == [(gnn.Linear, nn.Identity)]
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.GELU
    capturing(False)
    model(x)
    assert seen[-1] == (nn.Linear, nn.GELU) and capturing.calls == ["silu", None]


def test_a_capture_that_fails_leaves_the_layer_at_rest(capturing, monkeypatch):
    model = resting_mlp()
    capturing(True)
    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="capture failed"):
        patch.setattr(gnn.api, "linear", fail)
        model(torch.randn(3, 16))
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.GELU
    model(torch.randn(3, 16))  # the next capture swaps again
    assert capturing.calls == ["gelu", "silu", None] and type(model[0]) is nn.Linear


def test_a_capture_of_a_module_inside_the_model_captures_torch_s_forward(capturing):
    model = resting_mlp()
    capturing(True)
    block = nn.Sequential(model[0], model[1])  # a part of the model called alone
    x = torch.randn(3, 16)
    assert torch.equal(block(x), F.gelu(F.linear(x, model[0].weight, model[0].bias)))
    assert capturing.calls == []


def test_optimizing_the_model_again_leaves_a_resting_layer_alone():
    reference, model = mlp(), resting_mlp()
    gemmtune.optimize(model)
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.GELU and model[0].activation == "gelu"
    x = torch.randn(5, 16)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)  # its GELU applied once


def test_a_deep_copy_rests_and_swaps_its_own_layers(capturing):
    model = resting_mlp()
    twin = copy.deepcopy(model)
    capturing(True)
    seen = []
    twin[2].register_forward_pre_hook(lambda module, args: seen.append((type(twin[0]), type(model[0]))))
    twin(torch.randn(3, 16))
    assert seen == [(gnn.Linear, nn.Linear)]


def test_optimize_leaves_a_layer_kept_for_graphs_alone_at_rest_and_hooks_the_model(fake_tuning, monkeypatch):
    """The first layer's GEMM is tuned to cuBLAS with a faster kernel for graphs, the others' to
    Triton; the model's check finds both modes faster."""
    fake_tuning(lambda p: "cublas" if p.k == 16 else "triton_tiled")
    faster = Trial("triton_tiled", {}, Status.OK)
    monkeypatch.setattr(DISPATCHER, "graph_pick", lambda problem, device, chosen: faster if problem.k == 16 else None)
    seen = []

    def speedup(run, forms, **_):
        for form in forms:
            form.to_eager()
        seen.append(type(forms[0].layer))
        return keep.Speedup(1.05, 0.01)

    monkeypatch.setattr(keep, "on_a_gpu", lambda forms: True)
    monkeypatch.setattr(lean, "host_pace", lambda run, forms: lean.Pace(0.0, 0.0))  # GPU-paced: no lean kernels
    monkeypatch.setattr(keep, "speedup", speedup)
    monkeypatch.setattr(keep, "graph_speedup", lambda run, forms, **_: keep.Speedup(1.05, 0.001))
    model = gemmtune.optimize(mlp().eval(), (torch.randn(4, 16),))
    assert seen == [nn.Linear]  # the eager check timed the resting layer in torch's form
    assert type(model[0]) is nn.Linear and model[0].torch_when_capturing is False and type(model[2]) is gnn.Linear
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1


def test_the_eager_check_times_a_graph_only_layer_in_torch_s_form():
    model = gemmtune.optimize(mlp())
    forms = [keep.Form(model[0]), keep.Form(model[2])]
    forms[0].graph_only = True
    seen = []

    def run():
        seen.append((type(model[0]), type(model[1]), type(model[2])))
        return model(torch.randn(4, 16))

    keep.speedup(run, forms, budget_ms=20.0)
    assert (nn.Linear, nn.GELU, gnn.Linear) in seen and (nn.Linear, nn.GELU, nn.Linear) in seen
    assert (gnn.Linear, nn.Identity, gnn.Linear) not in seen
    assert type(model[0]) is gnn.Linear  # left in gemmtune's form, as the check leaves every layer


def test_torch_compile_traces_the_hooks_without_a_graph_break():
    model = resting_mlp()
    explained = torch._dynamo.explain(model)(torch.randn(4, 16))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.gpu
def test_on_the_gpu_a_cuda_graph_of_the_model_replays_gemmtune_s_kernels_for_a_resting_layer(monkeypatch):
    torch.manual_seed(0)
    reference = mlp().to("cuda", torch.bfloat16)
    model = copy.deepcopy(reference)
    x = torch.randn(33, 16, device="cuda", dtype=torch.bfloat16)
    gemmtune.optimize(model, (x,), check=False)  # every layer's kernel tuned and built before the capture
    first = keep.Form(model[0])
    first.graph_only, model[0].torch_when_capturing = True, False
    capture.rest([first], called_by(model, x))
    calls = []
    linear = gnn.api.linear
    monkeypatch.setattr(gnn.api, "linear", lambda *args: calls.append(args[3]) or linear(*args))
    with torch.no_grad():
        model(x)
        eager_calls = list(calls)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(x)  # warm-up, as torch's docs do it
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        expected = reference.float()(x.float())
    assert eager_calls == ["silu", None] and calls[-3:] == ["gelu", "silu", None]
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.GELU
    assert torch.allclose(out.float(), expected, rtol=2e-2, atol=2e-2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=8))
def test_after_any_sequence_of_calls_captured_or_not_failed_or_not_the_layer_is_at_rest(calls):
    """Each call (captured?, fails?) of the model: a call that returns computes the original's
    output; after any call, returned or failed, the layer rests in its torch form and the hooks
    hold no capture open."""
    reference, model = mlp(), resting_mlp()
    hooks = next(iter(model._forward_pre_hooks.values())).__self__
    x = torch.randn(3, 16)
    for captured, fails in calls:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(keep, "capturing", lambda: captured)
            patch.setattr(gnn, "_capturing", lambda: captured)
            if fails:
                patch.setattr(gnn.api, "linear", fail)
                patch.setattr(torch.nn.functional, "linear", fail)
                with pytest.raises(RuntimeError, match="capture failed"):
                    model(x)
            else:
                patch.setattr(gnn.api, "linear", torch_linear)
                assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)
        assert type(model[0]) is nn.Linear and type(model[1]) is nn.GELU and hooks.depth == 0
