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
from gemmtune.nn import keep
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
    monkeypatch.setattr(keep, "host_pace", lambda run, forms: keep.Pace(0.0, 0.0))  # GPU-paced: no lean kernels
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
    monkeypatch.setattr(keep, "host_pace", lambda run, forms: keep.Pace(0.0, 0.0))  # GPU-paced: no lean kernels
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
    monkeypatch.setattr(keep, "host_pace", lambda run, forms: keep.Pace(0.0, 0.0))  # GPU-paced: no lean kernels
    monkeypatch.setattr(keep, "speedup", speedup)
    monkeypatch.setattr(keep, "graph_speedup", lambda run, forms, **_: None)
    model = mlp().train()
    with caplog.at_level("WARNING", logger="gemmtune"):
        gemmtune.optimize(model, (torch.randn(4, 16),))
    assert type(model[0]) is gnn.Linear and len(calls) == 2
    assert "a train step on the example failed (OutOfMemoryError" in caplog.text


@pytest.fixture
def lean_calls(monkeypatch):
    """The dispatcher's lean serving recorded, not done: ('serve', problems) and ('drop', problems)."""
    from gemmtune.serving.dispatch import DISPATCHER

    calls = []
    monkeypatch.setattr(DISPATCHER, "serve_lean", lambda picks, index: calls.append(("serve", set(picks))))
    monkeypatch.setattr(DISPATCHER, "drop_lean", lambda problems, index: calls.append(("drop", set(problems))))
    monkeypatch.setattr(keep, "on_a_gpu", lambda forms: True)
    monkeypatch.setattr(keep, "device_index", lambda forms: 0)
    return calls


@pytest.mark.parametrize("bound, picked, room, eager, served", [
    (False, True, True, S(1.2, 0.01), False),  # the GPU paces the run: nothing tried
    (True, False, True, S(1.2, 0.01), False),  # no GEMM has a lean kernel
    (True, True, False, S(1.2, 0.01), False),  # its extra GPU time does not fit the GPU's room
    (True, True, True, S(1.0, 0.02), False),   # tried, and not faster beyond the noise: dropped
    (True, True, True, S(1.15, 0.03), True),
])
def test_lean_kernels_serve_a_host_bound_run_s_eager_calls_only_where_it_measures_faster(
        lean_calls, monkeypatch, bound, picked, room, eager, served):
    model = gemmtune.optimize(mlp())
    forms = [keep.Form(model[0]), keep.Form(model[2])]
    problem = Problem(4, 32, 16, "float32", "linear", True, False, "gelu")
    picks = {problem: object()} if picked else {}
    monkeypatch.setattr(keep, "host_pace", lambda run, forms: keep.Pace(0.97 if bound else 0.6, 4.0))
    monkeypatch.setattr(keep, "lean_picks", lambda layer_problems, results: picks)
    monkeypatch.setattr(keep, "gpu_ms", lambda run, forms, host_ms: 2.0)  # a room of 2 ms: 1 ms to take
    monkeypatch.setattr(keep, "extra_ms", lambda picks, results: {p: 0.1 if room else 0.3 for p in picks})
    timed = []
    monkeypatch.setattr(keep, "speedup", lambda run, forms: timed.append(list(forms)) or eager)
    found, said = keep.lean(lambda: None, forms, {}, {}, {problem.key(): 8})
    assert (found is not None) == served
    assert said.startswith("the host paces the eager run (0.97 of its wall time") == bound and (said == "") != bound
    assert ("no GEMM has a Triton finalist" in said) == (bound and not picked)
    assert ("4.00 ms of host work for 2.00 ms of GPU work" in said) == (bound and picked)
    assert ("too little room on the GPU" in said) == (bound and picked and not room)
    assert ("so they go" in said) == (bound and picked and room and not served)
    tried = bound and picked and room
    assert timed == ([forms] if tried else [])
    dropped = [("drop", {problem})] if tried and not served else []
    assert lean_calls == ([("serve", {problem})] if tried else []) + dropped
    if served:
        assert found.eager == eager and "eager calls of 1 GEMM on Triton kernels" in str(found)


def test_without_torch_s_sleep_kernel_the_room_is_unknown_and_every_lean_kernel_is_tried(lean_calls, monkeypatch):
    model = gemmtune.optimize(mlp())
    forms = [keep.Form(model[0]), keep.Form(model[2])]
    problem = Problem(4, 32, 16, "float32", "linear", True, False, "gelu")
    monkeypatch.delattr(torch.cuda, "_sleep", raising=False)
    monkeypatch.setattr(keep, "host_pace", lambda run, forms: keep.Pace(0.97, 4.0))
    monkeypatch.setattr(keep, "lean_picks", lambda layer_problems, results: {problem: object()})
    monkeypatch.setattr(keep, "extra_ms", lambda picks, results: pytest.fail("no room to weigh"))
    monkeypatch.setattr(keep, "speedup", lambda run, forms: S(1.15, 0.03))
    assert keep.gpu_ms(lambda: None, forms, 4.0) is None
    found, said = keep.lean(lambda: None, forms, {}, {}, {problem.key(): 8})
    assert found is not None and lean_calls == [("serve", {problem})]
    assert said.startswith("the host paces the eager run (0.97 of its wall time): the eager calls of 1 GEMM")


def test_lean_kernels_take_the_gpu_s_room_least_extra_time_a_call_first():
    """Room 4 ms: half of it, 2 ms, for the kernels' extra GPU time. The kernel as fast as its
    choice's costs nothing; then 0.01 ms a call over 100 calls (1 ms); 0.05 over 30 (1.5 ms) no
    longer fits, and 0.2 once (0.2 ms) still does; a GEMM whose calls are not counted counts once."""
    a, b, c, d, e = (Problem(m, 8, 8) for m in (1, 2, 3, 4, 5))
    picks = {p: f"trial {p.m}" for p in (a, b, c, d, e)}
    extra = {a: -0.01, b: 0.01, c: 0.05, d: 0.2, e: 0.0}
    calls = {a.key(): 1000, b.key(): 100, c.key(): 30, d.key(): 1}
    assert keep.affordable(picks, extra, calls, 4.0) == {a: "trial 1", e: "trial 5", b: "trial 2", d: "trial 4"}
    assert keep.affordable(picks, extra, calls, 0.0) == {a: "trial 1", e: "trial 5"}


def test_a_lean_kernel_s_extra_time_is_over_its_choice_s_kernel_in_the_same_final_rounds(monkeypatch):
    from gemmtune.results import Status, Trial
    from gemmtune.serving.dispatch import DISPATCHER

    problem, unrecorded = Problem(4, 32, 16), Problem(8, 32, 16)
    final = lambda ms: Timing((ms,) * 24)  # noqa: E731 - as long as cuBLAS's: the final rounds'
    cublas, lt = Trial("cublas", {}, Status.OK, timing=final(0.030)), Trial("cublaslt", {"a": 1}, Status.OK,
                                                                             timing=final(0.025))
    tiled = Trial("triton_tiled", {"n": 1}, Status.OK, timing=final(0.032))
    trials = {problem: [cublas, lt, tiled], unrecorded: []}
    monkeypatch.setattr(DISPATCHER, "trials", lambda p, device: trials[p])
    results = {problem.key(): result(problem, "cublaslt", {"a": 1}), unrecorded.key(): result(unrecorded, "cublas")}
    extra = keep.extra_ms({problem: tiled, unrecorded: tiled}, results)
    assert extra[problem] == pytest.approx(0.007) and extra[unrecorded] == pytest.approx(0.032)


def test_lean_picks_ask_the_dispatcher_per_gemm_and_leave_fp8_products_alone(monkeypatch):
    """Both GEMMs tuned to cuBLAS with a Triton finalist level with it: the plain one's is picked;
    the fp8 one's (an fp8 kernel, not a lean backend's) is not; a GEMM without a result is not asked."""
    from gemmtune.results import Status, Trial
    from gemmtune.serving import dispatch
    from gemmtune.serving.dispatch import DISPATCHER

    plain, scaled = Problem(4, 32, 16), Problem(16, 32, 64, "float8_e4m3fn", "linear", scaling="tensor",
                                                  out_dtype="bfloat16")
    results = {p.key(): result(p, "cublas") for p in (plain, scaled)}
    rounds = Timing((0.03,) * 24)
    trials = {plain: [Trial("cublas", {}, Status.OK, timing=rounds), Trial("triton_tiled", {"n": 1}, Status.OK,
                                                                          timing=rounds)],
              scaled: [Trial("cublas", {}, Status.OK, timing=rounds), Trial("triton_scaled", {"n": 1}, Status.OK,
                                                                           timing=rounds)]}
    asked = []
    monkeypatch.setattr(DISPATCHER, "trials", lambda problem, device: asked.append(problem) or trials[problem])
    monkeypatch.setattr(dispatch, "_serves", lambda backend, problem, device: True)
    picks = keep.lean_picks({"a": {plain.key()}, "b": {plain.key(), scaled.key(), Problem(2, 2, 2).key()}}, results)
    assert picks == {plain: trials[plain][1]} and sorted(asked, key=str) == sorted([plain, scaled], key=str)


@pytest.mark.parametrize("train, kept", [(None, True), (S(0.9, 0.01), False)])
def test_where_lean_kernels_serve_the_run_every_layer_stays_for_the_check_s_verdict(
        fake_tuning, lean_calls, monkeypatch, caplog, train, kept):
    """Every GEMM tuned to cuBLAS, which alone would send each layer back to torch; the first
    layer's GEMM has a lean kernel serving its eager calls: that layer stays, and goes back (the
    kernel dropped) only where the check's verdict says so; the others go back."""
    fake_tuning(lambda p: "cublas")
    first = Problem(4, 32, 16, "float32", "linear", True, False, "gelu")
    lean = keep.Lean({first: None}, 0, S(1.15, 0.02))
    monkeypatch.setattr(keep, "lean", lambda run, forms, layer_problems, results, calls: (lean, f"paced: {lean}"))
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


@pytest.mark.gpu
def test_on_the_gpu_a_run_of_tiny_layers_is_host_bound_and_one_large_gemm_is_not_and_their_gpu_times_read_so():
    tiny = gemmtune.optimize(nn.Sequential(*[nn.Linear(8, 8) for _ in range(50)]).cuda())
    large = gemmtune.optimize(nn.Sequential(nn.Linear(8192, 8192)).to("cuda", torch.bfloat16))
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        tiny(x), large(y)  # tuned on first sight, before any timing
        tiny_forms, large_forms = [keep.Form(layer) for layer in tiny], [keep.Form(large[0])]
        tiny_pace = keep.host_pace(lambda: tiny(x), tiny_forms)
        large_pace = keep.host_pace(lambda: large(y), large_forms)
        assert tiny_pace.share >= keep.HOST_BOUND > large_pace.share
        # queued behind a sleep, the tiny layers' kernels run back to back in a fraction of the host's time
        assert keep.gpu_ms(lambda: tiny(x), tiny_forms, tiny_pace.host_ms) < 0.5 * tiny_pace.host_ms
        wall = keep.gpu_ms(lambda: large(y), large_forms, large_pace.host_ms)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        large(y)
        end.record()
        end.synchronize()
        assert wall == pytest.approx(start.elapsed_time(end), rel=0.2)  # the GPU's time: the large GEMM's
    assert all(type(layer) is gnn.Linear for layer in tiny)  # left in gemmtune's form


def test_a_layer_whose_gemm_runs_a_lean_kernel_in_eager_counts_as_served():
    model = gemmtune.optimize(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)))
    first, second = Problem(4, 32, 16, bias=True), Problem(4, 8, 32, bias=True)
    problems = {model[0]: {first.key()}, model[1]: {second.key()}}
    results = {p.key(): result(p, "cublas") for p in (first, second)}
    forms = [keep.Form(model[0]), keep.Form(model[1])]
    kept = keep.served(forms, problems, results, keep.Lean({first: None}, 0, S(1.1, 0.01)))
    assert kept == forms[:1] and not forms[0].graph_only and model[0].torch_when_capturing is None
    assert type(model[0]) is gnn.Linear and type(model[1]) is nn.Linear
