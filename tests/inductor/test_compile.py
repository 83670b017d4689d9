"""gemmtune.compile: the compiled graphs' GEMMs run as gemmtune chose them.

On the CPU the compiler lowers GEMMs as on a GPU, so the tests here let gemmtune choose for CPU
GEMMs (``DEVICE_TYPES``) with a fixed answer (``choose``) and read the generated code; gemmtune's
kernel then falls back to torch on the CPU, so outputs must match eager exactly. The tests
marked ``gpu`` compile real choices, and the compiler's Triton template with gemmtune's config.
"""

import copy
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

import gemmtune
from gemmtune.inductor import choices, epilogues, hooks
from gemmtune.inductor.plan import LIBRARY, TEMPLATE, Rest
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing, Trial, TuneResult
from gemmtune.serving.dispatch import DISPATCHER, Choice

TILES = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


@pytest.fixture(autouse=True)
def _fresh_compiles():
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


@pytest.fixture
def chosen(monkeypatch):
    """gemmtune chooses for CPU GEMMs too, and answers every problem with ``chosen.answer``;
    ``chosen.asked`` lists the problems it was asked about."""
    class Chooser:
        answer = Choice("triton_stream", {"BLOCK_N": 64}, 0.100, 0.300)  # 200 us faster than cuBLAS
        asked = []

        def __call__(self, problem, device_index):
            self.asked.append(problem)
            return self.answer

    chooser = Chooser()
    monkeypatch.setattr(choices, "DEVICE_TYPES", ("cuda", "cpu"))
    # the plan weighs these CPU GEMMs as under the interpreter on any machine: on a GPU machine it
    # would time this host and cuBLAS on GPU 0 for them, and plan about those readings
    monkeypatch.setattr(choices, "_measurable", lambda device_index: False)
    monkeypatch.setattr(choices, "choose", chooser)
    monkeypatch.setattr(choices, "tune_ahead", lambda problems, index: chooser.ahead.append(problems))
    chooser.ahead = []
    return chooser


def mlp(k=33, hidden=64, n=7):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, hidden), nn.GELU(), nn.Linear(hidden, n, bias=False)).eval()


def compiled_run(model, *inputs):
    with torch.no_grad():
        out, code = run_and_get_code(gemmtune.compile(model), *inputs)
    return out, "\n".join(code)


def test_the_compiler_hooks_gemmtune_uses_are_there():
    """Fails on a torch whose compiler moved one: gemmtune.compile would fall back there."""
    assert hooks.missing() is None


@pytest.mark.parametrize("rows", [(1,), (7,), (3, 5)])
def test_a_gemmtune_kernel_is_called_from_the_generated_code(chosen, rows):
    model, x = mlp(), torch.randn(*rows, 33)
    out, code = compiled_run(model, x)
    assert code.count("extern_kernels.gemmtune_linear(") == 2  # the addmm with its bias, and the mm
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    m = x.numel() // 33
    fusable = x.dim() == 2 or hooks.fuses_through_views()  # 3-D: where the compiler fuses through the view
    assert {(p.m, p.n, p.k, p.layout, p.bias, p.activation) for p in chosen.asked} == {
        (m, 64, 33, "linear", True, "none"), (m, 7, 64, "linear", False, "none")} | \
        ({(m, 64, 33, "linear", True, "gelu")} if fusable else set())


def test_a_cublas_choice_keeps_the_compilers_library_call(chosen):
    chosen.answer = Choice("cublas", {})
    model, x = mlp(), torch.randn(7, 33)
    out, code = compiled_run(model, x)
    assert "extern_kernels.gemmtune_" not in code and "extern_kernels.mm(" in code and "addmm(" in code
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def tiled_trials(cublas_ms, tiled_ms):
    """Stored trials by label, as ``kernel_times`` answers: cuBLAS's and one Triton config's (TILES)."""
    made = [Trial("cublas", {}, Status.OK, Timing((cublas_ms,))), Trial("triton_tiled", TILES, Status.OK,
                                                                        Timing((tiled_ms,)))]
    return {t.label(): t for t in made}


CUBLAS = Choice("cublas", {}, 0.013, 0.013)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_short_gemm_in_a_graph_the_host_paces_runs_the_fastest_triton_config_tried_unless_replayed(
        chosen, monkeypatch, graphs):
    chosen.answer = CUBLAS
    problem = Problem(16, 768, 768, "bfloat16", "linear", True)
    monkeypatch.setattr(choices, "kernel_times", lambda problem, index: tiled_trials(0.006, 0.0065))
    monkeypatch.setattr(choices, "graph_problems", lambda graph: [(None, problem, 0)] * 12)
    monkeypatch.setattr(choices, "graph_rest", lambda graph, weighed, index: Rest(host_ms=1.0, gpu_ms=0.05))
    handler = choices.GemmtuneChoices(graphs=graphs)
    assert handler.choose_ahead(None) is not graphs
    choice, kind = handler.decision(problem, 0)
    assert (kind, choice.backend) == ((LIBRARY, "cublas") if graphs else (TEMPLATE, "triton_tiled"))
    assert choices.GemmtuneChoices(graphs=graphs).decision(problem, 0)[1] == LIBRARY  # nothing planned: cuBLAS


@pytest.mark.parametrize("measured,expected", [(None, LIBRARY), (0.4, LIBRARY), (3.0, TEMPLATE)])
def test_a_graph_is_planned_about_the_speed_measured_on_its_host(chosen, monkeypatch, caplog, measured, expected):
    """A graph the GPU paces on the nominal host and the host paces on one three times as slow:
    templates slower than cuBLAS, taken for their launch, pay only where the host measured is
    that slow (unmeasured, hosts from half to four times the nominal one are weighed)."""
    chosen.answer = CUBLAS
    problem = Problem(16, 768, 768, "bfloat16", "linear", True)
    monkeypatch.setattr(choices, "kernel_times", lambda problem, index: tiled_trials(0.006, 0.0065))
    monkeypatch.setattr(choices, "graph_problems", lambda graph: [(None, problem, 0)] * 12)
    monkeypatch.setattr(choices, "graph_rest", lambda graph, weighed, index: Rest(host_ms=0.3, gpu_ms=0.5))
    monkeypatch.setattr(choices, "host_scale", lambda index: measured)
    handler = choices.GemmtuneChoices()
    with caplog.at_level(logging.DEBUG, logger="gemmtune"):
        handler.choose_ahead(None)
    assert handler.decision(problem, 0)[1] == expected
    if measured is None:
        assert "queues a library call" not in caplog.text
    else:
        assert f"queues a library call in {measured * 13.1:.1f} us ({measured:.1f}x the nominal)" in caplog.text
    assert f"planned 12 x {problem.describe()} {expected}: {LIBRARY} 6.0 us, {TEMPLATE} 6.5 us\n" in caplog.text


WARM = [Problem(4096, 768, 768, "bfloat16", "linear", True), Problem(7, 33, 64, "float16", "nn"),
        Problem(128, 128, 64, "float32", "nn", batch=384), Problem(33, 64, 32, "bfloat16", "linear", batch=3)]


@pytest.mark.gpu
def test_the_hosts_speed_and_warm_library_times_are_measured_on_a_gpu_and_not_while_a_cuda_graph_is_captured():
    assert choices.host_scale(0) > 0
    assert all(choices.warm_library_ms(problem, 0) > 0 for problem in WARM)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    x = torch.randn(8, 8, device="cuda")
    with torch.cuda.stream(side):
        x.add_(1)  # warm-up off the capturing stream
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        measured = choices.host_scale(0), choices.warm_library_ms(WARM[0], 0)
        x.add_(1)
    assert measured == (None, None)


def test_a_library_way_without_a_stored_trial_of_cublas_is_said(chosen, monkeypatch, caplog):
    """Its time is then the call's cost, not a kernel time: the debug line says so."""
    chosen.answer = CUBLAS
    problem = Problem(16, 768, 768, "bfloat16", "linear", True)
    monkeypatch.setattr(choices, "kernel_times", lambda problem, index: {
        t.label(): t for t in tiled_trials(0.006, 0.0065).values() if t.backend != "cublas"})
    monkeypatch.setattr(choices, "graph_problems", lambda graph: [(None, problem, 0)] * 12)
    monkeypatch.setattr(choices, "graph_rest", lambda graph, weighed, index: Rest(host_ms=0.3, gpu_ms=0.5))
    with caplog.at_level(logging.DEBUG, logger="gemmtune"):
        choices.GemmtuneChoices().choose_ahead(None)
    assert f"{LIBRARY} 13.0 us" in caplog.text and "(no stored trial of cuBLAS)" in caplog.text


def test_the_kernel_times_come_from_the_trials_stored_with_the_choice(fresh_dispatch):
    problem = Problem(7, 33, 64, "float32", "linear")
    stored = (Trial("cublas", {}, Status.OK, Timing((0.009, 0.008, 0.008))),
              Trial("triton_tiled", TILES, Status.OK, Timing((0.011, 0.011))),
              Trial("triton_tiled", {**TILES, "BLOCK_M": 128}, Status.WRONG_RESULT, Timing((0.001,)), reason="wrong"),
              Trial("triton_stream", {"BLOCK_N": 64}, Status.COMPILE_ERROR, reason="no"),
              Trial("triton_tiled", TILES, Status.OK, Timing((0.007,))))  # a retune's, after the first
    DISPATCHER.store.put(TuneResult(problem_key=problem.key(), device=current(0).fingerprint(), backend="cublas",
                                    config={}, time_ms=0.008, cublas_ms=0.008, tune_s=1.0, trials=stored))
    found = choices.kernel_times(problem, 0)
    assert {label: t.median_ms for label, t in found.items()} == {
        "cublas": pytest.approx(0.008), Trial("triton_tiled", TILES, Status.OK).label(): pytest.approx(0.007)}
    assert choices.kernel_times(Problem(8, 33, 64, "float32", "linear"), 0) == {}  # nothing stored


@pytest.mark.parametrize("answer", [Choice("cublaslt", {"algo": 0}, 0.010, 0.050),
                                    Choice("triton_stream", {"BLOCK_N": 64}, 0.010, 0.015)])
def test_a_kernel_that_does_not_pay_its_call_is_the_compilers_cublas_call(chosen, answer):
    """A gemmtune kernel called from generated code costs the host more than the compiler's
    addmm: a cuBLASLt algorithm never pays it without CUDA graphs, a kernel 5 us faster neither."""
    chosen.answer = answer
    model, x = mlp(), torch.randn(7, 33)
    out, code = compiled_run(model, x)
    assert "extern_kernels.gemmtune_" not in code
    assert {p.activation for p in chosen.asked} == {"none", "gelu"}  # the GELU's product asked fused too
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_a_product_gemmtune_does_not_serve_keeps_the_library_call_untuned(chosen):
    def added(c, a, b):
        return torch.baddbmm(c, a, b) * 2

    c, a, b = torch.randn(3, 7, 5), torch.randn(3, 7, 33), torch.randn(3, 33, 5)
    with torch.no_grad():
        out, code = run_and_get_code(gemmtune.compile(added), c, a, b)
    assert "extern_kernels.baddbmm(" in "\n".join(code) and chosen.asked == []
    torch.testing.assert_close(out, added(c, a, b))


@pytest.mark.parametrize("answer", [Choice("cublas", {}, 0.3, 0.3), Choice("triton_stream", {"BLOCK_N": 64}, 0.1, 0.3)])
def test_a_bmm_is_asked_as_a_batched_problem_and_never_calls_gemmtunes_kernel(chosen, answer):
    chosen.answer = answer

    def attention_scores(q, k):
        return torch.softmax(q @ k.transpose(1, 2), dim=-1)

    q, k = torch.randn(6, 7, 33), torch.randn(6, 5, 33)
    with torch.no_grad():
        out, code = run_and_get_code(gemmtune.compile(attention_scores), q, k)
    code = "\n".join(code)
    assert "extern_kernels.bmm(" in code and "extern_kernels.gemmtune_" not in code
    assert chosen.asked == [Problem(7, 5, 33, "float32", "linear", batch=6)]  # k.T: each b a transposed (N, K)
    torch.testing.assert_close(out, attention_scores(q, k))


def test_a_matmul_of_row_major_operands_is_an_nn_problem(chosen):
    def product(a, b):
        return (a @ b).relu()

    a, b = torch.randn(7, 33), torch.randn(33, 5)
    with torch.no_grad():
        out, code = run_and_get_code(gemmtune.compile(product), a, b)
    assert "extern_kernels.gemmtune_mm(" in "\n".join(code)
    assert [(p.m, p.n, p.k, p.layout) for p in chosen.asked] == [(7, 5, 33, "nn")]
    torch.testing.assert_close(out, product(a, b))


def test_the_backward_graph_is_compiled_with_gemmtune_choices_too(chosen):
    model, x = mlp(), torch.randn(9, 33, requires_grad=True)
    reference = mlp()
    x_ref = x.detach().clone().requires_grad_(True)
    gemmtune.compile(model)(x).sum().backward()
    reference(x_ref).sum().backward()
    forward_problems = 2
    assert len(chosen.asked) > forward_problems  # the backward's dx products were asked about
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for p, p_ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.fixture
def templates_on(monkeypatch):
    """Whether each graph was compiled with the compiler's GEMM templates switched on."""
    seen = []
    compile_inner = hooks.compile_fx_inner

    def spy(*args, **kwargs):
        seen.append(hooks.config.max_autotune_gemm)
        return compile_inner(*args, **kwargs)

    monkeypatch.setattr(hooks, "compile_fx_inner", spy)
    return seen


@pytest.mark.parametrize("answer,expected", [(Choice("cublas", {}), False), (Choice("triton_stream", {}), False),
                                             (Choice("triton_tiled", TILES), True)])
def test_only_a_graph_with_a_template_choice_switches_the_templates_on(chosen, templates_on, answer, expected):
    chosen.answer = answer
    model, x = mlp(), torch.randn(7, 33)
    out, code = compiled_run(model, x)
    assert templates_on == [expected]
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_a_graphs_gemms_are_chosen_once_ahead_and_said_in_one_line(chosen, caplog):
    model = nn.Sequential(nn.Linear(33, 33), nn.ReLU(), nn.Linear(33, 33), nn.ReLU(), nn.Linear(33, 7)).eval()
    with caplog.at_level(logging.INFO, logger="gemmtune"):
        compiled_run(model, torch.randn(5, 33))
    assert len(chosen.asked) == len(set(chosen.asked)) == 3  # two shapes (one also fused with its ReLU)
    assert "a compiled graph's 3 GEMMs (2 shapes): 3 on gemmtune's kernels" in caplog.text
    assert "failed gemmtune's check" not in caplog.text
    assert "estimated" in caplog.text and "queues a library call" not in caplog.text  # the interpreter: not measured


def test_a_graphs_products_are_tuned_together_ahead_each_before_its_fused_form(chosen):
    model, x = mlp(), torch.randn(7, 33)
    compiled_run(model, x)
    (ahead,) = chosen.ahead
    assert [(p.n, p.k, p.bias, p.activation) for p in ahead] == [
        (64, 33, True, "none"), (7, 64, False, "none"), (64, 33, True, "gelu")]


@pytest.mark.parametrize("mode,stored,expected", [("tune", 0, 3), ("tune", 1, 2), ("tune", 2, 0), ("lookup", 0, 0)])
def test_the_dispatcher_tunes_the_missing_buckets_of_several_problems_in_one_batch(
        fresh_dispatch, monkeypatch, mode, stored, expected):
    """Only the problems the store has nothing for, and only two or more (one is tuned alone on
    first sight, as fast); never in lookup mode."""
    from gemmtune.serving import dispatch

    monkeypatch.setenv("GEMMTUNE_MODE", mode)
    problems = [Problem(7, 33 + i, 64, "float32", "linear") for i in range(3)]
    device = current(0)
    for problem in problems[:stored]:
        DISPATCHER.store.put(TuneResult(problem_key=problem.key(), device=device.fingerprint(), backend="cublas",
                                        config={}, time_ms=0.01, cublas_ms=0.01, tune_s=1.0))
    batches = []
    monkeypatch.setattr(dispatch, "tune_many", lambda problems, device, store, options: batches.append(problems) or [])
    DISPATCHER.prepare(problems + problems[:1], device)
    assert [len(b) for b in batches] == ([expected] if expected else [])
    if expected:
        assert batches[0] == problems[stored:]


def test_the_log_line_says_where_cublas_failed_gemmtunes_check(chosen, caplog):
    """There gemmtune's verified kernel is called whatever its host time (a wrong product else)."""
    chosen.answer = Choice("triton_stream", {"BLOCK_N": 64}, 0.012, None)
    model, x = mlp(), torch.randn(7, 33)
    with caplog.at_level(logging.INFO, logger="gemmtune"):
        out, code = compiled_run(model, x)
    assert code.count("extern_kernels.gemmtune_linear(") == 2
    assert "2 on gemmtune's kernels (2 where cuBLAS failed gemmtune's check)" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def dynamo_graph(model, *inputs):
    """Dynamo's graph of ``model`` on ``inputs``, static: traced afresh (a second shape of one
    forward would be traced with dynamic sizes)."""
    torch._dynamo.reset()
    graphs = []
    torch.compile(model, backend=lambda gm, example: (graphs.append(gm), gm.forward)[1])(*inputs)
    return graphs[0]


class Block(nn.Module):
    """Products each followed by one activation form alone, and products that are not: one
    shape followed by two activations, one with and without, one whose output has two users."""

    def __init__(self):
        super().__init__()
        sizes = {"exact": 32, "tanh": 48, "relu": 40, "inplace": 72, "silu": 56, "a": 8, "b": 8, "twice": 16,
                 "mixed": 24}
        self.layers = nn.ModuleDict({name: nn.Linear(16, n) for name, n in sizes.items()})
        self.inplace = nn.ReLU(inplace=True)

    def forward(self, x):
        lay = self.layers
        mixed = lay["mixed"](x)
        return (F.gelu(lay["exact"](x)), F.gelu(lay["tanh"](x), approximate="tanh"), torch.relu(lay["relu"](x)),
                self.inplace(lay["inplace"](x)), F.silu(lay["silu"](x)), torch.relu(lay["a"](x)), F.silu(lay["b"](x)),
                lay["twice"](x) * 2 + lay["twice"](x).sum(), torch.relu(lay["mixed"](x)) + mixed)


def test_the_activation_alone_after_a_product_is_read_from_dynamos_graph(monkeypatch):
    monkeypatch.setattr(hooks, "fuses_through_views", lambda: True)  # 3-D input, on any torch
    found = epilogues.activations(dynamo_graph(Block(), torch.randn(2, 3, 16)), ("cpu",), tf32=False)
    assert {p.n: act for p, act in found.items()} == {32: "gelu", 48: "gelu_tanh", 40: "relu", 72: "relu",
                                                     56: "silu"}
    assert {(p.m, p.k, p.bias, p.activation) for p in found} == {(6, 16, True, "none")}
    assert epilogues.activations(dynamo_graph(Block(), torch.randn(2, 3, 16)), ("cuda",), tf32=False) == {}


def test_where_the_compiler_cannot_fuse_through_a_view_only_2d_products_take_their_activation(monkeypatch):
    """A linear on 3-D input decomposes into addmm and a view, which torch 2.11's scheduler does
    not fuse a template's epilogue across: such a product is tuned alone. On 2-D input, or on
    a torch that fuses through the view, it is tuned with its activation."""
    monkeypatch.setattr(hooks, "fuses_through_views", lambda: False)
    assert epilogues.activations(dynamo_graph(Block(), torch.randn(2, 3, 16)), ("cpu",), tf32=False) == {}
    found = epilogues.activations(dynamo_graph(Block(), torch.randn(6, 16)), ("cpu",), tf32=False)
    assert {p.n: act for p, act in found.items()} == {32: "gelu", 48: "gelu_tanh", 40: "relu", 72: "relu",
                                                     56: "silu"}


@pytest.mark.parametrize("version,fuses", [("2.11.0+cu130", False), ("2.12.1", False), ("2.13.0+cpu", True),
                                           ("2.14.0.dev20270101", True)])
def test_fusing_through_a_view_is_taken_from_213_on(monkeypatch, version, fuses):
    monkeypatch.setattr(torch, "__version__", version)
    assert hooks.fuses_through_views() is fuses


def test_a_product_an_activation_alone_follows_is_tuned_with_it_fused(chosen):
    class Ffn(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            return self.down(F.gelu(self.up(x), approximate="tanh"))

    found = epilogues.activations(dynamo_graph(Ffn(), torch.randn(5, 16)), ("cpu",), tf32=False)
    assert found == {Problem(5, 64, 16, "float32", "linear", True): "gelu_tanh"}
    compiled_run(Ffn(), torch.randn(5, 16))
    assert Problem(5, 64, 16, "float32", "linear", True, activation="gelu_tanh") in chosen.asked


def test_a_torch_whose_hooks_moved_compiles_with_torch_alone(monkeypatch, caplog):
    monkeypatch.setattr(hooks, "missing", lambda: "torch 9.9 has no InductorChoices")
    model, x = mlp(), torch.randn(7, 33)
    with caplog.at_level(logging.WARNING, logger="gemmtune"), torch.no_grad():
        out = gemmtune.compile(model)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert "has no InductorChoices; compiling with torch.compile alone" in caplog.text


def test_the_compilers_sm_gate_warning_is_explained_once_instead(caplog, monkeypatch):
    from gemmtune.inductor import backend

    monkeypatch.setattr(backend._GateWarning, "said", False)
    compiler_log = logging.getLogger(backend.GATE_LOGGER)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            with backend._gate_warning_explained():
                compiler_log.warning("Not enough SMs to use max_autotune_gemm mode")
                compiler_log.warning("another warning of the compiler's")
        compiler_log.warning("Not enough SMs to use max_autotune_gemm mode")  # outside a gemmtune compile
    assert caplog.text.count("Not enough SMs") == 1 and caplog.text.count("another warning") == 2
    assert caplog.text.count("under the compiler's SM gate") == 1


@pytest.mark.parametrize("mode,options,on", [(None, None, False), ("reduce-overhead", None, False),
                                              ("max-autotune-no-cudagraphs", None, True), ("max-autotune", None, True),
                                              (None, {"max_autotune_gemm": True}, True), (None, {"max_autotune": True}, True)])
def test_the_plan_knows_when_the_caller_switched_the_templates_on(mode, options, on):
    """A max-autotune mode switches the compiler's GEMM templates on through ``max_autotune``:
    there every addmm's library call is already the wrapped one, which the plan must not weigh
    as a cost of taking a template (it kept BERT-base's faster float32 bmm templates off). Read
    under the patches ``compile_fx`` applies around each graph's compile."""
    from gemmtune.inductor.backend import Backend

    with hooks.config.patch(Backend(mode, options).patches):
        assert hooks.gemm_templates_on() is on
    with hooks.config.patch(max_autotune=True):  # set for the whole process, not by the caller's call
        assert hooks.gemm_templates_on()


def test_bad_arguments_name_what_is_accepted():
    with pytest.raises(ValueError, match="mode='fast' is not a torch.compile mode; accepted: None, default"):
        gemmtune.compile(mlp(), mode="fast")
    with pytest.raises(TypeError, match="options must be a dict"):
        gemmtune.compile(mlp(), options=[("max_autotune", True)])


# --------------------------------------------------------------------------------------------
# On the GPU


def gpu_mlp(dtype, k=768, hidden=3072, act=nn.GELU):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, hidden), act(), nn.Linear(hidden, k)).to("cuda", dtype).eval()


def templates_computing(code: str, op: str) -> list[str]:
    """The GEMM templates of generated ``code`` whose kernel body calls ``op``. A template's name
    lists its inputs' origins too (fc2's reads GELU's output), so the name alone proves nothing."""
    bodies = re.finditer(r"def (triton_tem_\w+)\(.*?(?=\n''')", code, re.S)
    return [body.group(1) for body in bodies if op in body.group(0)]


def relative_error(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.gpu
def test_a_triton_config_becomes_the_compilers_template_with_the_activation_fused(chosen):
    chosen.answer = Choice("triton_tiled", TILES)
    model, x = gpu_mlp(torch.bfloat16), torch.randn(64, 768, device="cuda", dtype=torch.bfloat16)
    out, code = compiled_run(model, x)
    assert "extern_kernels.gemmtune_" not in code and "extern_kernels.mm(" not in code
    assert templates_computing(code, "erf(")  # the GELU is in the GEMM's epilogue, not only in its name
    assert "BLOCK_M : tl.constexpr = 64" in code and "BLOCK_N : tl.constexpr = 32" in code
    with torch.no_grad():
        reference = model.double()(x.double())
    assert relative_error(out, reference) < 2e-2


@pytest.mark.gpu
def test_a_gemm_taken_for_its_launch_is_the_compilers_template(chosen, monkeypatch):
    chosen.answer = Choice("cublas", {}, 0.013, 0.013)
    monkeypatch.setattr(choices, "kernel_times", lambda problem, index: tiled_trials(0.006, 0.0065))
    model, x = gpu_mlp(torch.bfloat16), torch.randn(16, 768, device="cuda", dtype=torch.bfloat16)
    out, code = compiled_run(model, x)
    assert "extern_kernels.mm(" not in code and "addmm(" not in code  # both GEMMs on the template
    assert templates_computing(code, "erf(")  # the GELU is in the GEMM's epilogue, not only in its name
    with torch.no_grad():
        reference = model.double()(x.double())
    assert relative_error(out, reference) < 2e-2


@pytest.mark.gpu
def test_a_bmm_tiled_choice_becomes_the_compilers_batched_template(chosen):
    chosen.answer = Choice("triton_tiled", TILES)

    def scores(q, k):
        return (q @ k.transpose(1, 2)).relu()

    q, k = (torch.randn(24, 128, 64, device="cuda") for _ in range(2))
    with torch.no_grad():
        out, code = run_and_get_code(gemmtune.compile(scores), q, k)
    code = "\n".join(code)
    assert "extern_kernels.bmm(" not in code and "BLOCK_M : tl.constexpr = 64" in code
    assert relative_error(out, scores(q.double(), k.double())) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,m,n,k", [(2, 1, 7, 33), (3, 33, 5, 7), (384, 128, 128, 64)])
def test_a_compiled_bmm_with_real_choices_matches_a_higher_precision_reference(fresh_dispatch, dtype, batch, m, n, k):
    def attention(q, key, v):
        return (q @ key.transpose(1, 2)) @ v

    q, key = torch.randn(batch, m, k, device="cuda", dtype=dtype), torch.randn(batch, n, k, device="cuda", dtype=dtype)
    v = torch.randn(batch, n, k, device="cuda", dtype=dtype)
    with torch.no_grad():
        out = gemmtune.compile(attention)(q, key, v)
    reference = attention(q.double(), key.double(), v.double())
    assert relative_error(out, reference) < (2e-2 if dtype != torch.float32 else 1e-4)
    assert any("/batch=" in r.problem_key for r in DISPATCHER.store.choices())  # the bmm was tuned and stored


@pytest.mark.gpu
@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (7, torch.float16), (33, torch.float32),
                                        (512, torch.bfloat16), (512, torch.float16), (512, torch.float32)])
def test_a_compiled_model_with_real_choices_matches_a_higher_precision_reference(fresh_dispatch, dtype, rows):
    model = gpu_mlp(dtype, k=264, hidden=520, act=nn.SiLU)
    x = torch.randn(rows, 264, device="cuda", dtype=dtype)
    with torch.no_grad():
        out = gemmtune.compile(model)(x)
        reference = model.double()(x.double())
    assert relative_error(out, reference) < (2e-2 if dtype != torch.float32 else 1e-2)
    assert len(DISPATCHER.store.choices()) >= 2  # both GEMMs were tuned on first sight and stored


@pytest.mark.parametrize("added", [None, "vector", "rows", "matrix"])
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 33, 4095), (33, 5, 7)])
def test_the_runtime_computes_any_operands_it_is_given(added, weight, m, n, k):
    """What generated code may hand ``runtime.linear`` and ``runtime.mm``, on the CPU (torch computes it there; the
    GPU tests run the kernels): every form of added term and b, against float64."""
    a = torch.randn(m, k, dtype=torch.float64).float()
    b = torch.randn(n, k).t() if weight else torch.randn(k, n)
    extra = {None: None, "vector": torch.randn(n), "rows": torch.randn(n).expand(m, n),
             "matrix": torch.randn(m, n)}[added]
    operands = (a, b) if extra is None else (extra, a, b)
    expected = a.double() @ b.double() + (0 if extra is None else extra.double())
    serve = choices.runtime.linear if weight else choices.runtime.mm
    torch.testing.assert_close(serve(*operands).double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("added", [None, "vector", "rows"])
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (7, 33, 4095), (512, 768, 3072)])
def test_the_runtime_serves_any_operands_it_is_given_on_the_gpu(fresh_dispatch, added, weight, m, n, k):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if weight else \
        torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    extra = {None: None, "vector": torch.randn(n, device="cuda", dtype=torch.bfloat16),
             "rows": torch.randn(n, device="cuda", dtype=torch.bfloat16).expand(m, n)}[added]
    operands = (a, b) if extra is None else (extra, a, b)
    expected = a.double() @ b.double() + (0 if extra is None else extra.double())
    serve = choices.runtime.linear if weight else choices.runtime.mm
    for _ in range(2):  # the first call tunes and binds, the second takes the bound launch
        assert relative_error(serve(*operands), expected) < 2e-2


def test_a_batch_of_dynamic_size_is_served_by_gemmtunes_kernel_chosen_per_call(chosen, templates_on):
    model = mlp()
    compiled = gemmtune.compile(model, dynamic=True)
    with torch.no_grad():
        x = torch.randn(5, 33)
        out, code = run_and_get_code(compiled, x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
        for rows in (9, 2):
            x = torch.randn(rows, 33)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert "\n".join(code).count("extern_kernels.gemmtune_linear(") == 2
    assert len(templates_on) == 1  # one graph compiled for every size
    assert {(p.n, p.k) for p in chosen.asked} == {(64, 33), (7, 64)}  # chosen at the size's hint


@pytest.mark.gpu
def test_a_dynamic_batch_with_real_choices_matches_a_higher_precision_reference(fresh_dispatch):
    model = gpu_mlp(torch.bfloat16, k=264, hidden=520, act=nn.SiLU)
    compiled = gemmtune.compile(model, dynamic=True)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()
        for rows in (33, 1, 7, 512):
            x = torch.randn(rows, 264, device="cuda", dtype=torch.bfloat16)
            assert relative_error(compiled(x), reference(x.double())) < 2e-2


WARM_START = """
import json, pathlib, sys, torch, gemmtune
from torch import nn
from torch._dynamo.utils import counters
from gemmtune.inductor import choices
from gemmtune.serving.dispatch import Choice
choices.DEVICE_TYPES = ("cuda", "cpu")
choices.choose = lambda problem, index: Choice("triton_stream", {}, 0.010, 0.050)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 7)).eval()
x = torch.randn(5, 33)
with torch.no_grad():
    torch.testing.assert_close(gemmtune.compile(model)(x), model(x), rtol=1e-5, atol=1e-5)
pathlib.Path(sys.argv[1]).write_text(json.dumps(dict(counters["inductor"])))
"""


def test_a_second_process_takes_the_compiled_graph_from_the_compilers_cache(tmp_path):
    """A warm start: the generated code, which calls gemmtune's kernel by name, is loaded from
    the compiler's cache by a process that compiled nothing."""
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(gemmtune.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH"))))}
    counts = []
    for run in range(2):
        report = tmp_path / f"counters-{run}.json"
        done = subprocess.run([sys.executable, "-c", WARM_START, str(report)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        counts.append(json.loads(report.read_text()))
    first, second = counts
    assert first.get("fxgraph_cache_miss") == 1
    assert second.get("fxgraph_cache_hit") == 1 and "fxgraph_cache_miss" not in second


def test_a_graph_replayed_as_a_cuda_graph_runs_the_kernel_its_tuning_found_faster_for_graphs(chosen, monkeypatch):
    """cuBLAS chosen on a call's cost; a cuBLASLt algorithm 8% faster in the final rounds: a
    CUDA-graph replay calls it, a plain compiled graph keeps the library call."""
    import random

    def rounds(median, seed):
        rng = random.Random(seed)
        return Timing(tuple(median * (1 + rng.uniform(-0.005, 0.005)) for _ in range(24)))

    lt = Trial("cublaslt", {"algo": 66}, Status.OK, rounds(0.0276, 2))
    trials = {"cublas": Trial("cublas", {}, Status.OK, rounds(0.030, 1)), lt.label(): lt}
    chosen.answer = Choice("cublas", {}, 0.030, 0.030)
    monkeypatch.setattr(choices, "kernel_times", lambda problem, index: trials)
    problem = Problem(2048, 768, 768, "bfloat16", "linear", True)
    graphed = choices.GemmtuneChoices(graphs=True)._asked(problem, 0)[0]
    assert (graphed.backend, graphed.config) == ("cublaslt", {"algo": 66})
    assert choices.GemmtuneChoices(graphs=False)._asked(problem, 0)[0].backend == "cublas"
