"""The in-process runner: verification before timing, and the early abort of hopeless candidates."""

import pytest

from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing
from gemmtune.tuning import measure
from gemmtune.tuning.runner import ABORT_FACTOR, LocalRunner


@pytest.mark.interpreter
def test_a_clearly_slower_candidate_is_not_screened_further(monkeypatch):
    """The measurement's first two rounds decide: a candidate whose ratio to cuBLAS (timed in the
    same rounds) is ABORT_FACTOR above the best so far in both stops there; the others are
    screened in full, and each trial carries its ratio. One slow round (a host stall) does not
    stop a candidate."""
    # per candidate: (its first two rounds, its median once screened in full); cuBLAS 1.0
    medians = iter([((5.0, 5.0), 4.0), ((1.2, 1.2), 1.1), ((9.0, 1.0), 0.9)])  # slow, close, a stalled round
    stopped = []

    def fake_measure(fns, device, *, budget_ms, min_rounds, stop=None, **_):
        (name,) = [n for n in fns if n != "cublas"] or ["cublas"]
        first, full = next(medians) if name != "cublas" else ((1.0, 1.0), 1.0)
        two = {n: Timing((1.0, 1.0)) for n in fns} | {name: Timing(first)}
        early = stop is not None and stop(two)
        stopped.append(early)
        return two if early else {n: Timing((1.0,)) for n in fns} | {name: Timing((full,))}

    monkeypatch.setattr(measure, "measure", fake_measure)
    runner = LocalRunner(current())
    runner.start(Problem(8, 16, 32, "float32", "nn"), seed=1)
    reference = runner.evaluate("cublas", {}, 40.0)
    assert reference.median_ms == 1.0 and reference.vs_reference == 1.0
    slow = runner.evaluate("triton_tiled", {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8,
                                            "num_warps": 1, "num_stages": 1}, 40.0)
    assert slow.ok and slow.median_ms == 5.0 > ABORT_FACTOR * 1.0 and slow.vs_reference == 5.0
    close = runner.evaluate("triton_tiled", {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8,
                                             "num_warps": 1, "num_stages": 1}, 40.0)
    assert close.median_ms == 1.1 and close.vs_reference == 1.1
    stalled = runner.evaluate("triton_tiled", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8,
                                               "num_warps": 1, "num_stages": 1}, 40.0)
    assert stalled.median_ms == 0.9 and stalled.vs_reference == 0.9
    assert stopped == [False, True, False, False]


@pytest.mark.interpreter
def test_screening_pairs_each_candidate_with_cublas(monkeypatch):
    """Every screening measurement times cuBLAS in the same rounds, so a candidate's rank does not
    depend on the drift between measurements: here every sample of the second measurement reads
    twice as long, and the ratio is unmoved."""
    drift = iter([1.0, 2.0])
    seen = []

    def drifting_measure(fns, device, **kwargs):
        factor = next(drift)
        seen.append(sorted(fns))
        return {name: Timing(tuple(factor * (0.9 if name != "cublas" else 1.0) for _ in range(5))) for name in fns}

    runner = LocalRunner(current())
    runner.start(Problem(8, 16, 32, "float32", "nn"), seed=1)
    monkeypatch.setattr(measure, "measure", drifting_measure)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 1, "num_stages": 1}
    first = runner.evaluate("triton_tiled", config, 40.0)
    second = runner.evaluate("triton_tiled", dict(config, BLOCK_N=32), 40.0)
    assert all("cublas" in names for names in seen)
    assert first.median_ms == 0.9 and second.median_ms == 1.8
    assert first.vs_reference == second.vs_reference == 0.9


def test_a_config_that_does_not_parse_is_a_failed_trial():
    runner = LocalRunner(current())
    runner.start(Problem(8, 16, 32, "float32", "nn"), seed=1)
    trial = runner.evaluate("triton_tiled", {"BLOCK_M": 3}, 40.0)
    assert trial.status is Status.LAUNCH_ERROR and "exactly the keys" in trial.reason


PADDED = Problem(5, 13, 33, "float32", "linear")  # rows of 52 and 132 bytes: the padded path's
PADDED_CONFIGS = [{"align": 8}, {"align": 64}, {"align": 3}]


@pytest.mark.interpreter
def test_a_library_backends_candidates_are_screened_in_one_measurement(monkeypatch):
    """evaluate_many verifies each config, measures the verified ones side by side in one
    measurement of GROUP_BUDGET screening budgets, and keeps the failed ones as failed trials."""
    from gemmtune.tuning.runner import GROUP_BUDGET

    calls = []
    real = measure.measure

    def counting_measure(fns, device, **kwargs):
        calls.append((sorted(fns), kwargs["budget_ms"]))
        return real(fns, device, **kwargs)

    monkeypatch.setattr(measure, "measure", counting_measure)
    # current(): the padded path's copies are a Triton kernel, interpreted only where there is
    # no GPU (the interpreter's description on a GPU machine would send CPU tensors to it)
    runner = LocalRunner(current())
    runner.start(PADDED, seed=3)
    trials = runner.evaluate_many("cublas_padded", PADDED_CONFIGS, 5.0)
    assert [t.ok for t in trials] == [True, True, False] and "align=3" in trials[2].reason
    assert all(t.timing is not None and t.rel_err < 1e-5 for t in trials[:2])
    screened = [entry for entry in calls if entry[0] != ["cublas"]]  # cuBLAS itself checked and timed alongside
    assert screened == [(sorted([*(t.label() for t in trials[:2]), "cublas"]), GROUP_BUDGET * 5.0)]
    assert all(t.vs_reference is not None for t in trials[:2])
