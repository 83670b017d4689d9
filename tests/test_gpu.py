"""Tier 3: on the real GPU (skipped without one). bf16 included, large tiles, the public API."""

import pytest
import torch
import torch.nn.functional as F

import gemmtune
from gemmtune.backends.triton_tiled import BACKEND, TiledConfig
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.tuning import verify

pytestmark = pytest.mark.gpu

BIG_CONFIGS = [TiledConfig(128, 256, 64, 8, 8, 3), TiledConfig(128, 128, 64, 8, 4, 4), TiledConfig(16, 64, 256, 8, 4, 3)]


@pytest.mark.parametrize("dtype, tf32", [("bfloat16", False), ("float16", False), ("float32", True), ("float32", False)])
@pytest.mark.parametrize("m,n,k", [(1, 4095, 33), (7, 1000, 4095), (257, 4097, 1000), (4095, 33, 65)])
@pytest.mark.parametrize("layout", ["linear", "nn"])
def test_large_tiles_match_reference(m, n, k, layout, dtype, tf32):
    problem = Problem(m, n, k, dtype, layout, bias=True, tf32=tf32)
    inputs = verify.make_inputs(problem, "cuda")
    for config in BIG_CONFIGS:
        if config.smem_bytes(problem.element_size) > current().smem_per_block:
            continue  # the space never offers it; compiling it would fail with OutOfResources
        err = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert err.ok, (config, err.reason())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_tunes_on_first_sight_then_hits(fresh_dispatch, dtype):
    x = torch.randn(33, 1000, device="cuda", dtype=dtype)
    w = torch.randn(4095, 1000, device="cuda", dtype=dtype)
    b = torch.randn(4095, device="cuda", dtype=dtype)
    with torch.no_grad():
        out = gemmtune.linear(x, w, b)
        again = gemmtune.linear(x, w, b)
    ref = verify.reference(Problem(33, 4095, 1000, "float32", "linear", True), x, w, b)
    problem = Problem(33, 4095, 1000, str(dtype).removeprefix("torch."))
    assert verify.rel_err(out, ref) <= verify.tolerance(problem)
    torch.testing.assert_close(out, again)
    assert len(DISPATCHER.store.choices()) == 1


def test_lookup_mode_never_tunes(fresh_dispatch, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    a = torch.randn(100, 200, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(200, 300, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(gemmtune.matmul(a, b), a @ b)
    assert DISPATCHER.store.choices() == []


def test_transposed_views_on_the_gpu(fresh_dispatch):
    a = torch.randn(300, 200, device="cuda", dtype=torch.float16).t()
    b = torch.randn(600, 100, device="cuda", dtype=torch.float16)[::2]
    ref = a.double() @ b.double()
    assert verify.rel_err(gemmtune.matmul(a, b), ref) <= 2e-3


def test_a_stored_kernel_runs_inside_cuda_graph_capture(fresh_dispatch):
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    expected = gemmtune.linear(x, w)  # tunes, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemmtune.linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected)


def test_a_shape_first_seen_inside_capture_runs_cublas_and_is_said(fresh_dispatch, caplog):
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16)
    F.linear(x, w)  # cuBLAS warmed up outside the capture, as CUDA graphs require
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemmtune.linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert verify.rel_err(out, x.double() @ w.double().t()) < 1e-2
    assert "inside CUDA graph capture" in caplog.text and DISPATCHER.kernels == {}
