"""One problem side by side (``gemmtune.cli.bench``): the stored choice beside torch's own call,
through Triton's interpreter on the CPU, on the GPU where there is one."""

import pytest
import torch

from gemmtune import api, backends
from gemmtune.cli import bench
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.shapes import NamedProblem
from gemmtune.tuning import verify


@pytest.fixture(scope="module")
def tuned():
    problem = Problem(33, 24, 40, "float32", "linear", True, False, "gelu_tanh")
    (result,) = api.tune([problem])
    return NamedProblem("awkward", "small", problem), result


def test_torch_call_is_the_problem_with_its_epilogue(tuned):
    named, _ = tuned
    inputs = verify.make_inputs(named.problem, "cpu")
    assert verify.rel_err(bench.torch_call(named, inputs)(), inputs.reference) < 1e-6
    nn = NamedProblem("nn", "", Problem(7, 9, 5, "float32", "nn", True, False, "relu"))
    inputs = verify.make_inputs(nn.problem, "cpu")
    assert verify.rel_err(bench.torch_call(nn, inputs)(), inputs.reference) < 1e-6


def test_row_of_the_stored_choice(tuned):
    named, result = tuned
    before = torch.get_float32_matmul_precision()
    row = bench.measure(named, result, current(), rounds=3, budget_ms=50)
    assert torch.get_float32_matmul_precision() == before
    assert row["name"] == "awkward" and row["group"] == "small" and row["choice"] == result.label()
    assert row["verified"] and row["rel_err"] < verify.tolerance(named.problem)
    assert row["speedup"] == pytest.approx(row["cublas_ms"] / row["gemmtune_ms"])
    assert row["inductor_ms"] is None  # not asked for
    doc = bench.document([row], current())
    assert doc["kind"] == "suite" and doc["gpu_timings"] is torch.cuda.is_available() and doc["rows"] == [row]


def test_a_wrong_kernel_is_reported_wrong(tuned, monkeypatch):
    named, result = tuned
    right = backends.build

    def off_by_a_little(*args):
        kernel = right(*args)
        return lambda a, b, bias, out=None: kernel(a, b, bias) * 1.05

    monkeypatch.setattr(backends, "build", off_by_a_little)
    row = bench.measure(named, result, current(), rounds=3, budget_ms=50)
    assert not row["verified"] and row["rel_err"] > verify.tolerance(named.problem)


def test_a_result_of_another_problem_is_refused(tuned):
    named, result = tuned
    other = NamedProblem("other", "", Problem(8, 24, 40, "float32"))
    with pytest.raises(ValueError, match="not v"):
        bench.measure(other, result, current())


def test_a_torch_call_that_raises_is_a_refusal_with_its_first_line():
    def refused():
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic`\nmore")

    assert bench.refusal(refused) == "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic`"
    assert bench.refusal(lambda: torch.ones(1)) is None
