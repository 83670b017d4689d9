"""The TMA decode kernel against a float64 reference: under the interpreter without a GPU, on
Hopper with one. Aligned rows only (the backend's contract); M from 2 to 64, any N and K."""

import pytest
import torch

from gemmtune.backends.triton_stream import BACKEND, StreamConfig, space
from gemmtune.device import Device, current
from gemmtune.problem import Problem
from gemmtune.tuning import verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 << 20)
SMALL_GPU = Device("NVIDIA H100 under MPS", (9, 0), 16, 232448, 50 << 20)
A100 = Device("NVIDIA A100", (8, 0), 108, 166912, 40 << 20)
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not ON_HOPPER, reason="TMA descriptors need Hopper")


def _configs(problem):
    if DEVICE == "cpu":
        return space(problem, current())
    return space(problem, H100)


# bfloat16 too under the interpreter: gemmtune.backends.kernels.mma widens its operands there.
DTYPES = ["float16", "float32", "bfloat16"]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["linear", "nn"])
@pytest.mark.parametrize("m,n,k", [(2, 8, 8), (7, 40, 72), (33, 24, 200), (64, 136, 40)])
@pytest.mark.parametrize("bias, act", [(False, "none"), (True, "gelu_tanh"), (True, "silu")])
def test_matches_reference(m, n, k, layout, dtype, bias, act):
    problem = Problem(m, n, k, dtype, layout, bias, activation=act)
    inputs = verify.make_inputs(problem, DEVICE)
    configs = _configs(problem)
    assert configs
    for config in configs:
        err = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert err.ok, (config, err.reason())


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["linear", "nn"])
def test_4104_weight_rows_end_past_the_last_full_tile(layout):
    """N = 4104, 8 past a multiple of every tile: the last tile of weight rows mostly zero-filled
    by the descriptor, its outputs masked."""
    problem = Problem(7, 4104, 16, "bfloat16", layout, True, activation="silu")
    inputs = verify.make_inputs(problem, DEVICE)
    for config in _configs(problem):
        err = verify.check(BACKEND.build(problem, config, current()), problem, inputs)
        assert err.ok, (config, err.reason())


@pytest.mark.interpreter
def test_writes_into_a_strided_out():
    problem = Problem(5, 24, 32, "float16", "linear", True, activation="relu")
    inputs = verify.make_inputs(problem, DEVICE)
    out = torch.full((24, 5), float("nan"), dtype=torch.float16, device=DEVICE).t()  # (5, 24), column-major
    kernel = BACKEND.build(problem, _configs(problem)[0], current())
    got = kernel(inputs.a, inputs.b, inputs.bias, out)
    assert got is out and verify.rel_err(out, inputs.reference) <= verify.tolerance(problem)


@pytest.mark.interpreter
def test_a_model_s_activations_of_any_rank():
    """x (batch, tokens, K), as a model's layers pass it: one (M, K) operand, the output shaped back."""
    problem = Problem(6, 24, 32, "float16", "linear", True)
    kernel = BACKEND.build(problem, _configs(problem)[0], current())
    inputs = verify.make_inputs(problem, DEVICE)
    out = kernel(inputs.a.reshape(2, 3, 32), inputs.b, inputs.bias)
    assert out.shape == (2, 3, 24)
    assert verify.rel_err(out.reshape(6, 24), inputs.reference) <= verify.tolerance(problem)
    with pytest.raises(ValueError, match="out= takes a 2-D a"):
        kernel(inputs.a.reshape(2, 3, 32), inputs.b, inputs.bias, torch.empty(6, 24, dtype=torch.float16))


def test_a_launcher_that_is_not_triton_s_descriptor_wrapper_is_not_bound():
    """The bound launch reads the closure of Triton 3.6's descriptor wrapper; anything else (the
    launcher of a kernel with scratch memory, another Triton) leaves the plain call in place."""
    from gemmtune.backends.triton_stream import _tma_encoders

    def wrapper_of_another_shape(*args):
        return args

    launcher = object()

    def wrapper_without_metadata(*args):
        return launcher(*args)

    assert _tma_encoders(wrapper_of_another_shape) is None
    assert _tma_encoders(wrapper_without_metadata) is None
    assert _tma_encoders(object()) is None


def test_space_serves_decode_on_hopper_only():
    decode = Problem(16, 4096, 4096)
    configs = space(decode, H100)
    assert {(c.block_m, c.block_n) for c in configs} == {(16, 64), (16, 128)}
    assert all(c.smem_bytes(2) <= H100.smem_per_block for c in configs)
    assert space(Problem(40, 4096, 4096), H100)[0].block_m == 64
    assert space(Problem(1, 4096, 4096), H100) == []  # the GEMV programs of triton_splitk read faster
    assert space(Problem(65, 4096, 4096), H100) == []
    assert space(decode, A100) == []
    assert BACKEND.candidates(Problem(16, 4097, 4096), H100) == []  # misaligned rows: no descriptors
    shallow = space(Problem(16, 4096, 256), H100)
    assert all(c.num_stages <= 2 for c in shallow)  # no deeper than K has steps
    assert len(shallow) == len(set(shallow))  # tiles that differ only in stages K cannot use: tried once
    assert {c.num_stages for c in configs if c.block_n == 64} == {4, 5}
    wider = space(Problem(32, 4096, 4096), H100)  # a fifth stage of 64x256 no longer fits beside 32 rows
    assert {(c.block_n, c.num_stages) for c in wider} == {(64, 4), (128, 3)}


def test_persistent_grid_follows_the_sms():
    config = StreamConfig(16, 128, 128, 4, 3)  # 108 KB of pipeline: two programs per SM
    assert config.slots(2, H100) == 2 * 132 and config.slots(2, SMALL_GPU) == 2 * 16
    assert StreamConfig(16, 64, 256, 4, 4).slots(2, H100) == 132  # 160 KB: one


@pytest.mark.parametrize("data", [
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4},
    {"BLOCK_M": 8, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": True, "num_stages": 4},
])
def test_untrusted_configs_are_rejected(data):
    with pytest.raises(ValueError):
        BACKEND.parse_config(data)


def test_config_round_trips():
    config = StreamConfig(32, 128, 128, 4, 3)
    assert BACKEND.parse_config(config.as_dict()) == config


@pytest.mark.gpu
def test_on_hopper_the_weights_are_the_warpgroup_mma_side():
    """The swapped roles must give Hopper's warpgroup MMA with the weight tile on its wide side."""
    device = current()
    if not device.is_hopper:
        pytest.skip("a Hopper GPU is needed")
    from triton.tools.disasm import get_sass

    from gemmtune.backends.kernels.stream import stream_matmul

    kernel_cache = stream_matmul.device_caches[torch.cuda.current_device()][0]
    kernel_cache.clear()  # so that the one binary left is this test's
    problem = Problem(16, 4096, 4096)
    kernel = BACKEND.build(problem, StreamConfig(16, 64, 256, 4, 4), device)
    inputs = verify.make_inputs(problem, "cuda", seed=0)
    assert verify.rel_err(kernel(inputs.a, inputs.b, None), inputs.reference) < verify.tolerance(problem)
    (compiled,) = kernel_cache.values()
    assert "wgmma.mma_async.sync.aligned.m64n16k16" in compiled.asm["ptx"]
    assert "HGMMA" in get_sass(compiled.asm["cubin"])
    assert compiled.n_spills == 0


@pytest.mark.gpu
def test_later_calls_launch_the_binary_directly():
    problem = Problem(16, 4096, 4096, bias=True, activation="silu")
    kernel = BACKEND.build(problem, StreamConfig(16, 128, 128, 4, 3), current())
    inputs = verify.make_inputs(problem, "cuda", seed=1)
    for _ in range(3):  # the first call goes through the JIT, the others through its launcher
        out = kernel(inputs.a, inputs.b, inputs.bias)
        assert verify.rel_err(out, inputs.reference) < verify.tolerance(problem)
    assert kernel._launch.binaries() == 1


@pytest.mark.gpu
def test_the_bound_launch_matches_the_call_and_follows_the_weights():
    """linear's front path: the bound call encodes x's map per call and each weight's once per
    address; two layers of one shape share the entry, so the same call must serve both."""
    from gemmtune.backends.launch import front_entry

    problem = Problem(16, 4096, 4096, bias=True, activation="gelu_tanh")
    kernel = BACKEND.build(problem, StreamConfig(16, 64, 256, 4, 4), current())
    first, second = (verify.make_inputs(problem, "cuda", seed=s) for s in (2, 3))
    x = first.a.reshape(4, 4, 4096)  # a model's (batch, tokens, K)
    kernel(x, first.b, first.bias)
    call = front_entry(kernel, x, first.b, first.bias)
    assert call.__name__ == "call"  # bound, not the unbound wrapper
    for inputs in (first, second, first):
        x = inputs.a.reshape(4, 4, 4096)
        out = call(x, inputs.b, inputs.bias, x.data_ptr(), inputs.b.data_ptr(), inputs.bias.data_ptr())
        assert out.shape == (4, 4, 4096)
        assert verify.rel_err(out.reshape(16, 4096), inputs.reference) < verify.tolerance(problem)
