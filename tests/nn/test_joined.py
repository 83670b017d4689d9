"""Sibling layers (gemmtune.nn.joined): which layers the example run joins, outputs unchanged,
parameters kept, and every call that the joined GEMM cannot serve running alone."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemmtune
from gemmtune import api
from gemmtune import nn as gnn
from gemmtune.nn import joined as siblings
from gemmtune.serving import calls as serving_calls


class Block(nn.Module):
    """A Llama layer's GEMMs in miniature: q, k and v on one input, gate and up on another."""

    def __init__(self, bias: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(16, 16, bias=bias), nn.Linear(16, 8, bias=bias), nn.Linear(16, 8, bias=bias)
        self.gate, self.up, self.down = nn.Linear(16, 32, bias=bias), nn.Linear(16, 32, bias=bias), nn.Linear(32, 16)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = x + q + torch.cat([k, v], -1) * q.sigmoid()
        return self.down(F.silu(self.gate(h)) * self.up(h))


def counted_linear(monkeypatch) -> list:
    calls = []
    real = api.linear
    monkeypatch.setattr(api, "linear", lambda x, w, b=None, act=None: calls.append(tuple(w.shape)) or real(x, w, b, act))
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_the_example_run_joins_siblings_and_outputs_stay(bias, monkeypatch):
    reference, model = Block(bias), Block(bias)
    params = list(model.parameters())
    gemmtune.optimize(model, (torch.randn(2, 3, 16),), siblings=True, check=False)
    assert model.q.siblings is model.k.siblings is model.v.siblings and model.q.siblings.layers == (model.q, model.k,
                                                                                                      model.v)
    assert model.gate.siblings is model.up.siblings and type(model.down) is gnn.Linear
    assert {type(layer) for layer in (model.q, model.k, model.v, model.gate, model.up)} == {gnn.JoinedLinear}
    assert list(model.parameters()) == params and list(model.state_dict()) == list(reference.state_dict())
    joined = model.q.siblings.weight
    assert joined.shape == (32, 16) and model.k.weight.data_ptr() == joined.data_ptr() + 16 * 16 * 4
    calls = counted_linear(monkeypatch)
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)
    assert calls == [(32, 16), (64, 16), (16, 32)]  # q|k|v, gate|up, down: three GEMMs, not six


def test_calls_on_many_rows_run_each_layer_alone(monkeypatch):
    model = Block()
    gemmtune.optimize(model, (torch.randn(4, 16),), siblings=True, check=False)
    calls = counted_linear(monkeypatch)
    x = torch.randn(siblings.MAX_ROWS + 1, 16)
    with torch.no_grad():
        assert torch.allclose(model(x), Block()(x), rtol=1e-5, atol=1e-6)
    assert len(calls) == 6


def test_a_weight_updated_in_place_updates_the_joined_one():
    model = Block()
    gemmtune.optimize(model, (torch.randn(4, 16),), siblings=True, check=False)
    with torch.no_grad():
        model.k.weight.mul_(2)
        x = torch.randn(3, 16)
        assert torch.allclose(model.k(x), F.linear(x, model.k.weight))
        assert torch.allclose(model.q.siblings.weight[16:24], model.k.weight)


def test_calls_the_joined_gemm_cannot_serve_run_alone():
    model = Block()
    gemmtune.optimize(model, (torch.randn(4, 16),), siblings=True, check=False)
    q, k, v = model.q, model.k, model.v
    x = torch.randn(3, 16)
    with torch.no_grad():
        q(x)
        x.add_(1)  # changed in place since q's call: k must not take q's stale result
        assert torch.allclose(k(x), F.linear(x, k.weight))
        q(x)
        other = torch.randn(3, 16)
        assert torch.allclose(v(other), F.linear(other, v.weight))  # another input
        q(x)
        k.weight.mul_(3)  # in place, between q's call and k's
        assert torch.allclose(k(x), F.linear(x, k.weight))
        k.weight.data = k.weight.data.clone()  # no longer a view of the joined weight
        k.weight.mul_(3)
        q(x)
        assert torch.allclose(k(x), F.linear(x, k.weight))
        assert torch.allclose(q(x), F.linear(x, q.weight)) and torch.allclose(v(x), F.linear(x, v.weight))


def test_gradients_go_to_each_layer_as_without_siblings():
    reference, model = Block(), Block()
    gemmtune.optimize(model, (torch.randn(4, 16),), siblings=True, check=False)
    x = torch.randn(6, 16)
    reference(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_only_layers_always_called_together_are_joined():
    a, b, c = (gnn.Linear(8, 8) for _ in range(3))
    assert siblings.groups([(a, False), (b, True), (c, True), (a, False), (b, True), (c, True)]) == [(a, b, c)]
    assert siblings.groups([(a, False), (b, True), (c, False)]) == [(a, b)]
    assert siblings.groups([(a, False), (b, True), (b, False)]) == []  # b also called alone
    assert siblings.groups([(a, False), (b, True), (b, True)]) == []  # and b twice on one input
    wide = gnn.Linear(4, 8)
    assert siblings.groups([(a, False), (wide, True)]) == []  # another K: nothing to join


def test_siblings_need_example_inputs():
    with pytest.raises(ValueError, match="example_inputs"):
        gemmtune.optimize(Block(), siblings=True)


def test_torch_compile_traces_the_layers_as_torch_s(monkeypatch):
    """While torch.compile traces them, joined layers are the nn.Linear layers they stand for:
    the compiler chooses their GEMMs, and no gemmtune op is in the graph."""
    reference, model = Block(), Block()
    gemmtune.optimize(model, (torch.randn(4, 16),), siblings=True, check=False)
    assert type(model.q) is gnn.JoinedLinear
    ran = []
    real = serving_calls.linear_forward
    monkeypatch.setattr(serving_calls, "linear_forward", lambda x, w, b, act: ran.append(tuple(w.shape)) or real(x, w, b, act))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert torch.allclose(compiled(x), reference(x), rtol=1e-5, atol=1e-6)
    assert ran == []
    assert model.q.siblings._pending is None


@pytest.mark.gpu
def test_on_the_gpu_joined_siblings_match_the_original_eager_and_compiled():
    from gemmtune.tuning import verify

    reference = Block().to("cuda", torch.bfloat16)
    model = Block().to("cuda", torch.bfloat16)
    x = torch.randn(2, 7, 16, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference.double()(x.double())
        gemmtune.optimize(model, (x,), siblings=True, check=False)
        assert model.q.siblings is not None and model.gate.siblings is not None
        assert verify.rel_err(model(x), expected) < 2e-2
        compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):  # recorded as a CUDA graph, then replayed
            assert verify.rel_err(compiled(x), expected) < 2e-2


@pytest.mark.parametrize("compiled", [False, True])
def test_parameters_replaced_or_converted_after_joining_run_alone(compiled):
    """load_state_dict(assign=True) puts new parameters in place, .to() converts them: the joined
    tensors are stale then, and neither eager calls nor a compiled graph may use them."""
    model = Block()
    gemmtune.optimize(model, (torch.randn(4, 16),), siblings=True, check=False)
    fresh = Block()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(-2)
    model.load_state_dict(fresh.state_dict(), assign=True)
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert torch.allclose(run(x), fresh(x), rtol=1e-5, atol=1e-6)
        model.to(torch.float64)
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        assert torch.allclose(run(x.double()), fresh.double()(x.double()), rtol=1e-6, atol=1e-8)


def test_under_inference_mode_each_layer_runs_alone_and_outputs_stay(monkeypatch):
    """An inference tensor keeps no version counter, so a change between sibling calls could not
    be seen: each layer runs alone (reading the counter used to raise)."""
    reference, model = Block(), Block()
    gemmtune.optimize(model, (torch.randn(2, 16),), siblings=True, check=False)
    assert type(model.q) is gnn.JoinedLinear
    calls = counted_linear(monkeypatch)
    with torch.inference_mode():
        x = torch.randn(3, 16)
        assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)
    assert calls == [(16, 16), (8, 16), (8, 16), (32, 16), (32, 16), (16, 32)]


def test_an_example_run_under_inference_mode_joins_nothing():
    model = Block()
    with torch.inference_mode():
        gemmtune.optimize(model, (torch.randn(2, 16),), siblings=True, check=False)
    assert type(model.q) is gnn.Linear
