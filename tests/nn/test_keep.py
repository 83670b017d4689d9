"""What optimize keeps (gemmtune.nn.keep): a layer tuned to cuBLAS alone goes back to the
nn.Linear it was, its activation module in place; the model check times the two forms and
leaves the layers as gemmtune has them."""

import copy

import pytest
import torch
from torch import nn

import gemmtune
from gemmtune import nn as gnn
from gemmtune.device import Device
from gemmtune.nn import keep, lean
from gemmtune.problem import Problem
from gemmtune.results import Timing, TuneResult
from gemmtune.serving import recording


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 8))


def result(problem: Problem, backend: str, config: dict | None = None) -> TuneResult:
    return TuneResult(problem.key(), "fake-device", backend, config or {}, 1.0, 1.0, 0.1)


def test_each_layer_s_problems_are_seen_per_layer():
    model = gemmtune.optimize(mlp())
    with recording.record(), torch.no_grad(), keep.problems_per_layer(gnn.Linear) as seen:
        model(torch.randn(3, 5, 16))
        model[4](torch.randn(2, 32))  # a second shape of one layer
    assert set(seen) == {model[0], model[2], model[4]}
    assert seen[model[0]] == {Problem(15, 32, 16, "float32", "linear", True, False, "gelu").key()}
    assert seen[model[4]] == {Problem(m, 8, 32, "float32", "linear", True, False, "none").key() for m in (15, 2)}
    assert recording.active() is None


def test_problems_per_layer_needs_a_recording():
    with pytest.raises(RuntimeError, match="record"), keep.problems_per_layer(gnn.Linear):
        pass


def test_a_layer_tuned_to_cublas_alone_goes_back_to_torch(monkeypatch):
    """The first layer's GEMM was tuned to cuBLAS: it is an nn.Linear again with its GELU module
    back; the second's to a Triton kernel: it stays gemmtune's, fused; the third saw two shapes, one
    of them not cuBLAS: it stays too."""
    reference, model = mlp(), gemmtune.optimize(mlp())
    monkeypatch.setattr(gnn, "current", lambda: Device("H100", (9, 0), 132, 232448, 50 << 20))

    def tune(problems, options=None):
        return [result(p, "cublas" if p.n == 32 and p.k == 16 or p.m == 2 else "triton_tiled") for p in problems]

    monkeypatch.setattr(gnn.api, "tune", tune)
    gnn.tune_calls(lambda: (model(torch.randn(3, 16)), model[4](torch.randn(2, 32))))
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.GELU and "activation" not in vars(model[0])
    assert type(model[2]) is gnn.Linear and model[2].activation == "silu" and isinstance(model[3], nn.Identity)
    assert type(model[4]) is gnn.Linear
    assert list(model.state_dict()) == list(reference.state_dict())
    x = torch.randn(7, 16)
    assert torch.allclose(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_a_layer_not_tuned_or_not_called_stays_and_one_that_fell_back_goes():
    layer = gemmtune.optimize(nn.Sequential(nn.Linear(4, 4)))[0]
    forms = [keep.Form(layer)]
    assert keep.served(forms, {layer: {"k"}}, {}) == forms
    assert keep.served(forms, {}, {}) == forms  # not called in the run
    assert type(layer) is gnn.Linear
    assert keep.served(forms, {layer: set()}, {}) == []  # called; every call fell back
    assert type(layer) is nn.Linear


def test_a_layer_tuned_to_cublas_stays_for_graphs_alone_where_they_replay_a_faster_kernel(monkeypatch):
    """Two layers tuned to cuBLAS: the first's tuning found a kernel faster for CUDA graphs (the
    dispatcher pairs them), so it stays gemmtune's with torch's forward for eager calls; the
    second's found none, so it goes back to torch."""
    from gemmtune.results import Status, Trial
    from gemmtune.serving.dispatch import DISPATCHER

    model = gemmtune.optimize(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)))
    first, second = model[0], model[1]
    problems = {first: {Problem(4, 32, 16).key()}, second: {Problem(4, 8, 32).key()}}
    results = {key: result(Problem.from_key(key), "cublas") for keys in problems.values() for key in keys}
    faster = Trial("triton_tiled", {}, Status.OK)
    monkeypatch.setattr(DISPATCHER, "graph_pick",
                        lambda problem, device, chosen: faster if problem.n == 32 and chosen == "cublas" else None)
    forms = [keep.Form(first), keep.Form(second)]
    kept = keep.served(forms, problems, results)
    assert kept == forms[:1] and forms[0].graph_only and first.torch_when_capturing is False
    assert type(first) is gnn.Linear and type(second) is nn.Linear


@pytest.mark.parametrize("kept_any, when, graph_only_stays, other_mode", [
    (True, None, True, None),     # both modes pay
    (True, False, True, False),   # only the graph pays
    (True, True, False, True),    # only eager pays: graphs capture torch's forward
    (False, None, False, None),   # neither
])
def test_settling_keeps_a_graph_only_layer_for_graphs_or_sends_it_back(kept_any, when, graph_only_stays, other_mode):
    model = gemmtune.optimize(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)))
    graph_only, other = keep.Form(model[0]), keep.Form(model[1])
    graph_only.graph_only, model[0].torch_when_capturing = True, False
    settled = keep.settle([graph_only, other], kept_any, when)
    assert (graph_only in settled) == graph_only_stays and (other in settled) == kept_any
    if graph_only_stays:
        assert model[0].torch_when_capturing is False
    else:
        assert type(model[0]) is nn.Linear and "torch_when_capturing" not in vars(model[0])
    if kept_any:
        assert model[1].torch_when_capturing is other_mode


def test_a_layer_whose_calls_fall_back_to_torch_goes_back(monkeypatch):
    """float64 is not a dtype gemmtune serves: the layer's calls fell back to torch in the run."""
    model = gemmtune.optimize(mlp().double())
    monkeypatch.setattr(gnn, "current", lambda: Device("H100", (9, 0), 132, 232448, 50 << 20))
    monkeypatch.setattr(gnn.api, "tune", lambda problems, options=None: [])
    gnn.tune_calls(lambda: model(torch.randn(3, 16, dtype=torch.float64)))
    assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear, nn.SiLU, nn.Linear]


def test_the_check_times_both_forms_and_leaves_gemmtune_s(monkeypatch):
    model = gemmtune.optimize(mlp())
    forms = [keep.Form(layer) for layer in (model[0], model[2], model[4])]
    x = torch.randn(4, 16)
    seen = []

    def run():
        seen.append((type(model[0]), type(model[1]), type(model[3])))
        return model(x)

    measured = keep.speedup(run, forms, budget_ms=50.0)
    assert measured.ratio > 0 and measured.noise >= 0
    assert (gnn.Linear, nn.Identity, nn.Identity) in seen and (nn.Linear, nn.GELU, nn.SiLU) in seen
    assert type(model[0]) is gnn.Linear and isinstance(model[1], nn.Identity) and model[0].activation == "gelu"


def test_released_layers_compute_what_the_original_did():
    reference, model = mlp(), gemmtune.optimize(mlp())
    for layer in (model[0], model[2], model[4]):
        keep.Form(layer).release()
    assert [type(m) for m in model] == [type(m) for m in reference]
    x = torch.randn(3, 16)
    assert torch.equal(model(x), reference(x))
    again = gemmtune.optimize(copy.deepcopy(model))  # and can be optimized anew
    assert again[0].activation == "gelu" and torch.allclose(again(x), reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_on_the_gpu_optimize_keeps_only_what_pays():
    model = mlp().to("cuda", torch.bfloat16)
    reference = copy.deepcopy(model)
    x = torch.randn(33, 16, device="cuda", dtype=torch.bfloat16)
    gemmtune.optimize(model, (x,))
    with torch.no_grad():
        assert torch.allclose(model(x).float(), reference(x).float(), rtol=2e-2, atol=2e-2)
    for layer, act in ((model[0], model[1]), (model[2], model[3])):
        assert (type(layer), type(act)) in {(nn.Linear, type(act)), (gnn.Linear, nn.Identity)}


@pytest.mark.parametrize("marked", [True, False])
def test_a_layer_runs_torch_s_forward_in_the_mode_it_is_marked_for(monkeypatch, marked):
    model = gemmtune.optimize(mlp())
    layer, x = model[0], torch.randn(3, 16)
    ran = []
    monkeypatch.setattr(gnn.api, "linear", lambda *args: ran.append("gemmtune") or torch.zeros(3, 32))
    expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, layer.weight, layer.bias))
    for capturing in (True, False):  # not marked: gemmtune's, captured or not
        monkeypatch.setattr(gnn, "_capturing", lambda capturing=capturing: capturing)
        layer(x)
    assert ran == ["gemmtune"] * 2
    layer.torch_when_capturing = marked
    for capturing in (True, False):
        monkeypatch.setattr(gnn, "_capturing", lambda capturing=capturing: capturing)
        out = layer(x)
        if capturing == marked:
            assert torch.equal(out, expected)
    assert ran == ["gemmtune"] * 3  # the other mode's call only
    keep.Form(layer).release()
    assert "torch_when_capturing" not in vars(layer)


S = keep.Speedup


@pytest.mark.parametrize("eager, graph, kept, when", [
    (S(1.02, 0.01), S(1.10, 0.001), True, None), (S(1.02, 0.0), None, True, None),
    (S(1.0, 0.0), S(1.0, 0.0), True, None),
    (S(1.02, 0.01), S(0.98, 0.001), True, True),  # graphs capture torch's forward
    (S(0.97, 0.02), S(1.07, 0.001), True, False),  # eager calls run torch's
    (S(1.01, 0.08), S(1.02, 0.001), True, False),  # an eager gain within its noise is no gain: graph-only
    (S(1.01, 0.08), None, False, None), (S(0.97, 0.0), S(1.0, 0.0), False, None),
    (S(0.97, 0.0), S(1.001, 0.002), False, None), (S(0.97, 0.0), S(0.95, 0.0), False, None),
])
def test_the_check_keeps_the_layers_where_either_mode_pays_beyond_its_noise(eager, graph, kept, when):
    words, kept_any, torch_when_capturing = keep.decide(eager, graph)
    assert (kept_any, torch_when_capturing) == (kept, when)
    assert words.startswith(f"eager {eager.ratio:.2f}x +-{eager.noise:.2f}")
    assert ("goes back to torch" in words) == (not kept)


@pytest.mark.parametrize("readings, expected", [
    ([(1.05, 0.09), (1.13, 0.02)], S(1.13, 0.02, retimed=True)),  # undecided, then timed again: the second decides
    ([(1.05, 0.09), (0.98, 0.02)], S(0.98, 0.02, retimed=True)),
    ([(0.86, 0.10), (1.16, 0.01)], S(1.16, 0.01, retimed=True)),  # slower, within twice its noise
    ([(1.13, 0.02)], S(1.13, 0.02)), ([(0.94, 0.02)], S(0.94, 0.02)),  # decided at once: timed once
])
def test_an_undecided_eager_reading_is_timed_once_more_and_the_second_decides(monkeypatch, readings, expected):
    """Each reading as ``measure.loops`` would give it: rounds whose per-round ratio (torch's time
    over gemmtune's) has the reading's median and half inter-quartile range."""
    def rounds(ratio, noise):
        return {"gemmtune": Timing((1.0,) * 8), "torch": Timing((ratio - 2 * noise, ratio - noise, ratio - noise,
                                                                 ratio, ratio, ratio + noise, ratio + noise,
                                                                 ratio + 2 * noise))}

    timed = [rounds(*reading) for reading in readings]
    monkeypatch.setattr(keep.measure, "loops", lambda fns, device, budget_ms, enter: timed.pop(0))
    found = keep.speedup(lambda: None, [])
    assert not timed, "every reading taken, and no more"
    assert found.retimed == expected.retimed and found.ratio == pytest.approx(expected.ratio, abs=1e-9)
    assert found.noise == pytest.approx(expected.noise, rel=0.35)
    assert ("timed twice" in str(found)) == expected.retimed


@pytest.mark.gpu
def test_on_the_gpu_the_graph_check_times_both_forms_or_says_it_cannot():
    model = gemmtune.optimize(mlp().to("cuda", torch.bfloat16))
    forms = [keep.Form(layer) for layer in (model[0], model[2], model[4])]
    x = torch.randn(33, 16, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        model(x)  # the kernels are tuned and built before any capture
        assert keep.graph_speedup(lambda: model(x), forms, budget_ms=50.0).ratio > 0
        assert keep.graph_speedup(lambda: model(x).sum().item(), forms, budget_ms=50.0) is None  # a host sync
    assert type(model[0]) is gnn.Linear and isinstance(model[1], nn.Identity)


def test_optimize_leaves_a_training_model_s_running_statistics_and_random_streams_as_they_were():
    """The example's runs (one here, dozens in the check on a GPU) must not train a BatchNorm's
    statistics toward the example batch nor move the random streams dropout draws from."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.Linear(32, 8)).train()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    example = torch.randn(64, 16) * 3 + 5
    rng = torch.get_rng_state()
    gemmtune.optimize(model, (example,))
    after = dict(model.named_buffers())
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert torch.equal(torch.get_rng_state(), rng)
    model(torch.randn(4, 16))  # the model's own runs still train its statistics
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    assert int(model[1].num_batches_tracked) == 1


@pytest.mark.parametrize("train, kept", [(S(1.02, 0.01), True), (S(1.0, 0.0), True), (S(1.01, 0.02), False),
                                         (S(0.92, 0.01), False)])
def test_a_training_step_must_pay_beyond_its_noise_too(train, kept):
    words, kept_any = keep.decide_training("eager 1.05x +-0.01", train)
    assert kept_any == kept and words.startswith(f"eager 1.05x +-0.01, train step {train}")
    assert ("goes back to torch" in words) == (not kept)


@pytest.mark.parametrize("train, kept", [(S(0.92, 0.01), False), (S(1.05, 0.01), True)])
def test_optimize_of_a_training_model_times_a_train_step_and_keeps_the_layers_only_where_it_pays(
        fake_tuning, monkeypatch, train, kept):
    """The check's eager verdict pays; the train step (its backward's GEMMs tuned first) decides.
    The user's gradients are neither added to nor lost."""
    tuned = fake_tuning(lambda p: "triton_tiled")
    timed = []

    def speedup(run, forms, **_):
        timed.append(torch.is_grad_enabled())
        return S(1.05, 0.01) if len(timed) == 1 else train

    monkeypatch.setattr(keep, "on_a_gpu", lambda forms: True)
    monkeypatch.setattr(lean, "host_pace", lambda run, forms: lean.Pace(0.0, 0.0))  # GPU-paced: no lean kernels
    monkeypatch.setattr(keep, "speedup", speedup)
    monkeypatch.setattr(keep, "graph_speedup", lambda run, forms, **_: None)
    model = mlp().train()
    grad = torch.randn(32, 16)
    model[0].weight.grad = grad
    gemmtune.optimize(model, (torch.randn(4, 16),))
    assert timed == [False, True]  # the forward without gradients, then the train step
    forward = {Problem(4, n, k, "float32", "linear", True, False, act).key()
               for n, k, act in ((32, 16, "gelu"), (32, 32, "silu"), (8, 32, "none"))}
    assert forward < {p.key() for p in tuned}  # and the backward's GEMMs besides
    assert len({p.key() for p in tuned} - forward) >= 3
    assert (type(model[0]) is gnn.Linear) == kept and (type(model[1]) is nn.GELU) == (not kept)
    assert model[0].weight.grad is grad and all(p.grad is None for p in list(model.parameters())[1:])


def test_a_model_in_eval_mode_or_without_gradients_times_no_train_step(fake_tuning, monkeypatch):
    fake_tuning(lambda p: "triton_tiled")
    timed = []
    monkeypatch.setattr(keep, "on_a_gpu", lambda forms: True)
    monkeypatch.setattr(lean, "host_pace", lambda run, forms: lean.Pace(0.0, 0.0))  # GPU-paced: no lean kernels
    monkeypatch.setattr(keep, "speedup", lambda run, forms, **_: timed.append(1) or S(1.05, 0.01))
    monkeypatch.setattr(keep, "graph_speedup", lambda run, forms, **_: None)
    gemmtune.optimize(mlp().eval(), (torch.randn(4, 16),))
    frozen = mlp().train().requires_grad_(False)
    gemmtune.optimize(frozen, (torch.randn(4, 16),))
    with torch.no_grad():
        gemmtune.optimize(mlp().train(), (torch.randn(4, 16),))
    assert timed == [1, 1, 1]


def test_a_train_step_that_fails_leaves_the_forward_s_verdict_with_a_warning(fake_tuning, monkeypatch, caplog):
    fake_tuning(lambda p: "triton_tiled")
    calls = []

    def speedup(run, forms, **_):
        calls.append(1)
        if len(calls) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return S(1.05, 0.01)

    monkeypatch.setattr(keep, "on_a_gpu", lambda forms: True)
    monkeypatch.setattr(lean, "host_pace", lambda run, forms: lean.Pace(0.0, 0.0))  # GPU-paced: no lean kernels
    monkeypatch.setattr(keep, "speedup", speedup)
    monkeypatch.setattr(keep, "graph_speedup", lambda run, forms, **_: None)
    model = mlp().train()
    with caplog.at_level("WARNING", logger="gemmtune"):
        gemmtune.optimize(model, (torch.randn(4, 16),))
    assert type(model[0]) is gnn.Linear and len(calls) == 2
    assert "a train step on the example failed (OutOfMemoryError" in caplog.text


@pytest.mark.parametrize("train, kept", [(None, True), (S(0.9, 0.01), False)])
def test_where_lean_kernels_serve_the_run_every_layer_stays_for_the_check_s_verdict(
        fake_tuning, lean_calls, monkeypatch, caplog, train, kept):
    """Every GEMM tuned to cuBLAS, which alone would send each layer back to torch; the first
    layer's GEMM has a lean kernel serving its eager calls: that layer stays, and goes back (the
    kernel dropped) only where the check's verdict says so; the others go back."""
    fake_tuning(lambda p: "cublas")
    first = Problem(4, 32, 16, "float32", "linear", True, False, "gelu")
    found = lean.Lean({first: None}, 0, S(1.15, 0.02))
    monkeypatch.setattr(lean, "tried", lambda run, forms, layer_problems, results, calls: (found, f"paced: {found}"))
    monkeypatch.setattr(keep, "speedup", lambda run, forms, **_: pytest.fail("eager timed twice"))
    monkeypatch.setattr(keep, "graph_speedup", lambda run, forms, **_: S(1.0, 0.001))
    model = mlp()
    if train is not None:
        model.train()
        monkeypatch.setattr(gnn, "_train_speedup", lambda step, forms: train)
    else:
        model.eval()
    with caplog.at_level("INFO", logger="gemmtune"):
        gemmtune.optimize(model, (torch.randn(4, 16),))
    assert (type(model[0]) is gnn.Linear) == kept and type(model[4]) is nn.Linear and type(model[2]) is nn.Linear
    assert "paced: the eager calls of 1 GEMM on Triton kernels" in caplog.text and "eager 1.15x +-0.02" in caplog.text
    assert lean_calls == ([] if kept else [("drop", {first})])


def test_a_layer_whose_gemm_runs_a_lean_kernel_in_eager_counts_as_served():
    model = gemmtune.optimize(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)))
    first, second = Problem(4, 32, 16, bias=True), Problem(4, 8, 32, bias=True)
    problems = {model[0]: {first.key()}, model[1]: {second.key()}}
    results = {p.key(): result(p, "cublas") for p in (first, second)}
    forms = [keep.Form(model[0]), keep.Form(model[1])]
    kept = keep.served(forms, problems, results, {first.key()})
    assert kept == forms[:1] and not forms[0].graph_only and model[0].torch_when_capturing is None
    assert type(model[0]) is gnn.Linear and type(model[1]) is nn.Linear


def test_a_layer_that_costs_the_host_nothing_extra_stays_served_where_its_choice_reads_level(monkeypatch):
    """A plain layer's served call costs the host nothing beyond its GEMMs' (``eager_host_us`` 0):
    a choice whose final rounds read a hair slower than cuBLAS's (within noise: a negative gain)
    leaves it served in both modes; its GEMMs' gain is not even read."""
    from gemmtune.results import Status, Trial
    from gemmtune.serving.dispatch import DISPATCHER

    model = gemmtune.optimize(nn.Sequential(nn.Linear(16, 32)))
    problem = Problem(4, 32, 16, bias=True)
    read = []
    trials = [Trial("cublas", {}, Status.OK, timing=Timing((0.0100,) * 24)),
              Trial("triton_tiled", {"n": 1}, Status.OK, timing=Timing((0.0101,) * 24))]
    monkeypatch.setattr(DISPATCHER, "trials", lambda p, device: read.append(p) or trials)
    results = {problem.key(): result(problem, "triton_tiled", {"n": 1})}
    assert keep.eager_gain_us({problem.key()}, results) < 0
    read.clear()
    form = keep.Form(model[0])
    assert keep.served([form], {model[0]: {problem.key()}}, results) == [form]
    assert not form.graph_only and model[0].torch_when_capturing is None and read == []
