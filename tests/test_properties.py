"""Properties of gemmtune on operands of every layout a caller can pass, checked by hypothesis.

What each property would have caught (issue 26):
- finding 1, a bias whose stride is not 1 read as if it were (and views of x and weight, which
  must be read as they lie): the Triton wrappers on drawn views under the interpreter, directly
  and through ``linear``'s front path, and on the GPU through the dispatcher;
- finding 4, backward crashing for K = 0 or N = 0: the public functions and the custom ops
  against torch, gradients compared, zero sizes among the draws;
- finding 5, gaps in the input checks: malformed input raises one error naming the argument
  from the public function, its custom op and the op's fake implementation, a CPU operand
  beside a meta one among the draws.

The interpreter tier runs in CI on the CPU, where the public functions take the documented
fallback to torch (so it checks checks, fallbacks and backward) and the Triton kernels run under
the interpreter. The GPU tier (marked ``gpu``) serves the public functions by each Triton
backend in turn, chosen through a store. Example counts are bounded for both.
"""

import math
import tempfile

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import gemmtune
from gemmtune import backends
from gemmtune.backends.triton_tiled import FFMA_CONFIGS, TiledConfig
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import TuneResult
from gemmtune.serving import calls
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.store import Store
from gemmtune.tuning import verify

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}
KERNEL_DTYPES = ("float16", "bfloat16", "float32")  # what the Triton kernels serve
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
TORCH_ACTS = {"none": lambda t: t, "relu": torch.relu, "gelu": F.gelu,
              "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
VIEWS = ("contiguous", "transposed", "strided", "expanded", "offset")
TRITON = ("triton_tiled", "triton_splitk", "triton_stream", "triton_persistent")
SIZES = (0, 1, 2, 3, 7)  # of the public functions' dimensions: zero sizes are a documented fallback
# Relative to the result's largest finite magnitude: torch's own GEMMs, in another order at most
CLOSE = {torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float32: 1e-5, torch.float64: 1e-10}

CPU_EXAMPLES = settings(max_examples=200, deadline=None, database=None)
KERNEL_EXAMPLES = settings(max_examples=100, deadline=None, database=None)
GPU_EXAMPLES = settings(max_examples=16, deadline=None, database=None)


# ----- operands ---------------------------------------------------------------------------

def laid_out(values: torch.Tensor, view: str) -> torch.Tensor:
    """``values`` in a tensor laid out as ``view`` says: a copy (contiguous), its last two
    dimensions' storage transposed, every other element of a row twice as long (strided), one
    element past its storage's start (offset), or its first slice along dimension 0 repeated
    by stride 0 (expanded: the values are then that slice's). A view the rank or size cannot
    take is a plain copy."""
    if view == "transposed" and values.dim() >= 2:
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if view == "strided" and values.dim() >= 1:
        wide = values.new_zeros(*values.shape[:-1], 2 * values.shape[-1])
        return _filled(wide[..., ::2], values)
    if view == "expanded" and values.dim() >= 1 and values.shape[0] > 0:
        return values[:1].clone().expand(values.shape)
    if view == "offset":
        return _filled(values.new_zeros(values.numel() + 1)[1:].view(values.shape), values)
    return values.clone()


def _filled(view: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    view.copy_(values)
    return view


@st.composite
def operands(draw, shape, dtype, nonfinite: bool = False, device: str = "cpu"):
    """A tensor of ``shape`` and ``dtype`` on ``device``, of normal random values in a drawn
    layout; where ``nonfinite``, a NaN or an infinity may replace one value."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))))
    values = values.to(device=device, dtype=dtype)
    if nonfinite and values.numel() and draw(st.booleans()):
        values.view(-1)[draw(st.integers(0, values.numel() - 1))] = draw(st.sampled_from((math.nan, math.inf, -math.inf)))
    view = draw(st.sampled_from(VIEWS))
    note(f"a {view} {dtype} operand of shape {tuple(shape)}")
    return laid_out(values, view)


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same shape and dtype, NaN where ``expected`` has NaN, the same infinities, and finite
    values within the dtype's tolerance of the largest finite magnitude."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape)
    got, expected = got.detach(), expected.detach()
    finite = expected[torch.isfinite(expected)]
    tol = CLOSE[expected.dtype]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    assert torch.allclose(got, expected, rtol=tol, atol=tol * scale, equal_nan=True), (what, got, expected)


def assert_same_gradients(got: torch.Tensor, expected: torch.Tensor, inputs: list) -> None:
    """The gradients of ``got`` and of ``expected`` with respect to ``inputs`` agree."""
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(0)).to(expected.dtype)
    mine = torch.autograd.grad(got, inputs, grad)
    theirs = torch.autograd.grad(expected, inputs, grad)
    for i, (g, t) in enumerate(zip(mine, theirs)):
        assert_close(g, t, f"gradient of input {i}")


# ----- interpreter tier: the public functions and the custom ops on the CPU -----------------

@st.composite
def linear_inputs(draw):
    """x of rank 1 to 4, weight and bias (or None) of one drawn dtype, each in a drawn layout,
    sizes from SIZES, NaN or infinity in some."""
    dtype = DTYPES[draw(st.sampled_from(tuple(DTYPES)))]
    lead = draw(st.lists(st.sampled_from(SIZES), max_size=3))
    n, k = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    x = draw(operands((*lead, k), dtype, nonfinite=True))
    weight = draw(operands((n, k), dtype, nonfinite=True))
    bias = draw(st.none() | operands((n,), dtype, nonfinite=True))
    return x, weight, bias


def call_linear(entry: str, x, weight, bias, act: str):
    if entry == "public":
        return gemmtune.linear(x, weight, bias, activation=None if act == "none" else act)
    return torch.ops.gemmtune.linear(x, weight, bias, act)


@CPU_EXAMPLES
@given(inputs=linear_inputs(), act=st.sampled_from(ACTIVATIONS), entry=st.sampled_from(("public", "op")),
       grad=st.booleans())
def test_linear_and_its_op_match_torch(inputs, act, entry, grad):
    """Findings 4 and 1 (views): values and gradients as torch's, zero sizes and views included."""
    x, weight, bias = inputs
    leaves = [t for t in inputs if t is not None]
    for t in leaves:
        t.requires_grad_(grad)
    got = call_linear(entry, x, weight, bias, act)
    expected = TORCH_ACTS[act](F.linear(x, weight, bias))
    assert_close(got, expected, "output")
    if grad:
        assert_same_gradients(got, expected, leaves)


@st.composite
def matmul_inputs(draw, two_d: bool):
    """a (..., M, K) or (K,) and b (..., K, N) or (K,), or both 2-D where ``two_d``."""
    dtype = DTYPES[draw(st.sampled_from(tuple(DTYPES)))]
    m, k, n = (draw(st.sampled_from(SIZES)) for _ in range(3))
    batch = () if two_d else tuple(draw(st.lists(st.sampled_from((1, 2)), max_size=2)))
    a_shape = (m, k) if two_d else draw(st.sampled_from(((k,), (*batch, m, k))))
    b_shape = (k, n) if two_d else draw(st.sampled_from(((k,), (k, n), (*batch, k, n))))
    return draw(operands(a_shape, dtype, nonfinite=True)), draw(operands(b_shape, dtype, nonfinite=True))


@CPU_EXAMPLES
@given(inputs=matmul_inputs(two_d=False), grad=st.booleans())
def test_matmul_matches_torch_at_every_rank(inputs, grad):
    """Findings 4 and 1 (views): 2-D operands through the op, others by torch.matmul's rules."""
    matches_with_gradients(gemmtune.matmul, torch.matmul, inputs, grad)


@CPU_EXAMPLES
@given(inputs=matmul_inputs(two_d=True), grad=st.booleans())
def test_the_mm_op_matches_torch(inputs, grad):
    """Finding 4: the op's backward at zero sizes; finding 1: its operands' views."""
    matches_with_gradients(torch.ops.gemmtune.mm, torch.mm, inputs, grad)


def matches_with_gradients(call, reference, inputs, grad: bool) -> None:
    """``call`` and torch's ``reference`` agree on ``inputs``, and so do their gradients."""
    for t in inputs:
        t.requires_grad_(grad)
    got, expected = call(*inputs), reference(*inputs)
    assert_close(got, expected, "output")
    if grad:
        assert_same_gradients(got, expected, list(inputs))


# Each makes valid float32 operands x (2, 3), weight (4, 3), bias (4,) malformed one way.
LINEAR_FLAWS = {
    "x's K": lambda x, w, b: (torch.ones(2, 5), w, b),
    "x of rank 0": lambda x, w, b: (torch.tensor(1.0), w, b),
    "weight of rank 1": lambda x, w, b: (x, w[0], b),
    "weight of rank 3": lambda x, w, b: (x, w[None], b),
    "bias's length": lambda x, w, b: (x, w, torch.ones(5)),
    "bias of rank 2": lambda x, w, b: (x, w, b[None]),
    "weight's dtype": lambda x, w, b: (x, w.double(), b),
    "bias's dtype": lambda x, w, b: (x, w, b.half()),
    "weight on meta": lambda x, w, b: (x, w.to("meta"), b),
    "bias on meta": lambda x, w, b: (x, w, b.to("meta")),
    "x on meta": lambda x, w, b: (x.to("meta"), w, b),
}
MM_FLAWS = {
    "b's K": lambda a, b: (a, torch.ones(4, 5)),
    "b's dtype": lambda a, b: (a, b.bfloat16()),
    "b on meta": lambda a, b: (a, b.to("meta")),
    "a on meta": lambda a, b: (a.to("meta"), b),
}


def raised(call) -> tuple[type, str] | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - which error, and its message, is what is compared
        return type(exc), str(exc)
    return None


def faked(op, *args):
    """``op`` called under FakeTensorMode, as torch.compile traces it."""
    with FakeTensorMode() as mode:
        return op(*(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args))


@settings(max_examples=30, deadline=None, database=None)
@given(flaw=st.sampled_from(tuple(LINEAR_FLAWS)), act=st.sampled_from(ACTIVATIONS + ("tanh",)))
def test_malformed_linear_raises_one_error_everywhere(flaw, act):
    """Finding 5: the op and its fake raise the public function's error (no IndexError or
    unpacking error), and a CPU operand beside a meta one is an error, not uninitialised memory."""
    x, w, b = LINEAR_FLAWS[flaw](torch.ones(2, 3), torch.ones(4, 3), torch.ones(4))
    public = raised(lambda: gemmtune.linear(x, w, b, activation=None if act == "none" else act))
    assert public is not None and public[0] in (TypeError, ValueError), (flaw, public)
    assert raised(lambda: torch.ops.gemmtune.linear(x, w, b, act)) == public
    assert raised(lambda: faked(torch.ops.gemmtune.linear, x, w, b, act)) == public


@settings(max_examples=10, deadline=None, database=None)
@given(flaw=st.sampled_from(tuple(MM_FLAWS)))
def test_malformed_matmul_raises_one_error_everywhere(flaw):
    """Finding 5, for matmul and its op."""
    a, b = MM_FLAWS[flaw](torch.ones(2, 3), torch.ones(3, 4))
    public = raised(lambda: gemmtune.matmul(a, b))
    assert public is not None and public[0] in (TypeError, ValueError), (flaw, public)
    assert raised(lambda: torch.ops.gemmtune.mm(a, b)) == public
    assert raised(lambda: faked(torch.ops.gemmtune.mm, a, b)) == public


# ----- interpreter tier: each Triton wrapper on drawn views ---------------------------------

def kernel_sizes(name: str, dtype: str):
    """(M, N, K) strategies for a problem backend ``name`` serves under the interpreter: sizes
    that leave partial tiles at every edge; the TMA kernels need 16-byte rows, the stream
    kernel 2 <= M <= 64, the split-K kernel M <= 64."""
    if name in ("triton_stream", "triton_persistent"):
        step = 16 // DTYPES[dtype].itemsize
        rows = st.sampled_from((step, 3 * step, 5 * step))
        m = st.sampled_from((2, 7, 33) if name == "triton_stream" else (1, 7, 33))
        return m, rows, rows
    awkward = st.sampled_from((1, 7, 33, 65))
    return (st.sampled_from((1, 7, 33, 64)) if name == "triton_splitk" else awkward), awkward, awkward


@st.composite
def kernel_cases(draw, name: str, layouts=("linear", "nn")):
    """(problem, config, a, b, bias) for backend ``name``: a drawn dtype, layout, epilogue,
    sizes and config, a and b in drawn layouts, the bias too (t[::2], t[:1].expand(N), t[1:]...)."""
    dtype = draw(st.sampled_from(KERNEL_DTYPES))
    m, n, k = (draw(s) for s in kernel_sizes(name, dtype))
    layout = draw(st.sampled_from(layouts))
    torch_dtype = DTYPES[dtype]
    bias = draw(st.none() | operands((n,), torch_dtype))
    problem = Problem(m, n, k, dtype, layout, bias=bias is not None, activation=draw(st.sampled_from(ACTIVATIONS)))
    configs = backends.get(name).candidates(problem, current())
    assert configs, problem.describe()
    a = draw(operands((m, k), torch_dtype))
    b = draw(operands((n, k) if layout == "linear" else (k, n), torch_dtype))
    return problem, draw(st.sampled_from(configs)), a, b, bias


def assert_within_rounding(out: torch.Tensor, problem: Problem, a, b, bias) -> None:
    """Every element within the problem's tolerance (verify.TOLERANCE) of the float64 reference,
    scaled by the magnitude of the terms summed into it, |a| |b| + |bias|: rounding of inputs,
    accumulation and output, not a misread operand."""
    ref = verify.reference(problem, a, b, bias)
    plain = Problem(problem.m, problem.n, problem.k, problem.dtype, problem.layout)
    magnitude = verify.reference(plain, a.abs(), b.abs(), None) + (0 if bias is None else bias.abs().double())
    assert out.shape == ref.shape, (out.shape, ref.shape)
    error = (out.double() - ref).abs()
    bound = 2 * verify.tolerance(problem) * magnitude + 1e-6
    worst = float((error - bound).max()) if error.numel() else 0.0
    assert bool((error <= bound).all()), f"{problem.describe()}: an element off by {worst:.3g} beyond its bound"


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's tier; the GPU tier is below")
@pytest.mark.parametrize("name", TRITON)
@KERNEL_EXAMPLES
@given(data=st.data())
def test_each_triton_wrapper_reads_every_view_of_its_operands(name, data):
    """Finding 1: every wrapper built directly, on views of a, b and the bias."""
    problem, config, a, b, bias = data.draw(kernel_cases(name))
    kernel = backends.build(problem, name, config.as_dict(), current())
    assert_within_rounding(kernel(a, b, bias), problem, a, b, bias)


@pytest.mark.interpreter
@settings(max_examples=20, deadline=None, database=None)
@given(data=st.data(), config=st.sampled_from(FFMA_CONFIGS), m=st.integers(1, 150), n=st.integers(1, 150),
       k=st.integers(1, 90), layout=st.sampled_from(["linear", "nn"]), bias=st.booleans())
def test_the_cuda_core_configs_read_every_view_of_their_operands(data, config, m, n, k, layout, bias):
    """The float32 configs of the CUDA cores' space (``triton_tiled.FFMA_CONFIGS``), which the
    space on this device may not hold, at any size and on views of a, b and the bias."""
    problem, where = Problem(m, n, k, "float32", layout, bias=bias), "cuda" if torch.cuda.is_available() else "cpu"
    a = data.draw(operands((m, k), torch.float32, device=where))
    b = data.draw(operands((n, k) if layout == "linear" else (k, n), torch.float32, device=where))
    c = data.draw(operands((n,), torch.float32, device=where)) if bias else None
    kernel = backends.build(problem, "triton_tiled", TiledConfig(*config[:3], 8, *config[3:]).as_dict(), current())
    assert_within_rounding(kernel(a, b, c), problem, a, b, c)


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's tier; the GPU tier is below")
@pytest.mark.parametrize("name", TRITON)
@settings(max_examples=30, deadline=None, database=None)
@given(data=st.data(), rank=st.sampled_from((2, 3)))
def test_linear_s_front_path_serves_every_view_like_the_wrapper(name, data, rank):
    """Finding 1, through ``gemmtune.linear``: the CPU served as if it were a GPU by the
    wrapper under test; the second identical call takes the front path."""
    problem, config, a, b, bias = data.draw(kernel_cases(name, layouts=("linear",)))
    x = a if rank == 2 else a.unsqueeze(0)
    act = None if problem.activation == "none" else problem.activation
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(calls, "falls_back", lambda first, n: False)
        patch.setattr(DISPATCHER, "kernels", {})
        patch.setattr(DISPATCHER, "front", {})
        key = calls.dispatch_key("linear", x, bias, problem.m, problem.n, problem.k, problem.activation)
        DISPATCHER.kernels[key] = backends.build(problem, name, config.as_dict(), current())
        first = gemmtune.linear(x, b, bias, act)
        assert len(DISPATCHER.front) == 1
        second = gemmtune.linear(x, b, bias, act)
    for out in (first, second):
        assert out.shape == (*x.shape[:-1], problem.n)
        assert_within_rounding(out.reshape(problem.m, problem.n), problem, a, b, bias)


# ----- GPU tier: the public functions served by each Triton backend ------------------------

# (M, N, K) each backend serves on an H100 or H200 (16-byte rows for the TMA kernels; the
# persistent one only with more tiles than SMs, in 16-bit types)
GPU_SHAPES = {
    "triton_tiled": ((7, 33, 65), (33, 40, 64), (1, 24, 40)),
    "triton_splitk": ((1, 33, 65), (7, 40, 64), (33, 24, 200)),
    "triton_stream": ((2, 40, 64), (16, 136, 40), (33, 24, 200)),
    "triton_persistent": ((2048, 2048, 64),),
}


@st.composite
def gpu_cases(draw, name: str):
    """(problem, config, x, weight or b, bias) on the GPU: x of rank 2 or 3 for linear, every
    operand in a drawn layout; the config one of the first three the backend offers."""
    m, n, k = draw(st.sampled_from(GPU_SHAPES[name]))
    dtype = draw(st.sampled_from(("float16", "bfloat16") if name == "triton_persistent" else KERNEL_DTYPES))
    layout = draw(st.sampled_from(("linear", "nn")))
    torch_dtype = DTYPES[dtype]
    linear = layout == "linear"
    bias = draw(st.none() | operands((n,), torch_dtype, device="cuda")) if linear else None
    act = draw(st.sampled_from(ACTIVATIONS)) if linear else "none"
    problem = Problem(m, n, k, dtype, layout, bias=bias is not None, activation=act)
    configs = backends.get(name).candidates(problem, current())
    assert configs, problem.describe()
    rows = (2, m // 2) if linear and m % 2 == 0 and draw(st.booleans()) else (m,)
    x = draw(operands((*rows, k), torch_dtype, device="cuda"))
    b = draw(operands((n, k) if linear else (k, n), torch_dtype, device="cuda"))
    return problem, draw(st.sampled_from(configs[:3])), x, b, bias


def serve_twice(name: str, problem: Problem, config, x, b, bias) -> list[torch.Tensor]:
    """``linear`` (``matmul`` for layout nn) called twice on the GPU, served by backend ``name``
    with ``config`` through a fresh store holding it for the problem: linear's second call takes
    the front path, which launches a bound binary with the caller's addresses where the kernel
    binds one."""
    act = None if problem.activation == "none" else problem.activation
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setenv("GEMMTUNE_MODE", "lookup")  # a stored choice that cannot be built is no silent tuning
        store = Store(folder)
        patch.setattr(DISPATCHER, "_store", store)
        DISPATCHER.forget()
        store.put(TuneResult(problem.key(), current().fingerprint(), name, config.as_dict(), 1.0, 1.0, 0.0))
        try:
            if problem.layout == "linear":
                outs = [gemmtune.linear(x, b, bias, act) for _ in range(2)]
                assert len(DISPATCHER.front) == 1
            else:
                outs = [gemmtune.matmul(x, b) for _ in range(2)]
            (kernel,) = DISPATCHER.kernels.values()
            assert type(kernel).__module__ == f"gemmtune.backends.{name}"
        finally:
            DISPATCHER.forget()
            store.close()
    return outs


def assert_served_right(outs: list, problem: Problem, x, b, bias) -> None:
    for out in outs:
        assert out.shape == (*x.shape[:-1], problem.n)
        assert_within_rounding(out.reshape(problem.m, problem.n), problem, x.reshape(problem.m, problem.k), b, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("name", TRITON)
@GPU_EXAMPLES
@given(data=st.data())
def test_on_the_gpu_each_triton_backend_serves_every_view(name, data):
    """Finding 1 on the GPU: views of every operand through ``linear`` and ``matmul`` served by
    the backend under test."""
    problem, config, x, b, bias = data.draw(gpu_cases(name))
    assert_served_right(serve_twice(name, problem, config, x, b, bias), problem, x, b, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("name", TRITON)
@pytest.mark.parametrize("view", ["strided", "expanded"])
def test_on_the_gpu_a_bias_of_another_stride_is_read_as_it_lies(name, view):
    """Finding 1 as reported, whatever the draws above: ``t[::2]`` and ``t[:1].expand(N)`` (one
    element allocated) through each backend, on the wrapper's call and the front path's."""
    m, n, k = GPU_SHAPES[name][0]
    problem = Problem(m, n, k, "bfloat16", "linear", bias=True, activation="relu")
    config = backends.get(name).candidates(problem, current())[0]
    x, b, _ = verify.make_operands(problem, "cuda", seed=0)
    bias = laid_out(torch.randn(n, device="cuda", dtype=torch.bfloat16), view)
    assert_served_right(serve_twice(name, problem, config, x, b, bias), problem, x, b, bias)
