"""What a compiled graph costs besides the GEMMs gemmtune weighs, estimated from aten graphs."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from gemmtune.backends.costmodel import dram_bytes_per_s, peak_flops
from gemmtune.device import Device
from gemmtune.inductor import rest
from gemmtune.inductor.plan import GRAPH_MS, HOST_MS, LAUNCH_MS, LIBRARY

DEVICE = Device("H100", (9, 0), 132, 232448, 50 << 20)  # built, not probed: the rooflines' inputs


def aten_graph(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def estimate(graph, weighed=()):
    """The estimate, less the graph's own host time per run (GRAPH_MS)."""
    found = rest.estimate(graph, set(weighed), DEVICE, tf32=False)
    return rest.Rest(found.host_ms - GRAPH_MS, found.gpu_ms)


def per_ms_bytes():
    return rest.BYTES_EFFICIENCY * dram_bytes_per_s(DEVICE) / 1e3


def test_views_cost_nothing_but_the_graphs_own_run():
    graph = aten_graph(lambda x: x.view(4, 8).t().unsqueeze(0).expand(3, 8, 4), torch.randn(32))
    assert rest.estimate(graph, set(), DEVICE, tf32=False) == rest.Rest(GRAPH_MS, 0.0)


def test_a_chain_of_pointwise_ops_is_one_kernel_through_views():
    x = torch.randn(64, 128)
    graph = aten_graph(lambda x: ((x * 2 + 1).t().relu().exp() - 3).sigmoid(), x)
    found = estimate(graph)
    assert found.host_ms == pytest.approx(LAUNCH_MS)
    assert found.gpu_ms == pytest.approx(2 * x.numel() * 4 / per_ms_bytes())


def test_a_reduction_is_a_kernel_reading_its_input_and_starts_no_chain():
    x = torch.randn(64, 128)
    graph = aten_graph(lambda x: x.amax(-1, keepdim=True) * 2, x)
    found = estimate(graph)
    assert found.host_ms == pytest.approx(2 * LAUNCH_MS)  # the reduction, and the product after it
    assert found.gpu_ms == pytest.approx((x.numel() * 4 + 2 * 64 * 4) / per_ms_bytes())


def test_a_library_call_costs_its_host_call_and_its_flops():
    a, b = torch.randn(3, 64, 32), torch.randn(3, 32, 16)
    graph = aten_graph(torch.bmm, a, b)
    found = estimate(graph)
    flops = 2 * 3 * 64 * 32 * 16
    assert found.host_ms == pytest.approx(HOST_MS[LIBRARY])
    assert found.gpu_ms == pytest.approx(flops / (rest.FLOPS_EFFICIENCY * peak_flops("float32", False, DEVICE)) * 1e3)


def test_the_weighed_gemms_are_left_out():
    x, w = torch.randn(8, 16), torch.randn(32, 16)
    graph = aten_graph(lambda x, w: torch.mm(x, w.t()) + 1, x, w)
    (mm,) = [n for n in graph.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert estimate(graph, [mm]).host_ms == pytest.approx(LAUNCH_MS)
    assert estimate(graph).host_ms == pytest.approx(LAUNCH_MS + HOST_MS[LIBRARY])


def test_a_convolution_counts_its_flops():
    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 4, 4)
    conv = aten_graph(lambda x, w: torch.ops.aten.convolution(x, w, None, [4, 4], [0, 0], [1, 1], False, [0, 0], 1),
                      x, w)
    flops = 2 * (2 * 8 * 4 * 4) * (3 * 4 * 4)
    expected = flops / (rest.FLOPS_EFFICIENCY * peak_flops("float32", False, DEVICE)) * 1e3
    assert estimate(conv).gpu_ms == pytest.approx(expected)
