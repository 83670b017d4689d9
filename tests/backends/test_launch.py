"""Direct launches: the first call per guard goes through Triton's JIT, later ones through the
binary's launcher; every variation of the operands that the JIT specializes on gets its own
binary, and results stay right."""

import pytest
import torch
import torch.nn.functional as F

from gemmtune.backends import get, launch
from gemmtune.backends.base import KernelBase
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning import verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TILED = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 1, "num_stages": 1}
FMA = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "USE_DOT": False, "num_warps": 1, "num_stages": 1}


def build(problem, name, config):
    backend = get(name)
    return backend.build(problem, backend.parse_config(config), current())


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path")
def test_the_interpreter_keeps_no_binary():
    problem = Problem(7, 33, 65, "float32", "linear", bias=True)
    kernel = build(problem, "triton_tiled", TILED)
    a, b, bias = verify.make_operands(problem, "cpu", seed=1)
    for _ in range(2):
        assert verify.rel_err(kernel(a, b, bias), verify.reference(problem, a, b, bias)) < 1e-5
    assert kernel._launch.binaries() == 0


class TwoDimensional(KernelBase):
    """A kernel of 2-D ``a`` only that binds its launch to a contiguous ``a``'s rows (as
    cuBLASLt's does): ``F.linear`` on the rows, the result (..., N); its binds (the rows' shape)
    and bound calls recorded."""

    def __init__(self) -> None:
        self.bound, self.bound_calls = [], 0

    def __call__(self, a, b, bias, out=None):
        assert a.dim() == 2
        return F.linear(a, b, bias)

    def bind(self, a, b, bias):
        rows = a.view(-1, a.shape[-1]) if a.is_contiguous() else a
        if rows.dim() != 2:
            return None
        self.bound.append(tuple(rows.shape))
        out_shape = (*a.shape[:-1], b.shape[0])

        def call(a, b, bias, pa, pb, pbias):
            assert a.data_ptr() == pa
            self.bound_calls += 1
            return F.linear(a.view(-1, a.shape[-1]), b, bias).view(out_shape)

        return call


def front_call(entry, x, w, bias):
    return entry(x, w, bias, x.data_ptr(), w.data_ptr(), bias.data_ptr())


def test_a_model_activation_binds_its_rows_for_a_kernel_of_2d_operands():
    """x (..., K) contiguous, served by a kernel that takes (M, K) alone: the front path takes the
    kernel's launch bound to x's rows, instead of calling the kernel's wrapper (and its checks)
    on every call. A non-contiguous x is bound by its rows too, made per call: a copy where its
    strides do not allow a view (a transposed x), a view where they do (the first K columns of
    wider rows); each call's own rows reach the launch, new values and all."""
    w, bias = torch.randn(6, 8), torch.randn(6)
    x = torch.randn(2, 3, 5, 8)
    kernel = TwoDimensional()
    entry = launch.front_entry(kernel, x, w, bias)
    for _ in range(2):
        out = front_call(entry, x, w, bias)
        assert out.shape == (2, 3, 5, 6) and torch.allclose(out, F.linear(x, w, bias), atol=1e-6)
    assert kernel.bound == [(30, 8)] and kernel.bound_calls == 2
    for make in (lambda: torch.randn(2, 5, 3, 8).transpose(1, 2), lambda: torch.randn(2, 3, 5, 16)[..., :8]):
        strided = make()
        kernel = TwoDimensional()
        entry = launch.front_entry(kernel, strided, w, bias)
        for _ in range(2):
            strided = make()
            out = front_call(entry, strided, w, bias)
            assert out.shape == (2, 3, 5, 6) and torch.allclose(out, F.linear(strided, w, bias), atol=1e-6)
        assert kernel.bound == [(30, 8)] and kernel.bound_calls == 2


@pytest.mark.parametrize("layout", ["permuted", "sliced rows", "offset", "expanded", "broadcast rows",
                                    "4-D transposed"])
def test_any_non_contiguous_activation_bound_by_its_rows_is_served_right(layout):
    """Every view a caller can pass as x (..., K), none contiguous: a permutation, a slice, an
    offset into a larger tensor, an expansion along a leading dimension (its rows a view with
    stride 0 or a copy): each call through the rows' bound launch equals ``F.linear``, new values
    in the same layout included."""
    w, bias = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    makes = {"permuted": lambda: torch.randn(5, 8, 3, dtype=torch.float64).permute(2, 0, 1),
             "sliced rows": lambda: torch.randn(3, 10, 8, dtype=torch.float64)[:, 2:7],
             "offset": lambda: torch.randn(3, 5, 16, dtype=torch.float64)[..., 4:12],  # rows: a view, offset
             "expanded": lambda: torch.randn(1, 5, 8, dtype=torch.float64).expand(3, 5, 8),
             "broadcast rows": lambda: torch.randn(8, dtype=torch.float64).expand(3, 5, 8),
             "4-D transposed": lambda: torch.randn(2, 8, 3, 4, dtype=torch.float64).permute(0, 2, 3, 1)}
    x = makes[layout]()
    assert not x.is_contiguous()
    kernel = TwoDimensional()
    entry = launch.front_entry(kernel, x, w, bias)
    for _ in range(3):
        x = makes[layout]()
        out = front_call(entry, x, w, bias)
        torch.testing.assert_close(out, F.linear(x, w, bias))
    assert kernel.bound_calls == 3


@pytest.mark.interpreter
def test_a_constexpr_the_kernel_lacks_is_refused():
    """Triton's interpreter drops a keyword the kernel has no parameter for, its compiler refuses
    it: the launcher refuses it on either path, so a wrong constexpr cannot pass the CPU tier."""
    from gemmtune.backends.kernels.scaled import scaled_reduce
    from gemmtune.backends.launch import Launcher

    ws, out = torch.zeros(2, 3, 4, device=DEVICE), torch.empty(3, 4, device=DEVICE)
    constexprs = dict(SCALING="tensor", HAS_BIAS=False, ACTIVATION="none", SPLIT_K=2, BLOCK_M=16, BLOCK_N=16,
                      num_warps=1, K=4)
    scale = torch.ones((), device=DEVICE)
    with pytest.raises(TypeError, match="scaled_reduce has no parameter K"):
        Launcher(scaled_reduce)((1, 1, 1), ("guard",), (ws, out, out, scale, scale), (0,) * 5,
                                (3, 4, 4, 1, 0, 0, 0), constexprs)


@pytest.mark.gpu
@pytest.mark.parametrize("name, config", [("triton_tiled", TILED), ("triton_splitk", FMA)])
def test_repeated_calls_launch_the_binary_and_stay_right(name, config):
    problem = Problem(7, 33, 65, "bfloat16", "linear", bias=True, activation="relu")
    kernel = build(problem, name, config)
    for seed in range(3):
        a, b, bias = verify.make_operands(problem, "cuda", seed=seed)
        out = kernel(a, b, bias)
        assert verify.rel_err(out, verify.reference(problem, a, b, bias)) <= verify.tolerance(problem)
    assert kernel._launch.binaries() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name, config", [("triton_tiled", TILED), ("triton_splitk", FMA)])
def test_strides_alignment_and_bias_each_get_their_own_binary(name, config):
    problem = Problem(7, 33, 64, "bfloat16", "linear")
    kernel = build(problem, name, config)
    a, b, _ = verify.make_operands(problem, "cuda", seed=0)
    wide = torch.randn(7, 65, device="cuda", dtype=torch.bfloat16)
    variants = {
        "contiguous": (a, b, None),
        "misaligned a": (wide[:, 1:], b, None),  # 2 bytes past a 16-byte boundary, row stride 65
        "transposed b storage": (a, b.t().contiguous().t(), None),
        "with bias": (a, b, torch.randn(33, device="cuda", dtype=torch.bfloat16)),
    }
    for label, (x, w, bias) in list(variants.items()) * 2:  # the second pass launches binaries directly
        reference = verify.reference(problem, x, w, bias)
        assert verify.rel_err(kernel(x, w, bias), reference) <= verify.tolerance(problem), label
    assert kernel._launch.binaries() == len(variants)


@pytest.mark.gpu
def test_launch_hooks_send_calls_through_the_jit():
    from triton import knobs

    problem = Problem(16, 32, 32, "float16", "linear")
    kernel = build(problem, "triton_tiled", TILED)
    a, b, _ = verify.make_operands(problem, "cuda", seed=0)
    kernel(a, b, None)
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        out = kernel(a, b, None)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert seen and verify.rel_err(out, verify.reference(problem, a, b, None)) <= verify.tolerance(problem)


def test_a_hook_counts_only_when_one_is_set():
    from triton.knobs import HookChain

    from gemmtune.backends.launch import _hooked

    chain = HookChain()
    assert not _hooked(chain) and not _hooked(None) and _hooked(print)
    chain.add(print)
    assert _hooked(chain)


def test_the_guard_tells_apart_what_the_jit_specializes_on():
    from gemmtune.backends.launch import gemm_guard

    def guard(a, b, bias=None, out=None):
        return gemm_guard(a, b, bias, out, a.stride(), b.stride(), a.data_ptr(), b.data_ptr(),
                          0 if bias is None else bias.data_ptr())

    a, b = torch.randn(8, 64), torch.randn(32, 64)
    base = guard(a, b)
    assert guard(torch.randn(8, 64), torch.randn(32, 64)) == base  # fresh operands alike: one binary
    wide = torch.randn(8, 65)
    variants = [guard(wide[:, 1:], b), guard(a, b.t().contiguous().t()), guard(a.half(), b.half()),
                guard(a, b, torch.randn(32)), guard(a, b, out=torch.empty(8, 32)), guard(torch.randn(9, 64), b)]
    assert len({base, *variants}) == len(variants) + 1


def test_hints_mark_the_alignment_triton_cannot_see():
    from gemmtune.backends.launch import gemm_hints

    # (m, n, k, then the strides of a, of b as (K, N), of the output): rows of 1000 and 4100
    # elements, a linear layout's weight (N, K), a contiguous output.
    scalars = (7, 1000, 4100, 4100, 1, 1, 4100, 1000, 1)
    assert gemm_hints(scalars) == {"HINTS": (8, 4, 4, 1, 1, 4, 8, 1)}
    # Multiples of 16 Triton marks itself; odd values and zero strides (broadcast) get nothing.
    assert gemm_hints((1, 1024, 33, 0, 1, 1, 33, 1024, 1)) == {"HINTS": (1, 1, 1, 1, 1, 1, 1, 1)}
    for scalars in [(5, 24, 40, 40, 1, 24, 1, 24, 1), (2, 1002, 6, 6, 1, 1, 6, 1002, 1)]:
        for value, hint in zip(scalars[1:], gemm_hints(scalars)["HINTS"]):
            assert value % hint == 0 and (hint == 1 or value % 16)  # never a claim that is false


@pytest.mark.interpreter
@pytest.mark.parametrize("name, config", [("triton_tiled", TILED), ("triton_splitk", FMA)])
def test_a_model_activation_of_any_rank_is_served_in_place(name, config):
    """x (batch, tokens, K), contiguous or a strided view, straight into a kernel launched through
    gemm_call: the output is (batch, tokens, N) and right."""
    problem = Problem(6, 24, 40, "float32", "linear", bias=True)
    kernel = build(problem, name, config)
    w, bias = torch.randn(24, 40, device=DEVICE), torch.randn(24, device=DEVICE)
    contiguous = torch.randn(2, 3, 40, device=DEVICE)
    strided = torch.randn(2, 5, 40, device=DEVICE)[:, 1:4]  # rows of a (2, 5, K) tensor
    for x in (contiguous, strided, contiguous[:, :1]):
        out = kernel(x, w, bias)
        assert out.shape == (*x.shape[:-1], 24) and out.is_contiguous()
        assert verify.rel_err(out, F.linear(x.double(), w.double(), bias.double())) < 1e-5
    with pytest.raises(ValueError, match="out= takes a 2-D a"):
        kernel(contiguous, w, bias, out=torch.empty(6, 24, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("name, config", [("triton_tiled", TILED), ("triton_splitk", FMA),
                                          ("triton_splitk", dict(FMA, SPLIT_K=1))])
def test_a_bound_launch_serves_new_operands_like_the_wrapper(name, config):
    """``bind`` after a first call: the launch bound to those sizes, strides and alignment
    takes new operands' addresses and stays right, 2-D and 3-D; none before a binary exists;
    a launch hook sends it back through the wrapper."""
    problem = Problem(7, 33, 65, "bfloat16", "linear", bias=True, activation="relu")
    kernel = build(problem, name, config)
    a, b, bias = verify.make_operands(problem, "cuda", seed=0)
    assert kernel.bind(a, b, bias) is None
    for x in (a, a.reshape(1, 7, 65)):
        kernel(x, b, bias)
        call = kernel.bind(x, b, bias)
        for seed in (1, 2):
            a2, b2, bias2 = verify.make_operands(problem, "cuda", seed=seed)
            x2 = a2.reshape(x.shape)
            out = call(x2, b2, bias2, x2.data_ptr(), b2.data_ptr(), bias2.data_ptr())
            assert out.shape == (*x.shape[:-1], 33)
            ref = verify.reference(problem, a2, b2, bias2)
            assert verify.rel_err(out.reshape(7, 33), ref) <= verify.tolerance(problem)
    from triton import knobs

    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        out = call(x2, b2, bias2, x2.data_ptr(), b2.data_ptr(), bias2.data_ptr())
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert seen and verify.rel_err(out.reshape(7, 33), ref) <= verify.tolerance(problem)


def test_the_front_entry_calls_cublas_linear_itself_and_flattens_only_for_two_d_kernels(monkeypatch):
    """A cuBLAS-served front entry calls F.linear itself (not the backend's wrapper) on the
    caller's x of any rank; a kernel that serves only 2-D x is called as it is for 2-D calls,
    through a flattening wrapper for 3-D. Neither binds: the addresses are not used."""
    import gemmtune.backends.cublas as cublas
    from gemmtune.backends.base import function_kernel
    from gemmtune.backends.launch import any_rank, front_entry

    seen = []
    monkeypatch.setattr(cublas._linear, "front", lambda a, b, bias: seen.append(a.dim()) or F.linear(a, b, bias))
    x, w = torch.randn(2, 3, 8), torch.randn(5, 8)
    for kernel in (cublas._linear, any_rank(cublas._linear)):
        assert torch.allclose(front_entry(kernel, x, w, None)(x, w, None, 0, 0, 0), F.linear(x, w))
    assert seen == [3, 3]
    calls = []

    def two_d(a, b, bias):
        calls.append(a.dim())
        return F.linear(a, b, bias)

    two_d = function_kernel(two_d)
    x2 = x.reshape(6, 8)
    assert torch.allclose(front_entry(two_d, x2, w, None)(x2, w, None, 0, 0, 0), F.linear(x2, w))
    assert torch.allclose(front_entry(two_d, x, w, None)(x, w, None, 0, 0, 0), F.linear(x, w))
    assert calls == [2, 2]


@pytest.mark.gpu
@pytest.mark.parametrize("name, config", [("triton_tiled", TILED), ("triton_splitk", FMA)])
def test_a_non_contiguous_activation_gets_a_launch_bound_to_its_rows(name, config):
    """x (batch, K, tokens) transposed, as an MLP-Mixer's token mixing passes it (its rows a copy
    per call), and x the first K columns of wider rows (its rows a view): the front entry is the
    launch bound to the rows, right on new activations of that layout, with the bias and the
    activation."""
    from gemmtune.backends.launch import front_entry

    problem = Problem(2 * 33, 24, 40, "bfloat16", "linear", bias=True, activation="gelu")
    kernel = build(problem, name, config)
    _, w, bias = verify.make_operands(problem, "cuda", seed=0)
    layouts = {"transposed": lambda g: torch.randn(2, 40, 33, device="cuda", generator=g).bfloat16().transpose(1, 2),
               "sliced": lambda g: torch.randn(2, 33, 56, device="cuda", generator=g).bfloat16()[..., :40]}
    for seed, (layout, make) in enumerate(layouts.items()):
        g = torch.Generator("cuda").manual_seed(seed)
        x = make(g)
        kernel(x, w, bias)  # the first call makes the binary a bound launch needs
        entry = front_entry(kernel, x, w, bias)
        assert entry.__qualname__.startswith("_rows_launch"), layout
        for _ in range(2):
            x = make(g)
            out = entry(x, w, bias, x.data_ptr(), w.data_ptr(), bias.data_ptr())
            assert out.shape == (2, 33, 24) and out.is_contiguous()
            ref = verify.reference(problem, x.reshape(-1, 40), w, bias)
            assert verify.rel_err(out.reshape(-1, 24), ref) <= verify.tolerance(problem), layout


STREAM = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}


@pytest.mark.parametrize("name, config", [("triton_tiled", TILED), ("triton_splitk", FMA), ("triton_stream", STREAM)])
def test_no_launch_is_bound_to_a_bias_the_kernels_cannot_read_in_place(name, config, monkeypatch):
    """Finding 1 (issue 26): a bound launch passes the caller's bias address to the binary, which
    reads element i at bias + i; for a strided or expanded bias the wrapper's own call copies
    it, so ``bind`` must leave such calls to the wrapper. (A binary is faked: the interpreter
    keeps none.)"""
    import gemmtune.backends.triton_stream as stream

    problem = Problem(8, 32, 32, "float16", "linear", bias=True)
    kernel = build(problem, name, config)
    binary = (None, (1, 1, 1), None, 0, None, (), (), None)  # what Launcher.direct returns, in shape
    monkeypatch.setattr(kernel._launch, "direct", lambda guard, grid, scalars: binary)
    monkeypatch.setattr(stream, "_tma_encoders", lambda launch: (None, None, None))
    a, b, _ = verify.make_operands(problem, DEVICE, seed=0)
    t = torch.randn(64, dtype=torch.float16, device=DEVICE)
    for bias in (None, t[:32], t[1:33]):
        assert kernel.bind(a, b, bias) is not None
    for bias in (t[::2], t[:1].expand(32)):
        assert kernel.bind(a, b, bias) is None
