"""Fault injection: the tuner is offered fast candidates that are wrong in the ways a real kernel
goes wrong, and must choose none of them. The norm-only verifier this replaced let the sparse bf16
faults and the stateful replay through (issue 26, finding 2)."""

import pytest
import torch
import torch.nn.functional as F

from gemmtune import backends, search
from gemmtune.backends.base import function_kernel
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Status
from gemmtune.tuning import verify
from gemmtune.tuning.tuner import TuneOptions, tune_problem

BF16 = Problem(256, 256, 64, "bfloat16", "linear")  # 65,536 outputs
FP32 = Problem(64, 96, 128, "float32", "linear", bias=True)


def product(a, b, bias, out):
    """What a right kernel writes: the product in fp32, one cast."""
    return out.copy_(F.linear(a.float(), b.float(), None if bias is None else bias.float()))


def zeroes(count):
    """Right but for ``count`` outputs left at zero (a masked store that drops a few lanes)."""
    def kernel(a, b, bias, out):
        product(a, b, bias, out)
        picks = torch.Generator().manual_seed(count)
        out.view(-1)[torch.randperm(out.numel(), generator=picks)[:count]] = 0
        return out
    return kernel


def scaled(a, b, bias, out):
    return product(a, b, bias, out).mul_(1.01)


def one_nan(a, b, bias, out):
    product(a, b, bias, out)
    out[-1, -1] = float("nan")
    return out


def one_unwritten(a, b, bias, out):
    """Writes every output but the last: the NaN poison verification put there stays."""
    full = product(a, b, bias, torch.empty_like(out))
    out.view(-1)[:-1] = full.view(-1)[:-1]
    return out


def replays():
    """Right on the first inputs it sees, then returns that product again whatever it is given
    (a cache keyed by the wrong thing)."""
    first = {}

    def kernel(a, b, bias, out):
        if "out" not in first:
            first["out"] = product(a, b, bias, out).clone()
        return out.copy_(first["out"])
    return kernel


def goes_wrong_after(calls):
    """Right for its first ``calls`` calls, then 10% off: state that timing rounds corrupt (a
    split-K counter never reset). Only the check after the timing rounds can see it."""
    seen = [0]

    def kernel(a, b, bias, out):
        seen[0] += 1
        product(a, b, bias, out)
        return out.mul_(1.1) if seen[0] > calls else out
    return kernel


FAULTS = {
    "one zero in bf16": (BF16, lambda: zeroes(1)),
    "two zeros in bf16": (BF16, lambda: zeroes(2)),
    "eight zeros in bf16": (BF16, lambda: zeroes(8)),
    "x1.01 in bf16": (BF16, lambda: scaled),
    "x1.01 in fp32": (FP32, lambda: scaled),
    "one NaN": (BF16, lambda: one_nan),
    "one unwritten element": (FP32, lambda: one_unwritten),
    "stateful replay": (BF16, replays),
}


def offer(monkeypatch, make_fault):
    """Every triton_tiled candidate becomes a fresh instance of the fault."""
    tiled = backends.get("triton_tiled")
    monkeypatch.setattr(tiled, "build", lambda problem, config, device: _with_out(make_fault()))


def _with_out(fault):
    def kernel(a, b, bias, out=None):
        if out is None:
            out = torch.empty(a.shape[0], b.shape[0], dtype=a.dtype, device=a.device)
        return fault(a, b, bias, out)
    return function_kernel(kernel)  # a finalist's host cost is timed through launch.front_entry


OPTIONS = TuneOptions(seed=11, backends=("cublas", "triton_tiled"), budget=search.Budget(trials=2))


@pytest.mark.parametrize("name", list(FAULTS))
def test_no_faulty_candidate_is_chosen(monkeypatch, name):
    problem, make_fault = FAULTS[name]
    offer(monkeypatch, make_fault)
    result = tune_problem(problem, current(), options=OPTIONS)
    faulty = [t for t in result.trials if t.backend == "triton_tiled"]
    assert faulty and all(t.status is Status.WRONG_RESULT for t in faulty), [(t.status, t.reason) for t in faulty]
    assert all("tolerance" in t.reason for t in faulty)
    assert result.backend == "cublas"


def test_a_kernel_that_goes_wrong_during_timing_is_caught_after_it(monkeypatch, caplog):
    """Right on both input sets before timing, wrong after the rounds: the finalists' check on
    the second inputs after timing fails it, and it is never chosen."""
    offer(monkeypatch, lambda: goes_wrong_after(4))
    result = tune_problem(FP32, current(), options=OPTIONS)
    faulty = [t for t in result.trials if t.backend == "triton_tiled"]
    assert faulty and all(t.status is Status.WRONG_RESULT and t.reason.startswith("after timing") for t in faulty)
    assert result.backend == "cublas"
    assert "wrong after them" in caplog.text


@pytest.mark.parametrize("problem", [BF16, FP32, Problem(7, 33, 4095, "float16", "nn", activation="gelu")])
def test_a_right_product_passes_with_room(problem):
    """The other side of the bound: the product rounded once to the output dtype (and, for the
    activation, rounded before it too, as cuBLAS's candidate is) stays well inside it."""
    inputs = verify.make_inputs(problem, "cpu", seed=5)
    b = inputs.b.t() if problem.layout == "linear" else inputs.b
    once = inputs.reference.to(inputs.a.dtype)
    pre = inputs.a.float() @ b.float() + (0 if inputs.bias is None else inputs.bias.float())
    pre = pre.to(inputs.a.dtype).float()
    twice = verify.activation.apply(pre, problem.activation).to(inputs.a.dtype)
    for out in (once, twice):
        verdict = verify.judge(out, problem, inputs)
        assert verdict.ok and verdict.worst < 0.5, verdict.reason()


def test_a_float16_output_among_the_subnormals_may_be_one_step_off():
    """Below float16's smallest normal its values are 2^-24 apart, whatever their size: a product
    one step from the float64 one is right there, though far beyond relative rounding (a k = 1
    product of 7.36e-6 computed as 7.33e-6 once failed a right kernel); three steps are not."""
    problem = Problem(1, 4, 1, "float16", "nn")
    step = 2.0 ** -24
    a = torch.tensor([[2.0 ** -12]], dtype=torch.float16)
    b = torch.tensor([[3.0, 17.0, 100.0, 123.0]], dtype=torch.float16) * 2.0 ** -12  # products of 3-123 steps
    inputs = verify.inputs_of(problem, a, b, None)
    for steps, right in ((1, True), (-1, True), (3, False)):
        out = (inputs.reference - steps * step).to(torch.float16)
        assert verify.judge(out, problem, inputs).ok is right, (steps, verify.judge(out, problem, inputs).reason())


def test_a_verdict_names_the_element():
    problem = BF16
    inputs = verify.make_inputs(problem, "cpu", seed=5)
    out = inputs.reference.to(torch.bfloat16)
    out[3, 17] = 0
    verdict = verify.judge(out, problem, inputs)
    assert not verdict.ok and verdict.where == (3, 17) and "element (3, 17)" in verdict.reason()
