"""The in-process runner: verification before timing, and the early abort of hopeless candidates."""

from gemmtune import bench
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing
from gemmtune.runner import ABORT_FACTOR, LocalRunner


def test_a_clearly_slower_candidate_is_not_screened_further(monkeypatch):
    calls = []
    times = iter([1.0, 1.0, 5.0, 1.2, 1.1])  # cublas: quick + full; slow: quick only; close: quick + full

    def fake_measure(fns, device, *, budget_ms, min_rounds, **_):
        calls.append(next(iter(fns)))
        return {name: Timing((next(times),)) for name in fns}

    monkeypatch.setattr(bench, "measure", fake_measure)
    runner = LocalRunner(current())
    runner.start(Problem(8, 16, 32, "float32", "nn"), seed=1)
    assert runner.evaluate("cublas", {}, 40.0).median_ms == 1.0
    slow = runner.evaluate("triton_tiled", {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8,
                                            "num_warps": 1, "num_stages": 1}, 40.0)
    assert slow.ok and slow.median_ms == 5.0 > ABORT_FACTOR * 1.0
    close = runner.evaluate("triton_tiled", {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8,
                                             "num_warps": 1, "num_stages": 1}, 40.0)
    assert close.median_ms == 1.1
    assert [c.split("(")[0] for c in calls] == ["cublas", "cublas", "triton_tiled", "triton_tiled", "triton_tiled"]


def test_a_config_that_does_not_parse_is_a_failed_trial():
    runner = LocalRunner(current())
    runner.start(Problem(8, 16, 32, "float32", "nn"), seed=1)
    trial = runner.evaluate("triton_tiled", {"BLOCK_M": 3}, 40.0)
    assert trial.status is Status.LAUNCH_ERROR and "exactly the keys" in trial.reason
