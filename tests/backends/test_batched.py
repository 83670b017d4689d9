"""Batched products (torch.bmm): the batched kernels against a float64 reference on every layout
a caller can pass, the cost model and the space over the batch, and tuning one end to end."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gemmtune
from gemmtune import backends
from gemmtune.backends import costmodel
from gemmtune.backends.cublas import CublasConfig
from gemmtune.backends.triton_tiled import MAX_BATCH, TILES, TiledConfig, space, within_int32
from gemmtune.device import Device, current
from gemmtune.problem import Problem
from gemmtune.store import Store
from gemmtune.tuning import verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ["float32", "float16", "bfloat16"]
SIZES = [(2, 1, 7, 33), (3, 33, 1, 7), (4, 7, 33, 1), (2, 16, 16, 16), (3, 33, 33, 7)]  # batch, m, n, k
CONFIGS = {"cublas": [CublasConfig()],
           "triton_tiled": [TiledConfig(16, 16, 16, 8, 1, 1), TiledConfig(32, 16, 64, 2, 1, 1)]}
BACKENDS = [pytest.param("cublas"), pytest.param("triton_tiled", marks=pytest.mark.interpreter)]
# each product's relative error against its float64 reference
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}
VIEWS = ("contiguous", "transposed", "batch_strided", "offset", "misaligned", "expanded", "batch_innermost")
H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 << 20)
T4 = Device("Tesla T4", (7, 5), 40, 65536, 4 << 20)
COST_SIZES = st.sampled_from([1, 7, 16, 33, 1000, 4096])


def reference(a, b, layout):
    b64 = b.double()
    return torch.matmul(a.double(), b64.transpose(1, 2) if layout == "linear" else b64)


def assert_matches(out, a, b, layout, dtype):
    ref = reference(a, b, layout)
    assert out.shape == ref.shape and out.dtype == a.dtype
    errors = [verify.rel_err(got, expected) for got, expected in zip(out, ref)]
    assert max(errors) < TOLERANCE[dtype], errors


def laid_out(shape, view, dtype=torch.float32):
    """Random values of ``shape`` (batch, rows, cols) in a tensor laid out as ``view`` says."""
    q, r, c = shape

    def randn(*size):
        return torch.randn(*size, device=DEVICE).to(dtype)

    if view == "transposed":
        return randn(q, c, r).transpose(1, 2)
    if view == "batch_strided":
        return randn(2 * q, r, c)[::2]
    if view == "offset":
        return randn(q + 1, r, c)[1:]
    if view == "misaligned":  # one element past its storage's start
        return randn(q * r * c + 1)[1:].view(shape)
    if view == "expanded":  # one product's operand for every product: batch stride 0
        return randn(r, c)[None].expand(shape)
    if view == "batch_innermost":
        return randn(r, c, q).permute(2, 0, 1)
    return randn(q, r, c)


def b_shape(problem):
    return (problem.batch, problem.n, problem.k) if problem.layout == "linear" else \
        (problem.batch, problem.k, problem.n)


def build(name, problem, config=None):
    return backends.get(name).build(problem, config or CONFIGS[name][0], current())


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["linear", "nn"])
@pytest.mark.parametrize("batch,m,n,k", SIZES)
def test_matches_float64_reference(name, dtype, layout, batch, m, n, k):
    problem = Problem(m, n, k, dtype, layout, batch=batch)
    inputs = verify.make_inputs(problem, DEVICE)
    for config in CONFIGS[name]:
        kernel = build(name, problem, config)
        verdict = verify.check(kernel, problem, inputs)
        assert verdict.ok, (config, verdict.reason())
        result = kernel(inputs.a, inputs.b, None)
        assert result.is_contiguous()
        assert_matches(result, inputs.a, inputs.b, layout, dtype)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("layout", ["linear", "nn"])
@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("operand", ["a", "b", "both"])
def test_views_of_either_operand(name, layout, view, operand):
    problem = Problem(7, 33, 33, "float32", layout, batch=3)
    a = laid_out((3, 7, 33), view if operand != "b" else "contiguous")
    b = laid_out(b_shape(problem), view if operand != "a" else "contiguous")
    kernel = build(name, problem)
    assert verify.check(kernel, problem, verify.inputs_of(problem, a, b, None)).ok
    assert_matches(kernel(a, b, None), a, b, layout, "float32")


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("layout", ["linear", "nn"])
def test_writes_into_a_non_contiguous_out_and_nothing_beside_it(name, layout):
    problem = Problem(7, 33, 16, "float16", layout, batch=3)
    a, b = laid_out((3, 7, 16), "contiguous", torch.float16), laid_out(b_shape(problem), "contiguous", torch.float16)
    storage = torch.full((7, 3, 2 * 33), float("nan"), dtype=torch.float16, device=DEVICE)
    out = storage[:, :, ::2].transpose(0, 1)  # (3, 7, 33), batch stride 66, rows 198 apart, columns 2
    result = build(name, problem)(a, b, None, out=out)
    assert result.data_ptr() == out.data_ptr() and result.stride() == out.stride()
    assert_matches(out, a, b, layout, "float16")
    assert storage[:, :, 1::2].isnan().all()


def test_the_batched_tiled_kernel_refuses_a_bias():
    problem = Problem(7, 33, 16, "float32", "nn", batch=2)
    a, b = laid_out((2, 7, 16), "contiguous"), laid_out((2, 16, 33), "contiguous")
    with pytest.raises(ValueError, match="no bias"):
        build("triton_tiled", problem)(a, b, torch.zeros(33, device=DEVICE))


def zeroes_the_last_product(result, a, b):
    result[-1] = 0.0


def swaps_the_first_two_products(result, a, b):
    result[[0, 1]] = result[[1, 0]]


def reads_the_first_b_for_every_product(result, a, b):
    result.copy_(torch.matmul(a.float(), b[:1].float().transpose(1, 2)).to(result.dtype))


@pytest.mark.interpreter
@pytest.mark.parametrize("breaks", [zeroes_the_last_product, swaps_the_first_two_products,
                                    reads_the_first_b_for_every_product], ids=lambda f: f.__name__)
def test_verification_fails_a_wrong_batched_kernel(breaks):
    problem = Problem(7, 33, 16, "bfloat16", "linear", batch=3)
    inputs = verify.make_inputs(problem, DEVICE)
    good = build("triton_tiled", problem)

    def wrong(a, b, bias, out=None):
        result = good(a, b, bias, out=out)
        breaks(result, a, b)
        return result

    assert verify.check(good, problem, inputs).ok
    verdict = verify.check(wrong, problem, inputs)
    assert not verdict.ok and len(verdict.where) == 3  # the element named by batch, row and column
    assert f"element {verdict.where}" in verdict.reason()


@pytest.mark.interpreter
def test_a_wrong_element_is_named_by_its_batch_row_and_column():
    problem = Problem(7, 33, 16, "float32", "nn", batch=3)
    inputs = verify.make_inputs(problem, DEVICE)
    good = build("triton_tiled", problem)

    def one_wrong(a, b, bias, out=None):
        result = good(a, b, bias, out=out)
        result[2, 5, 30] += 1e3
        return result

    assert verify.check(one_wrong, problem, inputs).where == (2, 5, 30)


def test_the_cost_of_one_wave_of_tiles_grows_with_the_batch_by_whole_waves():
    # each product 132 tiles of 128 x 128: one wave on the H100's 132 SMs
    ms = [costmodel.tile_gemm_ms(Problem(128 * 132, 128, 4096, "float32", batch=batch), H100, 128, 128, 64, 3)
          for batch in (1, 2, 3)]
    assert ms[0] < ms[1] < ms[2]
    assert ms[1] == pytest.approx(2 * ms[0], rel=0.02) and ms[2] == pytest.approx(3 * ms[0], rel=0.02)


@settings(max_examples=200, deadline=None, database=None)
@given(device=st.sampled_from([H100, T4]), tile=st.sampled_from(TILES), m=COST_SIZES, n=COST_SIZES, k=COST_SIZES,
       dtype=st.sampled_from(DTYPES), batch=st.integers(2, 4096))
def test_the_cost_of_a_batch_is_at_least_one_product_and_at_most_that_many(device, tile, m, n, k, dtype, batch):
    block_m, block_n, block_k, _ = tile

    def ms(q):
        return costmodel.tile_gemm_ms(Problem(m, n, k, dtype, batch=q), device, block_m, block_n, block_k, 3)

    assert ms(1) <= ms(batch - 1) <= ms(batch)
    assert ms(batch) - costmodel.LAUNCH_MS <= batch * (ms(1) - costmodel.LAUNCH_MS) * (1 + 1e-9)


def test_a_batch_that_fills_the_sms_keeps_the_larger_tiles():
    def tiles(batch):
        return {(c.block_m, c.block_n) for c in space(Problem(256, 256, 256, batch=batch), H100)}

    assert (128, 128) not in tiles(1) and (128, 128) in tiles(64)
    assert tiles(1) <= tiles(8) <= tiles(64)


def test_no_tiled_candidates_past_the_grids_batch_limit():
    tiled = backends.get("triton_tiled")
    for device in (H100, current()):
        assert tiled.candidates(Problem(7, 33, 16, "float16", "nn", batch=MAX_BATCH), device)
        assert tiled.candidates(Problem(7, 33, 16, "float16", "nn", batch=MAX_BATCH + 1), device) == []


def test_only_the_batched_backends_take_a_batched_problem():
    batched = Problem(7, 33, 16, "float16", "nn", batch=2)
    assert [name for name in backends.names() if backends.takes(name, batched)] == list(backends.BATCHED)


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["nn", "linear"])
def test_tune_chooses_a_verified_kernel_and_stores_a_passing_tiled_trial(tmp_path, layout):
    problem = Problem(7, 33, 5, "float32", layout, batch=3)
    path = tmp_path / "s.db"
    [result] = gemmtune.tune(problem, store=path)
    assert result.problem_key == problem.key() and result.backend in backends.BATCHED
    assert result.rel_err is not None and result.rel_err <= verify.tolerance(problem)
    chosen = backends.build(problem, result.backend, result.config, current())
    assert verify.check(chosen, problem, verify.make_inputs(problem, DEVICE)).ok
    trials = Store(path).trials(result.device, result.problem_key)
    assert {t.backend for t in trials} <= set(backends.BATCHED) and all(t.ok for t in trials), trials
    assert any(t.backend == "triton_tiled" for t in trials), trials
    again = gemmtune.tune(problem, store=path)
    assert again[0].from_store and again[0].label() == result.label()


def test_a_matrix_indexed_past_int32_is_refused():
    assert within_int32((4096, 4096, 4096, 1))
    # attention's q laid batch-innermost: rows a whole (B * heads, d) apart
    assert not within_int32((32768, 384 * 128 * 64, 64, 1))
    assert within_int32((1, 2**40, 7, 1))  # one row: its stride never multiplies
