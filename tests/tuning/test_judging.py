"""The one-pass judgement (``tuning.judging``) against verify's torch judgement, element for
element: the worst ratio, where it lies, the output and reference there, and the relative error,
on fresh random outputs of awkward sizes in every output dtype, with non-finite elements and
ties; and the first verdict of a process checked against torch's before the kernel is trusted.
Runs the kernel under Triton's interpreter without a GPU."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmtune import activation
from gemmtune.problem import Problem
from gemmtune.tuning import judging, verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(m, n, dtype, seed, poison=(), zero_ref=False):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.zeros(m, n, dtype=torch.float64) if zero_ref else torch.randn(m, n, generator=gen, dtype=torch.float64)
    out = (ref + 1e-2 * torch.randn(m, n, generator=gen, dtype=torch.float64)).to(dtype)
    for i, value in poison:
        out.view(-1)[i % out.numel()] = value
    bound = (1e-2 * torch.rand(m, n, generator=gen) + 1e-3).float()
    return out.to(DEVICE), ref.to(DEVICE), bound.to(DEVICE)


def torch_verdict(out, ref, bound):
    """verify.judge's torch path (a CPU output) on these tensors."""
    inputs = verify.Inputs(ref.cpu(), ref.cpu(), None, ref.cpu(), bound.cpu())
    return verify.judge(out.cpu(), Problem(out.shape[0], out.shape[1], 1), inputs)


def assert_same(out, ref, bound):
    mine = judging.judge(out, ref, bound)
    theirs = torch_verdict(out, ref, bound)
    assert mine.worst == theirs.worst
    assert divmod(mine.flat, out.shape[1]) == theirs.where
    assert (mine.value == theirs.value or math.isnan(mine.value) and math.isnan(theirs.value))
    assert mine.expected == theirs.expected
    rel = verify.relative(mine.error_norm, mine.ref_norm, out)
    if math.isinf(theirs.rel_err):
        assert math.isinf(rel)
    else:
        assert rel == pytest.approx(theirs.rel_err, rel=1e-12, abs=1e-300)


@settings(max_examples=30, deadline=None, database=None)
@given(m=st.sampled_from([1, 7, 33, 64]), n=st.sampled_from([1, 7, 33, 1000, 4095]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), seed=st.integers(0, 2 ** 16))
def test_the_one_pass_judgement_is_the_torch_judgement(m, n, dtype, seed):
    assert_same(*case(m, n, dtype, seed))


@pytest.mark.parametrize("poison", [[(5, math.nan)], [(3, math.inf)], [(2000, -math.inf), (9, math.nan)],
                                    [(4094, math.nan)]])
def test_non_finite_outputs_are_the_worst_and_fail_the_norm(poison):
    out, ref, bound = case(33, 4095 // 33 + 1, torch.bfloat16, 1, poison)
    found = judging.judge(out, ref, bound)
    assert found.worst == math.inf and math.isinf(found.error_norm)
    assert_same(out, ref, bound)


def test_ties_report_the_first_element_and_a_zero_reference_its_norms():
    out, ref, bound = case(7, 1500, torch.float32, 2, zero_ref=True)
    out.zero_()
    out.view(-1)[[10, 1100, 9000]] = 0.5  # three equal worst errors, in different blocks
    found = judging.judge(out, ref, bound.fill_(0.25))
    assert (found.worst, found.flat) == (2.0, 10)
    assert found.error_norm == pytest.approx(math.sqrt(3 * 0.25)) and found.ref_norm == 0.0
    assert_same(out, ref, bound)


def test_only_contiguous_outputs_of_the_reference_s_shape_are_taken():
    out, ref, bound = case(8, 16, torch.bfloat16, 3)
    assert judging.takes(out, ref, bound)
    assert not judging.takes(out.t(), ref.t(), bound.t())
    assert not judging.takes(out[:, :8], ref[:, :8], bound[:, :8])
    assert not judging.takes(out, ref.float(), bound)


def inputs_for(out, ref, bound):
    return verify.Inputs(ref, ref, None, ref, bound)


def test_the_first_one_pass_verdict_in_a_process_is_checked_against_torch_s(monkeypatch):
    monkeypatch.setitem(verify._one_pass, "trusted", None)
    out, ref, bound = case(7, 33, torch.bfloat16, 4)
    problem = Problem(7, 33, 1)
    verdict = verify._judged_in_one_pass(out, problem, inputs_for(out, ref, bound))
    assert verify._one_pass["trusted"] is True
    assert verify._same(verdict, torch_verdict(out, ref, bound))


def test_a_one_pass_kernel_that_disagrees_is_not_trusted_again(monkeypatch):
    monkeypatch.setitem(verify._one_pass, "trusted", None)
    out, ref, bound = case(7, 33, torch.bfloat16, 5)
    right = judging.judge(out, ref, bound)
    monkeypatch.setattr(judging, "judge", lambda *args: right._replace(worst=right.worst / 2))  # a wrong ratio
    verdict = verify._judged_in_one_pass(out, Problem(7, 33, 1), inputs_for(out, ref, bound))
    assert verify._one_pass["trusted"] is False
    assert verdict.worst == torch_verdict(out, ref, bound).worst  # torch's verdict, not the kernel's


def test_a_one_pass_kernel_that_fails_leaves_the_torch_judgement(monkeypatch):
    monkeypatch.setitem(verify._one_pass, "trusted", None)
    out, ref, bound = case(7, 33, torch.bfloat16, 6)

    def fails(*args):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(judging, "judge", fails)
    assert verify._judged_in_one_pass(out, Problem(7, 33, 1), inputs_for(out, ref, bound)) is None
    assert verify._one_pass["trusted"] is False


def test_an_output_below_its_format_s_smallest_normal_is_not_judged_by_its_relative_error():
    """Found by the property test of torch's fp8 fallback: silu of a pre-activation near -70 is
    3e-30, which float16 rounds to zero; relative to a norm that small any kernel is 100% off.
    Normal outputs keep their relative error."""
    ref = torch.tensor([[-3.3e-30]], dtype=torch.float64)
    out = ref.to(torch.float16)
    assert float(out) == 0.0
    assert verify.rel_err(out, ref) < 1e-20
    normal = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    assert verify.rel_err(normal.to(torch.float16) * 1.01, normal) == pytest.approx(0.01, rel=0.05)  # float16 rounds 1.01


def test_an_activation_s_floor_passes_gelu_s_float32_tail():
    """GELU at -7.5 is -1.9e-13 in float64 and 0 in float32 (its erf saturates): without the
    reference norm's floor after an activation (``verify.norm_floor``) no float32 epilogue passes."""
    problem = Problem(1, 4, 64, "float32", "nn", activation="gelu")
    pre = torch.full((1, 4), -7.5, dtype=torch.float64)
    ref = activation.apply(pre.clone(), "gelu")
    flushed = activation.apply(pre.float(), "gelu")
    assert bool((ref != 0).all()) and bool((flushed == 0).all())
    floor = verify.norm_floor(problem, pre)
    assert verify.rel_err(flushed, ref) > verify.tolerance(problem) >= verify.rel_err(flushed, ref, floor)
    assert verify.norm_floor(Problem(1, 4, 64, "float32", "nn"), pre) == 0.0  # no activation: no floor


@pytest.mark.parametrize("act", ["gelu", "silu", "relu"])
def test_an_activation_s_floor_still_fails_a_systematic_error(act):
    problem = Problem(8, 8, 64, "bfloat16", "nn", activation=act)
    pre = torch.linspace(-3, 3, 64, dtype=torch.float64).reshape(8, 8)
    out = activation.apply(pre.clone(), act)
    assert verify.rel_err((out * 1.01).float(), out, verify.norm_floor(problem, pre)) > verify.tolerance(problem)
