"""The CuTe DSL backend: its space per architecture, configs read from untrusted data, pruning by
the device and the problem, availability; on the GPU (with ``gemmtune[cute]`` installed), every
kind of config against float64."""

import importlib.metadata

import pytest
import torch

from gemmtune.backends import cute, get
from gemmtune.backends.cute import CuteConfig
from gemmtune.device import Device, kernel_library_versions
from gemmtune.problem import Problem

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 << 20)
SM38 = Device("NVIDIA H100 80GB HBM3", (9, 0), 38, 232448, 50 << 20)
SMALL_SMEM = Device("a Hopper with less shared memory", (9, 0), 132, 101376, 50 << 20)
B200 = Device("NVIDIA B200", (10, 0), 148, 232448, 126 << 20)
A100 = Device("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912, 40 << 20)


def test_the_spaces_of_hopper_and_blackwell():
    assert len(cute.space_of(9)) == 44 == get("cute").space_size
    assert len(cute.space_of(10)) == 2 * 8 * 4 * 2 * 2
    for arch in (9, 10):
        configs = cute.space_of(arch)
        assert len(set(configs)) == len(configs)
        assert all(CuteConfig(**c.as_dict()) == c for c in configs)  # each valid when built from its fields
    assert not any(c.pingpong for c in cute.space_of(10))  # Blackwell has no ping-pong warpgroups


@pytest.mark.parametrize("arch", [9, 10])
@pytest.mark.parametrize("scaled", [False, True])
def test_every_config_round_trips_through_the_store(arch, scaled):
    backend = get("cute")
    for config in cute.space_of(arch, scaled):
        assert backend.parse_config(config.as_dict()) == config
        assert config.key().startswith(f"arch={arch},tile_m=")


@pytest.mark.parametrize("change,message", [
    ({"tile_n": 112}, "not in sm_90's space"),
    ({"tile_m": 256, "pingpong": True}, "not in sm_90's space"),
    ({"cluster_m": 4}, "not in sm_90's space"),
    ({"dynamic_persistent": True}, "not in sm_90's space"),
    ({"arch": 8}, "arch=8 is not one of"),
    ({"tile_m": True}, "must be ints"),
    ({"tile_n": "128"}, "must be ints"),
    ({"swap_ab": 1}, "must be true or false"),
])
def test_a_config_outside_the_space_is_refused_with_what_is_accepted(change, message):
    data = {**cute.space_of(9)[0].as_dict(), **change}
    with pytest.raises(ValueError, match=message):
        get("cute").parse_config(data)


def test_a_config_with_missing_or_extra_keys_is_refused():
    data = cute.space_of(9)[0].as_dict()
    with pytest.raises(ValueError, match="needs exactly the keys"):
        get("cute").parse_config({k: v for k, v in data.items() if k != "swap_ab"})
    with pytest.raises(ValueError, match="needs exactly the keys"):
        get("cute").parse_config({**data, "num_stages": 3})


def test_the_shared_memory_prunes_the_widest_tiles():
    problem = Problem(4096, 4096, 4096)
    full, small = cute.space(problem, H100), cute.space(problem, SMALL_SMEM)
    assert len(full) == 44
    assert {(c.tile_m, c.tile_n) for c in small} < {(c.tile_m, c.tile_n) for c in full}
    assert all(c.stages(2, SMALL_SMEM.smem_per_block) >= cute.MIN_STAGES for c in small)
    assert (256, 208) not in {(c.tile_m, c.tile_n) for c in small}


def test_few_rows_run_as_the_transpose_and_few_columns_as_the_product():
    assert {c.swap_ab for c in cute.space(Problem(1, 4096, 4096), H100)} == {True}
    assert {c.swap_ab for c in cute.space(Problem(4096, 16, 4096), H100)} == {False}
    assert {c.swap_ab for c in cute.space(Problem(512, 768, 768), H100)} == {False, True}
    assert cute.space(Problem(512, 768, 768), SM38)  # clusters of 2 fit 38 SMs


@pytest.mark.parametrize("problem", [Problem(512, 768, 4095), Problem(512, 4097, 768),
                                     Problem(512, 768, 768, "float32"), Problem(32, 768, 768, activation="gelu")])
def test_a_problem_the_kernels_do_not_take_has_no_candidates(problem):
    assert cute.space(problem, H100) == []


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_an_activation_runs_in_the_epilogue_of_the_product_itself(activation):
    """Every activation gemmtune fuses has QuACK's epilogue, the exact-erf GELU included; a fused
    problem's kernels never run as the transpose (the bias would become a column)."""
    plain, fused = Problem(512, 768, 768, bias=True), Problem(512, 768, 768, bias=True, activation=activation)
    assert cute.EPILOGUES[activation] is not None and cute.takes(fused)
    assert cute.space(fused, H100) == [c for c in cute.space(plain, H100) if not c.swap_ab]
    assert cute.EPILOGUES["gelu"] == "gelu_erf" and cute.EPILOGUES["gelu_tanh"] == "gelu_tanh_approx"


def test_only_hopper_with_the_package_runs_it(monkeypatch):
    backend = get("cute")
    monkeypatch.setattr(cute, "installed", lambda: True)
    assert backend.is_available(H100)
    assert not backend.is_available(B200)  # its space is defined, its kernels not run here
    assert not backend.is_available(A100) and cute.space(Problem(512, 768, 768), A100) == []
    monkeypatch.setattr(cute, "installed", lambda: False)
    assert not backend.is_available(H100)


def test_the_interpreter_never_offers_it():
    from gemmtune.device import interpreter_device

    assert not get("cute").is_available(interpreter_device())


def test_a_config_counts_as_compiled_once_its_first_call_left_its_marker(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0")
    kernel_library_versions.cache_clear()
    problem = Problem(2048, 4096, 4096, "bfloat16", "linear")
    configs = cute.space(problem, H100)[:3]
    assert cute.BACKEND.compiled(problem, configs) == []
    cute._leave(cute.marker(problem, configs[1]))
    assert cute.BACKEND.compiled(problem, configs) == [configs[1]]
    # another shape of the same kind shares the compiled kernel; another kind does not
    assert cute.BACKEND.compiled(Problem(16, 1024, 512, "bfloat16", "linear"), configs) == [configs[1]]
    for other in (Problem(2048, 4096, 4096, "float16", "linear"), Problem(2048, 4096, 4096, "bfloat16", "nn"),
                  Problem(2048, 4096, 4096, "bfloat16", "linear", bias=True),
                  Problem(2048, 4096, 4096, "bfloat16", "linear", activation="gelu")):
        assert cute.BACKEND.compiled(other, configs) == []
    # a kernel with an activation in its epilogue is one kernel per activation
    gelu, silu = (Problem(2048, 4096, 4096, "bfloat16", "linear", activation=a) for a in ("gelu", "silu"))
    cute._leave(cute.marker(gelu, configs[2]))
    assert cute.BACKEND.compiled(gelu, configs) == [configs[2]] and cute.BACKEND.compiled(silu, configs) == []
    assert cute.BACKEND.compiled(problem, configs) == [configs[1]]
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.0")  # a new package: compiled anew
    kernel_library_versions.cache_clear()
    assert cute.BACKEND.compiled(problem, configs) == []
    kernel_library_versions.cache_clear()


def test_fp8_products_scaled_per_tensor_or_row_run_as_themselves_on_tiles_of_their_own():
    """An fp8 product runs as itself (a row's scales would lie along the other side of the
    transpose), on the tiles whose two float32 accumulators fit a thread's registers on sm_90
    (Blackwell: its 16-bit tiles); none where it has few rows, block scales or an activation, or
    K rows of other than 16 bytes."""
    fp8 = list(cute.space_of(9, scaled=True))
    assert len(fp8) == 20 and not any(c.swap_ab for c in fp8)
    assert all(c.tile_m * c.tile_n // (128 if c.pingpong else 256) <= 104 for c in fp8)
    assert {(c.tile_m, c.tile_n, c.pingpong) for c in cute.space_of(10, scaled=True)} == set(cute.TILES[10])
    for dtype in cute.SCALED_DTYPES:
        for scaling in cute.SCALINGS:
            problem = Problem(2048, 4096, 4096, dtype, bias=True, scaling=scaling)
            assert cute.takes(problem) and cute.space(problem, H100) == fp8
    # 128 fp8 elements of K a stage, as many bytes as 64 16-bit ones: a wider output alone prunes more
    assert len(cute.space(Problem(2048, 4096, 4096, "float8_e4m3fn", scaling="row", out_dtype="float32"),
                          SMALL_SMEM)) < len(cute.space(Problem(2048, 4096, 4096, "float8_e4m3fn", scaling="row"),
                                                        SMALL_SMEM))
    for problem in (Problem(32, 4096, 4096, "float8_e4m3fn", scaling="row"),
                    Problem(2048, 4096, 4096, "float8_e4m3fn", scaling="block"),
                    Problem(2048, 4096, 4096, "float8_e4m3fn", scaling="tensor", activation="gelu"),
                    Problem(2048, 4096, 4104, "float8_e4m3fn", scaling="tensor")):
        assert cute.space(problem, H100) == [], problem.describe()


def test_fp8_configs_are_ranked_as_tiles_of_their_own_k_and_rate():
    backend, problem = get("cute"), Problem(8192, 4096, 4096, "float8_e4m3fn", scaling="row")
    for config in cute.space(problem, H100):
        fp8_ms = backend.predict_ms(problem, H100, config)
        assert 0 < fp8_ms < backend.predict_ms(Problem(8192, 4096, 4096), H100, config)


def test_an_fp8_kernel_is_compiled_once_per_scaling_and_output(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0")
    kernel_library_versions.cache_clear()
    try:
        config = cute.space(Problem(2048, 4096, 4096), H100)[0]
        kinds = [Problem(2048, 4096, 4096, dtype, scaling=scaling, out_dtype=out)
                 for dtype in cute.SCALED_DTYPES for scaling in cute.SCALINGS for out in ("bfloat16", "float32")]
        markers = {cute.marker(p, config) for p in kinds + [Problem(2048, 4096, 4096)]}
        assert len(markers) == len(kinds) + 1
        # another shape of the same kind: the same kernel
        assert cute.marker(Problem(128, 1024, 512, "float8_e4m3fn", scaling="row"), config) == \
            cute.marker(Problem(2048, 4096, 4096, "float8_e4m3fn", scaling="row"), config)
    finally:
        kernel_library_versions.cache_clear()


class _Pending(BaseException):
    """What QuACK's compile cache raises while a worker compiles the call's kernel (a
    BaseException, as QuACK's ``CompilePending``)."""


def test_calls_are_made_again_until_their_compile_is_done(monkeypatch):
    monkeypatch.setattr(cute, "POOL_POLL_S", 0.0)
    made = []

    def call(name, pending_times):
        def make():
            made.append(name)
            if made.count(name) <= pending_times:
                raise _Pending(name)
        return make

    def fails():
        made.append("fails")
        raise RuntimeError("not a compile the pool can take")

    cute.until_ready([call("ready", 0), call("slow", 3), fails, call("quick", 1)], _Pending,
                     cute.time.monotonic() + 60)
    assert made.count("ready") == 1 and made.count("quick") == 2 and made.count("slow") == 4
    assert made.count("fails") == 1  # dropped: the caller's own call meets it again and reports it


def test_calls_still_waiting_at_the_deadline_are_left_to_the_caller(monkeypatch):
    monkeypatch.setattr(cute, "POOL_POLL_S", 0.0)
    made = []

    def never():
        made.append(1)
        raise _Pending()

    cute.until_ready([never], _Pending, cute.time.monotonic() + 0.05)  # returns: no hang, no raise
    assert made


class _TorchQuack:
    """QuACK's entry points that ``CuteKernel`` calls, computed by torch on the CPU, counting the
    launches and, apart, the plans QuACK resolves (on the GPU: a key and a lookup, or a compile)."""

    def __init__(self):
        self.resolved, self.launched = 0, 0

    def GemmConfig(self, **fields):  # noqa: N802 - QuACK's class name
        return fields

    @staticmethod
    def compute(a, b_kn, bias, activation=None):
        from gemmtune.activation import apply

        product = a.double() @ b_kn.double() + (0 if bias is None else bias.double())
        return product if activation is None else apply(product, _GEMMTUNE_NAME[activation], inplace=False)

    def gemm_tuned(self, a, b_kn, out, *, bias, config):
        assert_aligned(bias)
        self.resolved += 1
        self.launched += 1
        out.copy_(self.compute(a, b_kn, bias))
        return config, 1, False, ("plan", a.shape, a.stride())

    def gemm_execute(self, a, b_kn, out, c, *, bias, dispatch_plan, **fixed):
        assert dispatch_plan == ("plan", a.shape, a.stride()) and c is None
        assert_aligned(bias)
        self.launched += 1
        out.copy_(self.compute(a, b_kn, bias))

    def linear_act_mod(self, activation, *, gated, has_c, has_rowvec, has_colvec):
        quack = self

        class Plan:
            def __init__(self, layout):
                self.layout = layout

            def run(self, a, b_kn, *, out, tile_count_semaphore, **operands):
                assert (a.shape, a.stride(), "mRowVecBroadcast" in operands) == self.layout
                assert_aligned(*operands.values())
                quack.launched += 1
                out["mAuxOut"].copy_(quack.compute(a, b_kn, operands.get("mRowVecBroadcast"), activation))

        class Mod:
            def plan(self, a, b_kn, *, out, config, **operands):
                assert has_rowvec == ("mRowVecBroadcast" in operands) and not (gated or has_c or has_colvec)
                quack.resolved += 1
                return Plan((a.shape, a.stride(), has_rowvec))

        return Mod()

    @property
    def scaled_mods(self):
        """The fp8 epilogues: gemmtune's own epilogue functions, on the float64 sums of torch."""
        quack = self

        class Plan:
            def __init__(self, layout, epilogue):
                self.layout, self.epilogue = layout, epilogue

            def run(self, a, b_kn, *, out, tile_count_semaphore, scale_a, scale_b, **bias):
                assert (a.shape, a.stride(), scale_a.shape, scale_b.shape, tuple(bias)) == self.layout
                assert_aligned(scale_a, scale_b, *bias.values())
                quack.launched += 1
                acc = a.double() @ b_kn.double()
                vectors = {"scale_a": scale_a.double().reshape(-1, 1), "scale_b": scale_b.double().reshape(1, -1)}
                vectors.update({name: v.double() for name, v in bias.items()})
                out["D"].copy_(self.epilogue(acc, **vectors)["D"])

        class Mod:
            def __init__(self, epilogue):
                self.epilogue = epilogue

            def plan(self, a, b_kn, *, out, config, scale_a, scale_b, **bias):
                quack.resolved += 1
                return Plan((a.shape, a.stride(), scale_a.shape, scale_b.shape, tuple(bias)), self.epilogue)

        return {(scaling, bias): Mod(cute.scaled_bias_epilogue if bias else cute.scaled_epilogue)
                for scaling in cute.SCALINGS for bias in (False, True)}


_GEMMTUNE_NAME = {quack: name for name, quack in cute.EPILOGUES.items()}


def assert_aligned(*vectors):
    """What QuACK compiles its vector loads for: contiguous, 16-byte aligned (or no vector)."""
    for vector in vectors:
        assert vector is None or vector.is_contiguous() and vector.data_ptr() % 16 == 0


def test_a_bias_off_its_alignment_is_copied_and_never_bound(monkeypatch):
    """A bias view one element into its storage (stride 1, 2 bytes off 16) reaches QuACK as an
    aligned copy, and the front path binds no launch for it."""
    quack = _TorchQuack()
    monkeypatch.setattr(cute, "_quack", lambda: quack)
    monkeypatch.setattr(cute, "_leave", lambda path: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    m, n, k = 33, 72, 40
    problem = Problem(256, n, k, "bfloat16", "linear", True)
    kernel = cute.CuteKernel(problem, cute.space(problem, H100)[0])
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n + 1, dtype=torch.bfloat16)[1:]
    assert bias.stride() == (1,) and bias.data_ptr() % 16
    expected = quack.compute(a, b.t(), bias)
    out = kernel(a, b, bias)
    assert ((out.double() - expected).abs().max() / expected.abs().max()).item() < 2e-2
    assert kernel.bind(a, b, bias) is None and kernel.bind(a, b, bias.clone()) is not None


@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
def test_each_layout_of_operands_is_resolved_once_then_replayed(monkeypatch, activation, bias):
    """Through QuACK's entry points as torch computes them: a layout of operands seen before
    launches its plan (fresh data, right answers), a new layout is resolved anew, and the front
    path's bound call replays what the kernel's own call resolved."""
    quack = _TorchQuack()
    monkeypatch.setattr(cute, "_quack", lambda: quack)
    monkeypatch.setattr(cute, "kernel_library_versions", lambda: {"quack-kernels": "0", "nvidia-cutlass-dsl": "0"})
    monkeypatch.setattr(cute, "_leave", lambda path: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    m, n, k = 33, 72, 40
    problem = Problem(256, n, k, "bfloat16", "linear", bias, activation=activation)  # any rows: a kernel takes them
    kernel = cute.CuteKernel(problem, cute.space(problem, H100)[0])

    def operands(*lead, view="plain"):
        a = torch.randn(*lead, k + 8, dtype=torch.bfloat16)
        a = a[..., 8:] if view == "offset" else a[..., :k].contiguous()
        return a, torch.randn(n, k, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16) if bias else None

    def check(out, a, b, bias_t):
        expected = quack.compute(a.reshape(-1, k), b.t(), bias_t, cute.EPILOGUES[activation])
        assert out.shape == (*a.shape[:-1], n)
        assert ((out.reshape(-1, n).double() - expected).abs().max() / expected.abs().max()).item() < 2e-2

    for resolved, a_shape, view in [(1, (m,), "plain"), (1, (m,), "plain"),  # a layout seen before: replayed
                                    (1, (3, 11), "plain"),  # the same rows, from a 3-D input
                                    (2, (m,), "offset")]:  # rows of another stride: resolved anew
        a, b, bias_t = operands(*a_shape, view=view)
        launched = quack.launched
        check(kernel(a, b, bias_t), a, b, bias_t)
        assert (quack.resolved, quack.launched) == (resolved, launched + 1)
    a, b, bias_t = operands(3, 11)
    call = kernel.bind(a, b, bias_t)
    a, _, bias_t = operands(3, 11)
    check(call(a, b, bias_t, 0, 0, 0), a, b, bias_t)
    assert (quack.resolved, quack.launched) == (2, 5)
    # nothing to bind: a layout not resolved yet, a 3-D view whose rows a call would copy
    assert kernel.bind(*operands(5)) is None
    a, b, bias_t = operands(11, 3)
    assert kernel.bind(a.transpose(0, 1), b, bias_t) is None


@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("bias", [True, False])
def test_an_fp8_product_is_scaled_in_the_epilogue_and_replayed_per_layout(monkeypatch, scaling, bias):
    """The fp8 kernel's epilogue functions (gemmtune's, run here on torch's sums) against the
    float64 product of the dequantized operands: scales given as ``Problem.scaling`` lays them
    ((M, 1) and (N, 1) per row, even as views QuACK cannot read), a layout seen before replayed,
    the output written into ``out`` where given, in the problem's output dtype where not."""
    from gemmtune.scaling import dequantize, quantize

    quack = _TorchQuack()
    monkeypatch.setattr(cute, "_quack", lambda: quack)
    monkeypatch.setattr(cute, "_leave", lambda path: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    m, n, k = 70, 48, 64
    problem = Problem(m, n, k, "float8_e4m3fn", bias=bias, scaling=scaling, out_dtype="float32")
    kernel = get("cute").build(problem, cute.space(problem, H100)[0], H100)
    assert isinstance(kernel, cute.CuteScaledKernel) and kernel.bind(None, None, None) is None

    def operands(strided_scales=False):
        (a, sa), (b, sb) = (quantize(torch.randn(rows, k), torch.float8_e4m3fn, scaling, weight)
                            for rows, weight in ((m, False), (n, True)))
        if strided_scales and scaling == "row":  # A's strided, B's 4 bytes off its alignment
            sa = torch.zeros(m, 2)[:, :1].copy_(sa)
            sb = torch.zeros(n + 1)[1:].view(n, 1).copy_(sb)
        bias_t = torch.randn(n) if bias else None
        expected = dequantize(a, sa, scaling, False) @ dequantize(b, sb, scaling, True).t()
        return (a, b, bias_t, sa, sb), expected + (bias_t.double() if bias else 0)

    for resolved, strided in [(1, False), (1, False), (1, True)]:
        inputs, expected = operands(strided)
        out = kernel(*inputs)
        assert out.dtype == torch.float32 and (out.double() - expected).abs().max() < 1e-4 * expected.abs().max()
        assert quack.resolved == resolved
    inputs, expected = operands()
    given = torch.full((m, n), float("nan"))
    assert kernel(*inputs, out=given) is given and (given.double() - expected).abs().max() < 1e-4 * expected.abs().max()
    with pytest.raises(ValueError, match="scale_a"):
        kernel(inputs[0], inputs[1], inputs[2], torch.ones(m + 1, 1), inputs[4])


def test_the_cost_model_ranks_the_transpose_as_the_tiles_it_walks():
    backend = get("cute")
    decode, tall = Problem(16, 4096, 4096), Problem(4096, 16, 4096)
    for config in cute.space(decode, H100):
        twin = CuteConfig(**{**config.as_dict(), "swap_ab": False})
        assert backend.predict_ms(decode, H100, config) == pytest.approx(backend.predict_ms(tall, H100, twin))
    assert all(backend.predict_ms(Problem(4096, 4096, 4096), H100, c) > 0 for c in cute.space_of(9))


# --------------------------------------------------------------------------------------------
# On the GPU, with gemmtune[cute] installed


def relative_error(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
@pytest.mark.parametrize("m", [1, 7, 33, 512])
@pytest.mark.parametrize("layout,bias,view", [("linear", True, "plain"), ("linear", False, "offset"),
                                              ("nn", True, "transposed")])
def test_each_kind_of_config_matches_float64(m, layout, bias, view):
    n, k = 264, 520
    problem = Problem(m, n, k, "bfloat16", layout, bias)
    configs = cute.space(problem, _current())
    kinds = {(c.pingpong, c.swap_ab, c.cluster_m): c for c in configs}  # one of each kind
    assert kinds
    a = torch.randn(m, k + 8, device="cuda", dtype=torch.bfloat16)
    a = a[:, 8:] if view == "offset" else a[:, :k]
    if layout == "linear":
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    else:  # (K, N): row-major, or the transposed view of an (N, K) tensor
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if view == "transposed" else \
            torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    bias_t = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    expected = a.double() @ (b.double().t() if layout == "linear" else b.double())
    if bias_t is not None:
        expected += bias_t.double()
    for config in kinds.values():
        out = get("cute").build(problem, config, _current())(a, b, bias_t)
        assert out.shape == (m, n) and relative_error(out, expected) < 2e-2, config.key()


def _current():
    from gemmtune.device import current

    return current()


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False])
def test_each_activation_in_the_epilogue_matches_float64(activation, bias):
    """The epilogue's activation against torch's on the float64 product, with and without a bias."""
    from gemmtune.activation import apply

    m, n, k = 200, 264, 520
    problem = Problem(m, n, k, "bfloat16", "linear", bias, activation=activation)
    configs = cute.space(problem, _current())
    kinds = {(c.pingpong, c.cluster_m): c for c in configs}
    assert kinds
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 8
    bias_t = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    expected = a.double() @ b.double().t() + (bias_t.double() if bias else 0)
    expected = apply(expected, activation, inplace=False)
    for config in kinds.values():
        out = get("cute").build(problem, config, _current())(a, b, bias_t)
        assert out.shape == (m, n) and relative_error(out, expected) < 2e-2, config.key()


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
def test_configs_first_called_from_several_threads_at_once_compile_and_match_float64():
    """The tuner compiles candidates ahead in threads: each config's first call, from its own
    thread, all at once."""
    from concurrent.futures import ThreadPoolExecutor

    problem = Problem(256, 512, 384, "bfloat16", "linear")
    configs = cute.space(problem, _current())[:6]
    a = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    expected = a.double() @ b.double().t()
    with ThreadPoolExecutor(len(configs)) as pool:
        outs = list(pool.map(lambda c: get("cute").build(problem, c, _current())(a, b, None), configs))
    for config, out in zip(configs, outs):
        assert relative_error(out, expected) < 2e-2, config.key()


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
def test_the_tuner_times_cute_candidates_on_a_prefill_shape():
    """Compiled ahead in threads, verified and screened: no cute trial fails."""
    from gemmtune.tuning.tuner import TuneOptions, tune_problem

    problem = Problem(2048, 6144, 4096, "bfloat16", "linear")
    result = tune_problem(problem, _current(), options=TuneOptions(backends=("cublas", "cute")))
    trials = [t for t in result.trials if t.backend == "cute"]
    assert trials and all(t.ok for t in trials), [t.reason for t in trials if not t.ok]


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
def test_candidates_compiled_ahead_together_run_and_match_float64():
    """The tuner's compile ahead hands cute's candidates to QuACK's worker processes together;
    each then runs in this process and matches float64."""
    from gemmtune.activation import apply
    from gemmtune.tuning import compiler, verify

    problems = [Problem(320, 384, 256, "bfloat16", "linear", True, activation="gelu"),
                Problem(320, 384, 256, "bfloat16", "linear", True)]
    jobs = []
    for problem in problems:
        operands = verify.make_operands(problem, "cuda", seed=0)
        jobs += [(problem, "cute", config.as_dict(), operands) for config in cute.space(problem, _current())[:4]]
    done = compiler.compile_ahead(jobs, _current())
    assert [d.status.value for d in done] == ["ok"] * len(jobs), [d.reason for d in done]
    for problem, _, config, (a, b, bias) in jobs:
        expected = apply(a.double() @ b.double().t() + bias.double(), problem.activation, inplace=False)
        out = get("cute").build(problem, get("cute").parse_config(config), _current())(a, b, bias)
        assert relative_error(out, expected) < 2e-2, config
        assert cute.marker(problem, get("cute").parse_config(config)).exists()


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
def test_replayed_launches_match_float64_on_fresh_operands_eagerly_and_in_a_cuda_graph(activation, bias):
    """A kernel's calls after its first replay what the first resolved: on fresh random operands
    of the same layout, on a 3-D input of the same rows, on rows of another stride, through the
    front path's bound call, and that call captured in a CUDA graph and replayed."""
    from gemmtune.activation import apply
    from gemmtune.backends import launch

    m, n, k = 192, 264, 520
    problem = Problem(m, n, k, "bfloat16", "linear", bias, activation=activation)
    kernel = get("cute").build(problem, cute.space(problem, _current())[0], _current())

    def operands(*lead, view="plain"):
        a = torch.randn(*lead, k + 8, device="cuda", dtype=torch.bfloat16)
        a = a[..., 8:] if view == "offset" else a[..., :k].contiguous()
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 8
        return a, b, torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None

    def expected(a, b, bias_t):
        product = a.reshape(-1, k).double() @ b.double().t() + (bias_t.double() if bias else 0)
        return apply(product, activation, inplace=False).reshape(*a.shape[:-1], n)

    for lead, view in [((m,), "plain"), ((m,), "plain"), ((4, 48), "plain"), ((m,), "offset"), ((m,), "offset")]:
        a, b, bias_t = operands(*lead, view=view)
        out = kernel(a, b, bias_t)
        assert out.shape == (*lead, n) and relative_error(out, expected(a, b, bias_t)) < 2e-2, (lead, view)
    a, b, bias_t = operands(4, 48)
    call = launch.front_entry(kernel, a, b, bias_t)
    a, b, bias_t = operands(4, 48)
    ptrs = (a.data_ptr(), b.data_ptr(), 0 if bias_t is None else bias_t.data_ptr())
    assert relative_error(call(a, b, bias_t, *ptrs), expected(a, b, bias_t)) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(a, b, bias_t, *ptrs)
    fresh = operands(4, 48)
    for static, new in zip((a, b, bias_t), fresh):
        if static is not None:
            static.copy_(new)
    graph.replay()
    assert relative_error(captured, expected(a, b, bias_t)) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
@pytest.mark.parametrize("dtype", cute.SCALED_DTYPES)
@pytest.mark.parametrize("scaling", cute.SCALINGS)
@pytest.mark.parametrize("m,out_dtype,bias", [(64, "bfloat16", True), (200, "float32", False), (512, "float16", True)])
def test_each_kind_of_fp8_config_matches_the_dequantized_float64_product(dtype, scaling, m, out_dtype, bias):
    """Each kind of config (cooperative or ping-pong, cluster along M or N) within the fp8 bound
    of the float64 product of the dequantized inputs, as triton_scaled's kernels are held: on
    contiguous operands, a transposed and a strided ``a`` with a strided bias, into a poisoned
    ``out`` (an element never written fails)."""
    from .test_triton_scaled import assert_close, operands, poisoned, reference, views

    problem = Problem(m, 264, 528, dtype, bias=bias, scaling=scaling, out_dtype=out_dtype)
    inputs = operands(problem, seed=m)
    ref, bound = reference(problem, *inputs)
    kinds = {(c.pingpong, c.cluster_m): c for c in cute.space(problem, _current())}
    assert len(kinds) == 4
    # each kind once (e4m3, 512 rows), the first config otherwise: each is a compile of its own
    for config in list(kinds.values())[:4 if (dtype, m) == ("float8_e4m3fn", 512) else 1]:
        kernel = get("cute").build(problem, config, _current())
        for what, given in {"contiguous": inputs, **views(problem, *inputs)}.items():
            out = poisoned(problem)
            assert kernel(*given, out=out) is out
            assert_close(out, ref, bound, (config.key(), what))


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_bias_and_scales_off_their_alignment_match_float64(dtype):
    """A bias one element into its storage (and, for fp8, row scales 4 bytes off 16), as a caller
    may slice them: copied where QuACK's vector loads need alignment, and right."""
    from .test_triton_scaled import assert_close, operands, reference

    m, n, k = 192, 264, 528
    if dtype == "bfloat16":
        problem = Problem(m, n, k, dtype, "linear", True)
        a, b = (torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for rows in (m, n))
        bias = torch.randn(n + 1, device="cuda", dtype=torch.bfloat16)[1:]
        out = get("cute").build(problem, cute.space(problem, _current())[0], _current())(a, b, bias)
        assert relative_error(out, a.double() @ b.double().t() + bias.double()) < 2e-2
        return
    problem = Problem(m, n, k, dtype, bias=True, scaling="row")
    a, b, bias, sa, sb = operands(problem, seed=3)
    bias = torch.empty(n + 1, device="cuda", dtype=bias.dtype)[1:].copy_(bias)
    sb = torch.empty(n + 1, device="cuda")[1:].view(n, 1).copy_(sb)
    kernel = get("cute").build(problem, cute.space(problem, _current())[0], _current())
    assert_close(kernel(a, b, bias, sa, sb), *reference(problem, a, b, bias, sa, sb), "misaligned")


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
@pytest.mark.parametrize("scaling", cute.SCALINGS)
def test_an_fp8_kernel_replays_in_a_cuda_graph_on_fresh_operands(scaling):
    from .test_triton_scaled import assert_close, operands, reference

    problem = Problem(256, 512, 1024, "float8_e4m3fn", bias=True, scaling=scaling)
    kernel = get("cute").build(problem, cute.space(problem, _current())[0], _current())
    static = operands(problem, seed=1)
    kernel(*static)  # resolved (compiled or loaded) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel(*static)
    for into, fresh in zip(static, operands(problem, seed=2)):
        into.copy_(fresh)
    graph.replay()
    assert_close(captured, *reference(problem, *static), "replayed")


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
def test_the_tuner_times_cute_candidates_on_an_fp8_prefill_shape():
    """Compiled ahead together, verified against float64 and screened beside _scaled_mm: no cute
    trial fails."""
    from gemmtune.tuning.tuner import TuneOptions, tune_problem

    problem = Problem(2048, 6144, 4096, "float8_e4m3fn", scaling="row")
    result = tune_problem(problem, _current(), options=TuneOptions(backends=("cublas", "cute")))
    trials = [t for t in result.trials if t.backend == "cute"]
    assert trials and all(t.ok for t in trials), [t.reason for t in trials if not t.ok]

