"""Misaligned layers stored padded (gemmtune.nn.padded): which layers, outputs and parameters
unchanged, the padded GEMM recorded, and every way the parameters can change under it."""

import copy

import pytest
import torch
from torch import nn

import gemmtune
from gemmtune import nn as gnn
from gemmtune.device import Device
from gemmtune.nn import padded as aligned
from gemmtune.problem import Problem
from gemmtune.results import Timing


@pytest.fixture
def on_cpu(monkeypatch):
    """Padding applies to CUDA layers only, and where measured faster (or by the rule, from
    MIN_ROWS rows); these tests take the CPU for one, and the padded GEMM at any number of rows."""
    monkeypatch.setattr(aligned, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(aligned, "MIN_ROWS", 1)
    monkeypatch.setattr(aligned, "MIN_ROWS_K_ODD", 1)
    monkeypatch.setattr(aligned, "current", lambda: Device("H100", (9, 0), 132, 232448, 50 << 20))
    monkeypatch.setattr(aligned.measure, "measure", lambda ways, device, **kwargs: {
        "plain": Timing((2.0,) * 10), "padded": Timing((1.0,) * 10)})
    monkeypatch.setattr(aligned.measure, "host_rounds", lambda ways, device, **kwargs: host_times(ways, 0.5, 0.5))


def host_times(ways, plain_ms: float, padded_ms: float) -> dict:
    """What ``measure.host_rounds`` returns for the two ways: each a loop's and the host's own
    milliseconds per call (the loop's are not read)."""
    ms = {"plain": plain_ms, "padded": padded_ms}
    return {way: (Timing((ms[way],) * 5), Timing((ms[way],) * 5)) for way in ways}


def model(bias=True):
    torch.manual_seed(0)  # K = 13 and N = 7 leave rows of 52 and 28 bytes in float32
    return nn.Sequential(nn.Linear(13, 7, bias=bias), nn.ReLU(), nn.Linear(7, 16), nn.Linear(16, 12))


def test_misaligned_layers_are_stored_padded(on_cpu):
    reference, optimized = model(), gemmtune.optimize(model())
    first, second, third = optimized[0], optimized[2], optimized[3]
    assert type(first) is gnn.AlignedLinear and first.activation == "relu"
    assert type(second) is gnn.AlignedLinear and type(third) is gnn.Linear  # 16 x 12: aligned already
    assert first.aligned.weight.shape == (8, 16) and second.aligned.weight.shape == (16, 8)
    assert first.weight.shape == (7, 13) and first.weight.stride() == (16, 1)
    assert torch.equal(first.aligned.weight[7:], torch.zeros(1, 16)) and not first.aligned.weight[:, 13:].any()
    assert list(optimized.state_dict()) == list(reference.state_dict())
    for p, q in zip(reference.parameters(), optimized.parameters()):
        assert torch.equal(p, q)
    x = torch.randn(3, 5, 13)
    assert torch.allclose(optimized(x), reference(x), rtol=1e-5, atol=1e-6)
    assert "stored padded to (8, 16)" in repr(first)


def test_only_cuda_layers_and_only_when_asked():
    assert type(gemmtune.optimize(model())[0]) is gnn.Linear  # a CPU layer gains nothing from it


def test_no_alignment_when_asked(on_cpu):
    assert type(gemmtune.optimize(model(), align=False)[0]) is gnn.Linear


def test_both_ways_of_a_misaligned_layer_are_tuned(on_cpu, monkeypatch):
    tuned = []
    monkeypatch.setattr(gnn, "current", lambda: Device("H100", (9, 0), 132, 232448, 50 << 20))
    monkeypatch.setattr(gnn.api, "tune", lambda problems, options=None: tuned.extend(problems) or [])
    gemmtune.optimize(model(bias=False), (torch.randn(4, 13),))
    assert sorted(tuned, key=lambda p: (p.n, p.k)) == [
        Problem(4, 7, 13, "float32", "linear", False, False, "relu"),  # 13 -> 7 as it is, and padded
        Problem(4, 8, 16, "float32", "linear", False, False, "relu"),
        Problem(4, 12, 16, "float32", "linear", True, False, "none"),  # 16 -> 12: aligned
        Problem(4, 16, 7, "float32", "linear", True, False, "none"),   # 7 -> 16 as it is, K padded
        Problem(4, 16, 8, "float32", "linear", True, False, "none"),
    ]


def test_where_nothing_can_be_measured_the_rule_serves(on_cpu, monkeypatch):
    monkeypatch.setattr(aligned, "MIN_ROWS", 65)
    monkeypatch.setattr(aligned, "MIN_ROWS_K_ODD", 2)
    torch.manual_seed(0)
    optimized = gemmtune.optimize(nn.Sequential(nn.Linear(13, 16), nn.Linear(16, 7)))  # K odd, then N odd
    for layer, padded in zip(optimized, ([False, True, True, True], [False, False, False, True])):
        rule = [layer.aligned._choose(layer, torch.randn(rows, layer.in_features), rows, compiling=True)
                for rows in (1, 2, 64, 65)]
        assert rule == padded and layer.aligned.padded_for == {}


def test_the_first_call_of_each_row_count_measures_both_ways(on_cpu, monkeypatch):
    measured, verdict = [], {"padded_ms": 1.0}

    def measure(ways, device, **kwargs):
        measured.append(sorted(ways))
        samples = {"plain": (2.0,) * 10, "padded": (verdict["padded_ms"],) * 10}
        return {way: Timing(samples[way]) for way in ways}

    monkeypatch.setattr(aligned.measure, "measure", measure)
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")  # serving measures too: it never tunes, but may time
    torch.manual_seed(0)
    reference = nn.Linear(13, 7, bias=False)
    optimized = gemmtune.optimize(copy.deepcopy(reference))
    with torch.no_grad():
        for rows, padded_ms in ((4, 1.0), (4, 3.0), (9, 3.0), (9, 1.0)):
            verdict["padded_ms"] = padded_ms  # what a later measurement would say: none is taken
            x = torch.randn(rows, 13)
            assert torch.allclose(optimized(x), reference(x), rtol=1e-5, atol=1e-6)
    assert optimized.aligned.padded_for == {4: True, 9: False} and measured == [["padded", "plain"]] * 2
    with gemmtune.record() as seen, torch.no_grad():  # nothing measured while recording: the rule, and
        x = torch.randn(70, 13)                       # the other way recorded too
        assert torch.allclose(optimized(x), reference(x), rtol=1e-5, atol=1e-6)
    assert 70 not in optimized.aligned.padded_for
    assert sorted((p.m, p.n, p.k) for p, _ in seen.problems()) == [(70, 7, 13), (70, 8, 16)]


def test_a_way_costs_the_longer_of_its_gpu_and_its_host_time(on_cpu, monkeypatch):
    """The padded GEMM faster on the GPU (1 ms against 2) but dearer on the host (3 ms a call
    against 0.5): queued, it costs 3, so the plain layer is kept; where its host time is 1.5 it
    still wins (1.5 against 2); where the plain layer's host time (2.5) is longer than its GPU
    time, the plain layer costs 2.5 and the padded GEMM is kept."""
    host = {}
    monkeypatch.setattr(aligned.measure, "host_rounds", lambda ways, device, **kwargs: host_times(ways, *host["ms"]))
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    torch.manual_seed(0)
    reference = nn.Linear(13, 7, bias=False)
    optimized = gemmtune.optimize(copy.deepcopy(reference))
    with torch.no_grad():
        for rows, ms in ((4, (0.5, 3.0)), (5, (0.5, 1.5)), (6, (2.5, 0.5))):
            host["ms"] = ms
            x = torch.randn(rows, 13)
            assert torch.allclose(optimized(x), reference(x), rtol=1e-5, atol=1e-6)
    assert optimized.aligned.padded_for == {4: False, 5: True, 6: True}


def test_in_place_updates_reach_the_padded_weight(on_cpu):
    reference, optimized = model(), gemmtune.optimize(model())
    x = torch.randn(4, 13)
    with torch.no_grad():
        for p, q in zip(reference.parameters(), optimized.parameters()):
            p.mul_(1.5)
            q.mul_(1.5)
    assert torch.allclose(optimized(x), reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change", ["assign", "data", "dtype"])
def test_parameters_replaced_run_the_plain_layer(on_cpu, change):
    reference, optimized = model(), gemmtune.optimize(model())
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.25)
    layer = optimized[0]
    if change == "assign":
        optimized.load_state_dict(reference.state_dict(), assign=True)
    elif change == "data":
        for p, q in zip(reference.parameters(), optimized.parameters()):
            q.data = p.detach().clone()
    else:
        reference.double()
        optimized.double()  # each parameter gets new storage of its own
        with torch.no_grad():
            for q in optimized.parameters():
                q.add_(0.25)
    assert layer.aligned.output(layer, torch.randn(2, 13, dtype=layer.weight.dtype)) is None
    x = torch.randn(4, 13, dtype=layer.weight.dtype)
    assert torch.allclose(optimized(x), reference(x), rtol=1e-5, atol=1e-6)


def test_gradients_match_the_original_model(on_cpu):
    reference, optimized = model(), gemmtune.optimize(model())
    x = torch.randn(5, 13)
    reference(x).square().sum().backward()
    optimized(x).square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), optimized.parameters()):
        assert q.grad.shape == p.shape and torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_traced_by_torch_compile(on_cpu):
    reference, optimized = model(), gemmtune.optimize(model())
    compiled = torch.compile(optimized, backend="aot_eager", fullgraph=True)
    x = torch.randn(6, 13)
    other = model()
    with torch.no_grad():
        assert torch.allclose(compiled(x), reference(x), rtol=1e-5, atol=1e-6)
        for p in other.parameters():
            p.mul_(2)
        optimized.load_state_dict(other.state_dict(), assign=True)  # seen inside the compiled graph too
        assert torch.allclose(compiled(x), other(x), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_padded_layers_on_the_gpu(dtype):
    """Every layer misaligned in K, N or both, tuned from an example and checked against float64."""
    from gemmtune.tuning import verify

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4100, 1003), nn.SiLU(), nn.Linear(1003, 33), nn.Linear(33, 4096),
                           nn.Linear(4096, 1003))  # K and N odd, K odd twice, then N odd alone
    layers = layers.to("cuda", dtype)
    reference = copy.deepcopy(layers).double()
    xs = [torch.randn(rows, 4100, device="cuda", dtype=dtype) for rows in (7, 1, 33, 65, 777)]
    gemmtune.optimize(layers)
    # one run over every row count, tuned as optimize tunes its example: candidates compiled together
    gnn.tune_calls(lambda: [layers(x) for x in xs], check=False)
    assert [type(layer) for layer in layers] == [gnn.AlignedLinear, nn.Identity] + [gnn.AlignedLinear] * 3
    with torch.no_grad():
        for x in xs:
            out = layers(x)
            assert out.shape == (len(x), 1003) and out.is_contiguous()
            assert verify.rel_err(out, reference(x.double())) < 2e-2, len(x)


@pytest.mark.gpu
def test_padded_layers_under_torch_compile_and_cuda_graphs():
    """The padded path as traced (torch's pad and slice in place of the copy kernels), inside
    reduce-overhead's CUDA graphs."""
    from gemmtune.tuning import verify

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4100, 1003), nn.ReLU(), nn.Linear(1003, 4096)).to("cuda", torch.bfloat16)
    reference = copy.deepcopy(layers).double()
    x = torch.randn(96, 4100, device="cuda", dtype=torch.bfloat16)
    gemmtune.optimize(layers, (x,), check=False)
    compiled = torch.compile(layers, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(x)
        assert verify.rel_err(out, reference(x.double())) < 2e-2
