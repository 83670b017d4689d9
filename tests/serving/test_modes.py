"""A problem's eager kernel and its CUDA-graph kernel (``gemmtune.serving.modes.ByMode``): which
runs, called and through a bound launch, inside and outside a capture (the capture check faked:
the CPU has no CUDA graphs)."""

import pytest
import torch

from gemmtune.backends.base import function_kernel
from gemmtune.serving import modes
from gemmtune.serving.modes import ByMode


def kernel(name, calls, any_rank=True, binds=True):
    def run(a, b, bias, out=None):
        calls.append(name)
        return a @ b.t()

    made = function_kernel(run, serves_any_rank=any_rank)
    if binds:
        def bound(x, weight, bias, px, pw, pbias):
            calls.append(f"{name} bound")
            return x @ weight.t()

        made.bind = lambda a, b, bias: bound
    return made


@pytest.fixture
def capturing(monkeypatch):
    state = {"on": False}
    monkeypatch.setattr(modes, "capturing", lambda: state["on"])
    return state


def test_the_eager_kernel_runs_outside_a_capture_and_the_graph_kernel_inside(capturing):
    calls = []
    served = ByMode(kernel("eager", calls), kernel("graph", calls))
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    served(a, b, None)
    capturing["on"] = True
    torch.testing.assert_close(served(a, b, None), a @ b.t())
    assert calls == ["eager", "graph"]


def test_a_bound_launch_is_the_eager_kernels_and_a_capture_calls_the_graph_kernel(capturing):
    calls = []
    served = ByMode(kernel("eager", calls), kernel("graph", calls, binds=False))
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    call = served.bind(x, w, None)
    call(x, w, None, 0, 0, 0)
    capturing["on"] = True
    torch.testing.assert_close(call(x, w, None, 0, 0, 0), x @ w.t())
    assert calls == ["eager bound", "graph"]


def test_nothing_is_bound_where_the_eager_kernel_binds_nothing(capturing):
    served = ByMode(kernel("eager", [], binds=False), kernel("graph", []))
    assert served.bind(torch.randn(2, 4), torch.randn(5, 4), None) is None


def test_it_serves_any_rank_where_its_eager_kernel_does():
    assert ByMode(kernel("e", []), kernel("g", [], any_rank=False)).serves_any_rank
    assert not ByMode(kernel("e", [], any_rank=False), kernel("g", [])).serves_any_rank


def test_a_capture_flattens_an_activation_for_a_graph_kernel_of_2d_operands(capturing):
    seen = []

    def graph(a, b, bias, out=None):
        seen.append(tuple(a.shape))
        return a @ b.t()

    served = ByMode(kernel("eager", []), function_kernel(graph, serves_any_rank=False))
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    capturing["on"] = True
    torch.testing.assert_close(served(x, w, None), x @ w.t())
    torch.testing.assert_close(served.front(x, w, None), x @ w.t())
    assert seen == [(6, 4), (6, 4)]


def test_the_front_path_calls_an_any_rank_eager_front_on_the_activation_as_it_is(capturing):
    # cuBLAS for eager calls (F.linear: any rank, nothing bound), a 2-D kernel for graphs: a
    # (batch, tokens, K) activation reaches F.linear itself, through no flattening wrapper
    from gemmtune.backends.launch import front_entry

    seen = []

    def eager_front(a, b, bias):
        seen.append(("eager front", tuple(a.shape)))
        return a @ b.t()

    def graph(a, b, bias, out=None):
        seen.append(("graph", tuple(a.shape)))
        return a @ b.t()

    eager = kernel("eager", [], binds=False)
    eager.front = eager_front
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    call = front_entry(ByMode(eager, function_kernel(graph, serves_any_rank=False)), x, w, None)
    torch.testing.assert_close(call(x, w, None, 0, 0, 0), x @ w.t())
    capturing["on"] = True
    torch.testing.assert_close(call(x, w, None, 0, 0, 0), x @ w.t())
    assert seen == [("eager front", (2, 3, 4)), ("graph", (6, 4))]


def test_warming_runs_the_graph_kernel_once_flattening_what_it_cannot_take():
    calls = []
    served = ByMode(kernel("eager", calls), kernel("graph", calls, any_rank=False))
    served.warm(torch.randn(2, 3, 4), torch.randn(5, 4), None)
    assert calls == ["graph"]


def test_an_fp8_product_s_scales_reach_the_kernel_of_either_mode(capturing):
    seen = []

    def scaled(name):
        def run(a, b, bias, scale_a, scale_b, out=None):
            seen.append((name, float(scale_a), float(scale_b)))
            return a @ b.t() * scale_a * scale_b

        return function_kernel(run)

    served = ByMode(scaled("eager"), scaled("graph"))
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    served(a, b, None, torch.tensor(2.0), torch.tensor(3.0))
    served.warm(a, b, None, torch.tensor(0.5), torch.tensor(1.0))
    capturing["on"] = True
    torch.testing.assert_close(served(a, b, None, torch.tensor(2.0), torch.tensor(3.0)), a @ b.t() * 6)
    assert seen == [("eager", 2.0, 3.0), ("graph", 0.5, 1.0), ("graph", 2.0, 3.0)]


def test_warming_a_matmul_passes_its_operands_as_they_are():
    # layout nn: b is (K, N); a flattening wrapper would shape the result by b's first dimension
    seen = []

    def graph(a, b, bias, out=None):
        seen.append((tuple(a.shape), tuple(b.shape)))
        return a @ b

    served = ByMode(kernel("eager", []), function_kernel(graph, serves_any_rank=False))
    served.warm(torch.randn(6, 4), torch.randn(4, 5), None)
    assert seen == [((6, 4), (4, 5))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_captured_graph_replays_the_graph_kernel_and_computes_right():
    from gemmtune import backends
    from gemmtune.device import current
    from gemmtune.problem import Problem

    problem = Problem(33, 96, 200, "bfloat16", "linear", bias=True)
    config = backends.get("triton_tiled").candidates(problem, current())[0].as_dict()
    calls = []
    graph_kernel = backends.build(problem, "triton_tiled", config, current())

    def graph(a, b, bias, out=None):
        calls.append("graph")
        return graph_kernel(a, b, bias, out=out)

    served = ByMode(backends.build(problem, "cublas", {}, current()), function_kernel(graph))
    a = torch.randn(33, 200, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, 200, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(96, device="cuda", dtype=torch.bfloat16)
    served.warm(a, w, bias)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        out = served(a, w, bias)
    a.copy_(torch.randn_like(a))
    captured.replay()
    expected = a.double() @ w.double().t() + bias.double()
    assert calls == ["graph", "graph"]  # warmed, then captured; the replay calls no Python
    assert ((out.double() - expected).abs().max() / expected.abs().max()).item() < 2e-2


def test_its_front_is_the_eager_kernels_front_outside_a_capture(capturing):
    calls = []
    eager = kernel("eager", calls, binds=False)
    eager.front = lambda a, b, bias: calls.append("eager front") or a @ b.t()
    served = ByMode(eager, kernel("graph", calls))
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    served.front(a, b, None)
    capturing["on"] = True
    served.front(a, b, None)
    assert calls == ["eager front", "graph"]
