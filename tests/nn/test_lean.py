"""Lean kernels (gemmtune.nn.lean): where the host paces a model's eager run and the GPU has room
for their extra time, its GEMMs' eager calls are tried on the Triton kernels whose launches cost the
host less, and kept where the run measures faster."""

import pytest
import torch
from torch import nn

import gemmtune
from gemmtune import nn as gnn
from gemmtune.nn import keep, lean
from gemmtune.problem import Problem
from gemmtune.results import Timing, TuneResult

S = keep.Speedup


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 8))


def result(problem: Problem, backend: str, config: dict | None = None) -> TuneResult:
    return TuneResult(problem.key(), "fake-device", backend, config or {}, 1.0, 1.0, 0.1)


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
    monkeypatch.setattr(lean, "host_pace", lambda run, forms: lean.Pace(0.97 if bound else 0.6, 4.0))
    monkeypatch.setattr(lean, "lean_picks", lambda layer_problems, results: picks)
    monkeypatch.setattr(lean, "gpu_ms", lambda run, forms, host_ms: 2.0)  # a room of 2 ms: 1 ms to take
    monkeypatch.setattr(lean, "extra_ms", lambda picks, results: {p: 0.1 if room else 0.3 for p in picks})
    timed = []
    monkeypatch.setattr(keep, "speedup", lambda run, forms: timed.append(list(forms)) or eager)
    found, said = lean.tried(lambda: None, forms, {}, {}, {problem.key(): 8})
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
    monkeypatch.setattr(lean, "host_pace", lambda run, forms: lean.Pace(0.97, 4.0))
    monkeypatch.setattr(lean, "lean_picks", lambda layer_problems, results: {problem: object()})
    monkeypatch.setattr(lean, "extra_ms", lambda picks, results: pytest.fail("no room to weigh"))
    monkeypatch.setattr(keep, "speedup", lambda run, forms: S(1.15, 0.03))
    assert lean.gpu_ms(lambda: None, forms, 4.0) is None
    found, said = lean.tried(lambda: None, forms, {}, {}, {problem.key(): 8})
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
    assert lean.affordable(picks, extra, calls, 4.0) == {a: "trial 1", e: "trial 5", b: "trial 2", d: "trial 4"}
    assert lean.affordable(picks, extra, calls, 0.0) == {a: "trial 1", e: "trial 5"}


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
    extra = lean.extra_ms({problem: tiled, unrecorded: tiled}, results)
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
    picks = lean.lean_picks({"a": {plain.key()}, "b": {plain.key(), scaled.key(), Problem(2, 2, 2).key()}}, results)
    assert picks == {plain: trials[plain][1]} and sorted(asked, key=str) == sorted([plain, scaled], key=str)


@pytest.mark.gpu
def test_on_the_gpu_a_run_of_tiny_layers_is_host_bound_and_one_large_gemm_is_not_and_their_gpu_times_read_so():
    tiny = gemmtune.optimize(nn.Sequential(*[nn.Linear(8, 8) for _ in range(50)]).cuda())
    large = gemmtune.optimize(nn.Sequential(nn.Linear(8192, 8192)).to("cuda", torch.bfloat16))
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        tiny(x), large(y)  # tuned on first sight, before any timing
        tiny_forms, large_forms = [keep.Form(layer) for layer in tiny], [keep.Form(large[0])]
        tiny_pace = lean.host_pace(lambda: tiny(x), tiny_forms)
        large_pace = lean.host_pace(lambda: large(y), large_forms)
        assert tiny_pace.share >= lean.HOST_BOUND > large_pace.share
        # queued behind a sleep, the tiny layers' kernels run back to back in a fraction of the host's time
        assert lean.gpu_ms(lambda: tiny(x), tiny_forms, tiny_pace.host_ms) < 0.5 * tiny_pace.host_ms
        wall = lean.gpu_ms(lambda: large(y), large_forms, large_pace.host_ms)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        large(y)
        end.record()
        end.synchronize()
        assert wall == pytest.approx(start.elapsed_time(end), rel=0.2)  # the GPU's time: the large GEMM's
    assert all(type(layer) is gnn.Linear for layer in tiny)  # left in gemmtune's form
