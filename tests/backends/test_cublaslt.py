"""cuBLASLt's ranked algorithms (``cublaslt``): configs from untrusted data are bounded, each
algorithm is checked by cuBLAS and matches float64 at awkward sizes, and operands it was not
checked for go to torch's call."""

import pytest
import torch
import torch.nn.functional as F

from gemmtune import backends
from gemmtune.backends import cublaslt as lt
from gemmtune.device import current, interpreter_device
from gemmtune.errors import CublasLtError
from gemmtune.problem import Problem
from gemmtune.tuning import tuner, verify

CONFIG = {"algo": 66, "tile": 24, "splitk": 1, "reduction": 0, "swizzle": 0, "custom": 7, "stages": 35, "inner": 0,
          "cluster": 0}


def test_config_round_trips_and_names_what_is_out_of_bounds():
    parsed = backends.get("cublaslt").parse_config(CONFIG)
    assert parsed.as_dict() == CONFIG and parsed.key().startswith("algo=66,tile=24")
    for field, value in (("tile", -1), ("custom", True), ("cluster", 2**16), ("algo", 2**31), ("stages", "35")):
        with pytest.raises(ValueError, match=f"cublaslt {field}="):
            backends.get("cublaslt").parse_config({**CONFIG, field: value})
    assert backends.get("cublaslt").parse_config({**CONFIG, "splitk": -1}).splitk == -1  # signed in cuBLAS
    with pytest.raises(ValueError, match="needs exactly the keys"):
        backends.get("cublaslt").parse_config({k: v for k, v in CONFIG.items() if k != "inner"})


def test_not_offered_under_the_interpreter_or_where_it_cannot_serve():
    backend = backends.get("cublaslt")
    assert not backend.is_available(interpreter_device())
    assert backend.candidates(Problem(64, 64, 64), interpreter_device()) == []
    assert backend.candidates(Problem(64, 63, 64), current()) == []  # rows of 126 bytes


def test_library_kernels_are_never_compiled_ahead():
    assert set(backends.PRECOMPILED) == {"cublas", "cublaslt", "scaled_mm_fast"}
    spaces = {"cublas": [backends.get("cublas").parse_config({})],
              "cublaslt": [backends.get("cublaslt").parse_config(CONFIG)]}
    assert tuner._plan(Problem(64, 64, 64), interpreter_device(), tuner.TuneOptions(), spaces) == []
    fp8 = Problem(64, 64, 64, "float8_e4m3fn", scaling="row")
    spaces = {"cublas": [backends.get("cublas").parse_config({})],
              "scaled_mm_fast": [backends.get("scaled_mm_fast").parse_config({})]}
    assert tuner._plan(fp8, interpreter_device(), tuner.TuneOptions(), spaces) == []


# --- on the GPU ----------------------------------------------------------------------------------

SIZES = [(1, 64, 4096), (7, 4096, 64), (33, 1000, 512), (4095, 256, 128), (256, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tf32", [("bfloat16", False), ("float16", False), ("float32", True),
                                        ("float32", False)])
@pytest.mark.parametrize("layout", ["linear", "nn"])
@pytest.mark.parametrize("m,n,k", SIZES)
def test_every_ranked_algorithm_matches_float64(m, n, k, layout, dtype, tf32):
    problem = Problem(m, n, k, dtype, layout, tf32=tf32)
    device = current()
    backend = backends.get("cublaslt")
    configs = backend.candidates(problem, device)
    assert configs, "cuBLASLt's heuristic answered no algorithm"
    inputs = verify.make_inputs(problem, "cuda")
    for config in configs:
        kernel = backend.build(problem, backend.parse_config(config.as_dict()), device)
        assert verify.check(kernel, problem, inputs).ok, config


@pytest.mark.gpu
def test_a_rebuilt_algorithm_is_the_ranked_one():
    """Rebuilt from its nine integers, an algorithm has the heuristic's configuration again."""
    from gemmtune.backends import cublaslt_binding

    problem = Problem(2048, 4096, 4096)
    matmul = cublaslt_binding.Matmul(problem, torch.cuda.current_device())
    for config in matmul.heuristics(8):
        algo, workspace = matmul.algo(config)
        assert matmul._config(algo) == config and workspace >= 0


@pytest.mark.gpu
def test_rejected_configs_fail_to_build():
    with pytest.raises(CublasLtError):
        backends.get("cublaslt").build(Problem(64, 64, 64), lt.LtConfig(**{**CONFIG, "algo": 9999}), current())


@pytest.mark.gpu
def test_operands_it_was_not_checked_for_go_to_torch():
    problem = Problem(33, 256, 512, "float32", "linear", activation="relu")
    backend = backends.get("cublaslt")
    kernel = backend.build(problem, backend.candidates(problem, current())[0], current())
    w = torch.randn(256, 512, device="cuda")
    x = torch.randn(40, 512, device="cuda")
    cases = [x[:33], x[1:34],  # the second 2 KB past the storage's start: 256-byte aligned, so served
             torch.randn(33, 520, device="cuda")[:, :512],  # other strides
             torch.randn(33 * 512 + 1, device="cuda")[1:].view(33, 512),  # 4 bytes off alignment
             x[:5]]  # another M: checked by cuBLAS, then served
    for a in cases:
        assert torch.allclose(kernel(a, w, None), F.linear(a, w).relu(), atol=1e-4, rtol=1e-4)
    bias = torch.randn(256, device="cuda")
    assert torch.allclose(kernel(x[:33], w, bias), F.linear(x[:33], w, bias).relu(), atol=1e-4, rtol=1e-4)
    out = torch.empty(33, 256, device="cuda")
    assert kernel(x[:33], w, None, out) is out and torch.allclose(out, F.linear(x[:33], w).relu(), atol=1e-4,
                                                                  rtol=1e-4)
    assert {m for _, m in kernel._plans} == {33, 5}


@pytest.mark.gpu
def test_replays_from_a_cuda_graph_with_its_workspace():
    problem = Problem(16, 4096, 14336)  # the decode shapes' algorithms split K through a workspace
    backend = backends.get("cublaslt")
    inputs = verify.make_inputs(problem, "cuda")
    for config in backend.candidates(problem, current()):
        kernel = backend.build(problem, config, current())
        kernel(inputs.a, inputs.b, None)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kernel(inputs.a, inputs.b, None)
        inputs.a.copy_(torch.randn_like(inputs.a))
        graph.replay()
        expected = verify.reference(problem, inputs.a, inputs.b, None)
        assert verify.rel_err(out, expected) <= verify.tolerance(problem), config


@pytest.mark.gpu
def test_a_bound_launch_serves_like_operands_and_checks_alignment():
    problem = Problem(16, 4096, 4096)
    backend = backends.get("cublaslt")
    kernel = backend.build(problem, backend.candidates(problem, current())[0], current())
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    call = kernel.bind(x, w, None)
    shifted = torch.randn(16 * 4096 + 8, device="cuda", dtype=torch.bfloat16)[8:].view(16, 4096)  # 16 bytes off
    for a in (torch.randn_like(x), shifted):
        out = call(a, w, None, a.data_ptr(), w.data_ptr(), 0)
        assert verify.rel_err(out, verify.reference(problem, a, w, None)) <= verify.tolerance(problem)
    assert kernel.bind(torch.randn(16, 4104, device="cuda", dtype=torch.bfloat16)[:, :4096], w, None) is None


@pytest.mark.gpu
def test_a_model_activation_gets_the_bound_launch_on_its_rows():
    """x (batch, tokens, K), contiguous, as a model passes it: the front path's entry is
    cuBLASLt's bound call on x's rows itself (no flattening wrapper, no views per call) and
    returns (batch, tokens, N), right for new activations of that shape, with the layer's bias
    and activation; a transposed x is not bound and is served right."""
    from gemmtune.backends.launch import front_entry

    problem = Problem(4 * 33, 768, 512, bias=True, activation="gelu")
    backend = backends.get("cublaslt")
    kernel = backend.build(problem, backend.candidates(problem, current())[0], current())
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 33, 512, device="cuda", dtype=torch.bfloat16)
    entry = front_entry(kernel, x, w, bias)
    assert entry.__qualname__.startswith("LtKernel.bind")
    for _ in range(2):
        x = torch.randn(4, 33, 512, device="cuda", dtype=torch.bfloat16)
        out = entry(x, w, bias, x.data_ptr(), w.data_ptr(), bias.data_ptr())
        assert out.shape == (4, 33, 768)
        expected = verify.reference(problem, x.view(-1, 512), w, bias)
        assert verify.rel_err(out.view(-1, 768), expected) <= verify.tolerance(problem)
    transposed = torch.randn(33, 4, 512, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    assert kernel.bind(transposed, w, bias) is None
    out = front_entry(kernel, transposed, w, bias)(transposed, w, bias, transposed.data_ptr(), w.data_ptr(),
                                                     bias.data_ptr())
    expected = verify.reference(problem, transposed.reshape(-1, 512), w, bias)
    assert verify.rel_err(out.reshape(-1, 768), expected) <= verify.tolerance(problem)


@pytest.mark.gpu
def test_bound_launches_share_one_workspace_per_stream_and_a_capture_gets_its_own():
    """Algorithms that need a workspace: every bound call on a stream launches with that stream's
    one workspace (its launches run in order), another stream gets its own, a call captured in a
    CUDA graph allocates one (keeping none), and every result matches float64."""
    problem = Problem(4096, 3072, 768, bias=True, activation="gelu_tanh")
    backend = backends.get("cublaslt")
    kernels = [k for k in (backend.build(problem, c, current()) for c in backend.candidates(problem, current()))
               if k._plan(torch.cuda.current_device(), problem.m)[1]]
    if not kernels:
        pytest.skip("no cuBLASLt algorithm of this product needs a workspace on this GPU")
    x = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 768, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    expected = verify.reference(problem, x, w, bias)
    calls = [k.bind(x, w, bias) for k in kernels[:2]]
    lt._WORKSPACES.clear()

    def run(call):
        return call(x, w, bias, x.data_ptr(), w.data_ptr(), bias.data_ptr())

    for call in calls:
        assert verify.rel_err(run(call), expected) <= verify.tolerance(problem)
    index = torch.cuda.current_device()
    assert list(lt._WORKSPACES) == [(index, torch.cuda.current_stream().cuda_stream)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = run(calls[0])
    torch.cuda.current_stream().wait_stream(side)
    assert verify.rel_err(out, expected) <= verify.tolerance(problem)
    assert (index, side.cuda_stream) in lt._WORKSPACES and len(lt._WORKSPACES) == 2
    graph, capture = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=capture):
        captured = run(calls[0])
    assert len(lt._WORKSPACES) == 2
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert verify.rel_err(captured, verify.reference(problem, x, w, bias)) <= verify.tolerance(problem)


@pytest.mark.gpu
@pytest.mark.parametrize("descs", [64, 1])
def test_layers_of_one_shape_each_read_their_own_bias(monkeypatch, descs):
    """Layers of one shape share a bound launch and pass their own biases, alternately: each
    bias address gets a descriptor reading it, and past MAX_BIAS_DESCS the shared descriptor's
    attribute is set per call; every result matches float64 with its own bias."""
    from gemmtune.backends import cublaslt_binding

    monkeypatch.setattr(cublaslt_binding, "MAX_BIAS_DESCS", descs)
    problem = Problem(64, 768, 512, bias=True, activation="relu")
    backend = backends.get("cublaslt")
    kernel = backend.build(problem, backend.candidates(problem, current())[0], current())
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16)
    biases = [10 * torch.randn(768, device="cuda", dtype=torch.bfloat16) for _ in range(3)]  # another's: far off
    call = kernel.bind(x, w, biases[0])
    for bias in biases * 2:
        out = call(x, w, bias, x.data_ptr(), w.data_ptr(), bias.data_ptr())
        assert verify.rel_err(out, verify.reference(problem, x, w, bias)) <= verify.tolerance(problem)


@pytest.mark.gpu
def test_a_bound_launch_outlives_its_kernel():
    """The bound call keeps the descriptors it launches with: dropping the kernel (its finalizer
    destroys them) must not leave it launching through freed ones."""
    import gc

    problem = Problem(1, 6144, 4096)
    backend = backends.get("cublaslt")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
    calls = [backend.build(problem, config, current()).bind(x, w, None)
             for config in backend.candidates(problem, current())]
    gc.collect()
    for call in calls:
        out = call(x, w, None, x.data_ptr(), w.data_ptr(), 0)
        assert verify.rel_err(out, verify.reference(problem, x, w, None)) <= verify.tolerance(problem)


@pytest.mark.parametrize("bias,activation,expected", [
    (False, "none", 1), (True, "none", 4), (False, "relu", 2), (True, "relu", 6), (False, "gelu_tanh", 32),
    (True, "gelu_tanh", 36), (True, "gelu", 4), (True, "silu", 4), (False, "gelu", 1)])
def test_the_epilogue_is_one_that_cublaslt_h_defines(bias, activation, expected):
    """cublasLtEpilogue_t's values: BIAS (4) is one of its own, not a flag over DEFAULT (1)."""
    from gemmtune.backends import cublaslt_binding

    assert cublaslt_binding.epilogue(Problem(8, 8, 8, "bfloat16", "linear", bias, False, activation)) == expected


EPILOGUES = [(True, "none"), (True, "relu"), (True, "gelu_tanh"), (False, "gelu_tanh"), (False, "relu"),
             (True, "gelu"), (True, "silu")]  # the last two: the bias in cuBLAS's epilogue, the activation torch's


@pytest.mark.gpu
@pytest.mark.parametrize("bias,activation", EPILOGUES)
@pytest.mark.parametrize("dtype,tf32", [("bfloat16", False), ("float16", False), ("float32", False)])
@pytest.mark.parametrize("m,n,k", [(1, 64, 4096), (33, 1000, 512), (4095, 256, 128)])
def test_every_ranked_algorithm_with_its_epilogue_matches_float64(m, n, k, dtype, tf32, bias, activation):
    from gemmtune.backends import cublaslt_binding

    problem = Problem(m, n, k, dtype, "linear", bias, tf32, activation)
    backend = backends.get("cublaslt")
    configs = backend.candidates(problem, current())
    assert configs, "cuBLASLt's heuristic answered no algorithm with this epilogue"
    ranked = cublaslt_binding.Matmul(problem, torch.cuda.current_device()).heuristics(lt.HEURISTICS)
    assert len(configs) == len(ranked)  # the first too: torch's call applies bias or activation apart
    inputs = verify.make_inputs(problem, "cuda")
    for config in configs:
        kernel = backend.build(problem, config, current())
        verdict = verify.check(kernel, problem, inputs)
        assert verdict.ok, (config, verdict)


@pytest.mark.gpu
def test_a_bias_the_epilogue_was_not_checked_for_goes_to_torch():
    problem = Problem(33, 256, 512, "bfloat16", "linear", True, False, "gelu_tanh")
    backend = backends.get("cublaslt")
    kernel = backend.build(problem, backend.candidates(problem, current())[0], current())
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16)
    store = torch.randn(512 + 1, device="cuda", dtype=torch.bfloat16)
    for bias in (store[:256], store[1:257],  # aligned; then 2 bytes off
                 store[:512:2],  # strided
                 None):  # none where the problem has one
        expected = F.gelu(F.linear(x.double(), w.double(), None if bias is None else bias.double()), approximate="tanh")
        assert verify.rel_err(kernel(x, w, bias), expected) < 2e-2
    plain = backend.build(Problem(33, 256, 512), backend.candidates(Problem(33, 256, 512), current())[0], current())
    assert verify.rel_err(plain(x, w, store[:256]), F.linear(x.double(), w.double(), store[:256].double())) < 2e-2


@pytest.mark.gpu
def test_layers_of_one_shape_share_the_kernel_each_with_its_own_bias():
    """The bias pointer is an attribute of the shared descriptor: each call reads its own, in eager,
    through bound launches, and replayed from one CUDA graph."""
    problem = Problem(16, 1024, 1024, "bfloat16", "linear", True)
    backend = backends.get("cublaslt")
    kernel = backend.build(problem, backend.candidates(problem, current())[0], current())
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    layers = [(torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16),
               torch.randn(1024, device="cuda", dtype=torch.bfloat16) * 10) for _ in range(3)]
    bound = kernel.bind(x, *layers[0])
    assert bound is not None
    for w, b in layers * 2:
        expected = F.linear(x.double(), w.double(), b.double())
        assert verify.rel_err(kernel(x, w, b), expected) < 2e-2
        assert verify.rel_err(bound(x, w, b, x.data_ptr(), w.data_ptr(), b.data_ptr()), expected) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [kernel(x, w, b) for w, b in layers]
    graph.replay()
    for out, (w, b) in zip(outs, layers):
        assert verify.rel_err(out, F.linear(x.double(), w.double(), b.double())) < 2e-2


# fp8 products scaled per tensor (LtScaledKernel): the heuristic's algorithms after torch's


def test_it_is_asked_for_both_kinds_and_serves_the_fp8_products_cublas_takes():
    e4m3 = Problem(16, 4096, 4096, "float8_e4m3fn", scaling="tensor", bias=True)
    assert backends.takes("cublaslt", e4m3) and backends.takes("cublaslt", Problem(16, 4096, 4096))
    assert lt.serves_scaled(e4m3)
    refused = [Problem(16, 4096, 4096, "float8_e4m3fn", scaling="row"),  # row scales: torch's own kernel
               Problem(16, 4096, 4096, "float8_e5m2", scaling="tensor"),  # two e5m2 operands
               Problem(16, 4096, 4096, "float8_e4m3fn", scaling="tensor", bias=True, out_dtype="float32"),
               Problem(16, 4104, 4096, "float8_e4m3fn", scaling="tensor")]  # N % 16
    for p in refused:
        assert not lt.serves_scaled(p), p
        assert backends.get("cublaslt").candidates(p, current()) == []
        with pytest.raises(ValueError, match="cublaslt serves fp8 products scaled per tensor"):
            backends.get("cublaslt").build(p, backends.get("cublaslt").parse_config(CONFIG), current())
    assert backends.get("cublaslt").candidates(e4m3, interpreter_device()) == []


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype,bias,activation", [("bfloat16", True, "none"), ("bfloat16", False, "relu"),
                                                       ("float16", True, "gelu_tanh"), ("float32", False, "silu")])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (33, 1024, 512), (2048, 6144, 4096)])
def test_every_ranked_fp8_algorithm_matches_float64(m, n, k, out_dtype, bias, activation):
    p = Problem(m, n, k, "float8_e4m3fn", scaling="tensor", out_dtype=out_dtype, bias=bias, activation=activation)
    inputs = verify.make_inputs(p, "cuda", seed=m + n)
    backend = backends.get("cublaslt")
    configs = backend.candidates(p, current())
    for config in configs:
        verdict = verify.check(backend.build(p, config, current()), p, inputs)
        assert verdict.ok, (config, verdict.reason())


@pytest.mark.gpu
def test_fp8_operands_or_scales_it_was_not_checked_for_go_to_torch():
    p = Problem(64, 1024, 512, "float8_e4m3fn", scaling="tensor", bias=True)
    backend = backends.get("cublaslt")
    kernel = backend.build(p, backend.candidates(p, current())[0], current())
    inputs = verify.make_inputs(p, "cuda", seed=9)
    a, b, bias, sa, sb = inputs.operands
    wide = torch.empty(64, 1024, dtype=a.dtype, device="cuda")
    wide[:, :512] = a
    assert verify.judge(kernel(wide[:, :512], b, bias, sa, sb), p, inputs).ok  # a strided view: torch's call
    out = torch.empty(64, 2048, dtype=torch.bfloat16, device="cuda")[:, ::2]  # a strided out: written through
    assert kernel(a, b, bias, sa, sb, out=out) is out and verify.judge(out, p, inputs).ok


def _residual_launch(problem: Problem, config: dict, x, w, bias, residual):
    """``problem``'s product through ``config``'s algorithm with ``residual`` as cuBLASLt's C."""
    from gemmtune.backends import cublaslt_binding

    matmul = cublaslt_binding.Matmul(problem, torch.cuda.current_device())
    algo, workspace_bytes = matmul.algo(config)
    launch = matmul.launcher(algo)
    out = torch.empty(problem.m, problem.n, device="cuda", dtype=x.dtype)
    workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device="cuda")
    launch(w.data_ptr(), x.data_ptr(), out.data_ptr(), workspace.data_ptr(), workspace_bytes,
           torch.cuda.current_stream().cuda_stream, 0 if bias is None else bias.data_ptr(),
           residual_ptr=residual.data_ptr())
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 4096), (7, 33 * 8, 40), (33, 1000, 512), (4095, 256, 128)])
def test_a_residual_is_added_by_every_ranked_algorithm_with_one_rounding(m, n, k, dtype, bias):
    from gemmtune.backends import cublaslt_binding

    problem = Problem(m, n, k, dtype, "linear", bias)
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(m * 7 + n)
    x = torch.randn(m, k, device="cuda", dtype=torch_dtype)
    w = torch.randn(n, k, device="cuda", dtype=torch_dtype) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=torch_dtype) if bias else None
    residual = torch.randn(m, n, device="cuda", dtype=torch_dtype) * 4
    kept = residual.clone()
    ref = x.double() @ w.double().t() + residual.double() + (0 if b is None else b.double())
    torch_err = (F.linear(x, w, b) + residual).double().sub(ref).abs().max().item()  # fp32: no TF32 by default
    configs = cublaslt_binding.Matmul(problem, torch.cuda.current_device()).heuristics(lt.HEURISTICS)
    assert configs, "cuBLASLt's heuristic answered no algorithm"
    for config in configs:
        out = _residual_launch(problem, config, x, w, b, residual)
        err = out.double().sub(ref).abs().max().item()
        # one rounding of the sum, against torch's two (the product's, then the add's)
        assert err <= max(2 * torch_err, 1e-6 * ref.abs().max().item()), (config, err, torch_err)
        assert torch.equal(residual, kept), "the residual was written"


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_a_residual_is_refused_where_the_activation_would_apply_to_the_sum(activation):
    problem = Problem(33, 256, 512, "bfloat16", "linear", True, False, activation)
    x = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    from gemmtune.backends import cublaslt_binding

    config = cublaslt_binding.Matmul(problem, torch.cuda.current_device()).heuristics(1)[0]
    with pytest.raises(ValueError, match="residual_ptr is not accepted"):
        _residual_launch(problem, config, x, w, b, torch.randn(33, 256, device="cuda", dtype=torch.bfloat16))
