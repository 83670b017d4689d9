"""The fleet benchmark's comparisons of its runs: ``drift`` (two runs' readings of the candidates
both timed in their final rounds, against each run's own noise), where a difference started, the
crosscheck, and the runs it makes (``--runs``) with a ray run's scaling and scale row."""

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from gemmtune.problem import Problem
from gemmtune.results import Status, Timing, TuneResult, Trial
from gemmtune.store import Store
from gemmtune.tuning.tuner import MIN_GAIN

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 40


def tile(block_m: int) -> dict:
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def fleet():
    spec = importlib.util.spec_from_file_location("fleet", ROOT / "benchmarks" / "fleet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(path: Path, shift: float, seed: int) -> Path:
    """A store of three problems, each with cuBLAS and two finalists timed in ROUNDS rounds (noise
    of 1% per round) and one candidate screened only; the finalists' kernels ``shift`` times
    slower than they are."""
    rng = random.Random(seed)
    store = Store(path)
    for n in (64, 128, 256):
        cublas = [0.1 * (1 + rng.gauss(0, 0.01)) for _ in range(ROUNDS)]
        trials = [Trial("cublas", {}, Status.OK, timing=Timing(tuple(cublas)))]
        for block, gain in ((32, 0.95), (64, 0.97)):
            samples = tuple(c * gain * shift * (1 + rng.gauss(0, 0.01)) for c in cublas)
            trials.append(Trial("triton_tiled", tile(block), Status.OK, timing=Timing(samples)))
        trials.append(Trial("triton_tiled", tile(16), Status.OK, timing=Timing((0.2, 0.21, 0.2))))
        store.put(TuneResult(Problem(n, n, n, "float16", "nn").key(), "gpu0", "triton_tiled", tile(32),
                             0.095, 0.1, 1.0, trials=tuple(trials)))
    return path


def test_drift_reads_within_noise_between_runs_that_agree_and_beyond_it_between_runs_that_do_not(tmp_path):
    drift = fleet().drift
    first = run(tmp_path / "a.sqlite", 1.0, seed=1)
    level = drift(first, run(tmp_path / "b.sqlite", 1.0, seed=2))
    assert level["pairs"] == 6  # the two finalists of each problem; cuBLAS and the screened one are not pairs
    assert level["abs_diff"]["p50"] < 0.01 and level["beyond_3se"] <= 1 / 6
    moved = drift(first, run(tmp_path / "c.sqlite", 1.03, seed=3))
    assert moved["pairs"] == 6 and moved["abs_diff"]["p50"] > 0.02 and moved["beyond_3se"] == 1.0


def test_drift_of_stores_with_no_common_finalists_says_so(tmp_path):
    assert fleet().drift(Store(tmp_path / "a.sqlite").path, Store(tmp_path / "b.sqlite").path) == {"pairs": 0}


def test_a_difference_says_where_it_started(tmp_path):
    """Both choices finalists in both runs: ``final``; one of them cut after two screening rounds
    in a run: ``cut``; one of them screened in full but never in a run's final: ``screening``."""
    module = fleet()
    first = Store(run(tmp_path / "a.sqlite", 1.0, seed=1))
    key = Problem(64, 64, 64, "float16", "nn").key()
    ours = next(r for r in first.choices() if r.problem_key == key)

    def other(name: str, cut: tuple[int, ...]) -> Store:
        """The same run choosing tile(64), with tile(64)'s samples cut to ``cut`` rounds if given."""
        trials = tuple(t if t.config != tile(64) or not cut else Trial(t.backend, t.config, Status.OK,
                                                                        timing=Timing(t.timing.samples[:len(cut)]))
                       for t in first.trials("gpu0", key))
        store = Store(tmp_path / name)
        store.put(TuneResult(key, "gpu0", "triton_tiled", tile(64), 0.097, 0.1, 1.0, trials=trials))
        return store

    for name, cut, expected in (("final.sqlite", (), "final"), ("cut.sqlite", (1, 2), "cut"),
                                ("screening.sqlite", (1, 2, 3), "screening")):
        store = other(name, cut)
        assert module.started(first, store, ours, store.choices()[0]) == expected, name


def test_the_crosscheck_reads_each_difference_on_gpu_0_in_place_and_on_another_gpu_apart():
    """Under the interpreter (both 'GPUs' the CPU): a difference between cuBLAS and a tiled kernel
    gets its kernel and cost ratios with their noise on GPU 0 as its own fields, and on GPU 1
    under ``on_gpu1``; a missing problem is left alone; each comparison counts what was level."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("reads GPU 1, and this machine has one GPU (under the interpreter both are the CPU)")
    key = Problem(7, 16, 16, "float32", "linear").key()
    comparison = {"differences": [{"problem": key, "plain": ["cublas", {}], "other": ["triton_tiled", tile(16)]},
                                  {"problem": key, "missing": True}]}
    crosscheck = fleet().crosscheck
    crosscheck(comparison, 5.0)
    crosscheck(comparison, 5.0, gpu=1)
    first, missing = comparison["differences"]
    assert set(missing) == {"problem", "missing"}
    for readings in (first, first["on_gpu1"]):
        assert readings["kernel"] > 0 and readings["cost"] > 0 and readings["kernel_noise"] >= 0
        assert isinstance(readings["within_noise"], bool) and isinstance(readings["cost_level"], bool)
        assert readings["cost_level"] == (abs(readings["cost"] - 1) <= max(MIN_GAIN, readings["cost_noise"]))
        assert readings["cost_level"] or not readings["within_noise"]  # within noise: its cost level too
    assert "on_gpu1" not in first["on_gpu1"]
    assert comparison["within_noise"] == int(first["within_noise"])
    assert comparison["cost_level"] == int(first["cost_level"])
    assert comparison["on_gpu1"] == {"within_noise": int(first["on_gpu1"]["within_noise"]),
                                     "cost_level": int(first["on_gpu1"]["cost_level"])}


def test_runs_are_named_plain_always_among_them_and_a_ray_run_is_compared_and_scaled_apart(tmp_path):
    module = fleet()
    assert module.runs_of("ray") == ["plain", "ray"] and module.runs_of("gpus_all,plain") == ["gpus_all", "plain"]
    with pytest.raises(Exception, match="--runs: gpus unknown"):
        module.runs_of("plain,gpus")
    run(tmp_path / "plain.sqlite", 1.0, 0)
    run(tmp_path / "ray.sqlite", 1.0, 1)
    result = {"device": "gpu", "torch": "x", "date": "d", "timings": "GPU", "gpus": 2, "plain_s": 10.0, "ray_s": 6.0}
    module.compare(result, "ray", tmp_path)
    ray = result["ray"]
    assert ray["scaling"] == pytest.approx(10 / 6) and ray["problems"] == 3 and "scaling" not in result
    ray |= {"within_noise": 0, "cost_level": 0}
    (row,) = module.scale_file(result)["rows"]  # no --gpus all run: the ray row alone
    assert row["scheduler"] == "ray" and row["wall_s"] == 6.0 and row["entries_lost"] == 0
    assert row["choice_agreement"] == ray["agreement"]


def test_the_scalings_of_several_rounds_are_their_medians_and_the_scale_row_says_so(tmp_path):
    module = fleet()
    run(tmp_path / "plain.sqlite", 1.0, 0)
    run(tmp_path / "gpus_all.sqlite", 1.0, 0)
    run(tmp_path / "ray.sqlite", 1.0, 0)
    result = {"device": "gpu", "torch": "x", "date": "d", "timings": "GPU", "gpus": 2, "plain_s": 10.0,
              "gpus_all_s": 5.0, "ray_s": 8.0}
    module.compare(result, "gpus_all", tmp_path)
    module.compare(result, "ray", tmp_path)
    for place in (result, result["ray"]):
        place |= {"within_noise": 0, "cost_level": 0}
    result["rounds"] = [{"plain": 10.0, "gpus_all": 5.0, "ray": 8.0}, {"plain": 12.0, "gpus_all": 4.0, "ray": 6.0},
                        {"plain": 9.0, "gpus_all": 4.5, "ray": 4.5}]
    module.median_scalings(result)
    assert result["scaling"] == pytest.approx(2.0) and result["scaling_median"] == pytest.approx(2.0)
    assert result["ray"]["scaling_median"] == pytest.approx(2.0)  # of 1.25, 2 and 2; the first round read 1.25
    rows = {row["scheduler"]: row for row in module.scale_file(result)["rows"]}
    assert rows["ray"]["speedup_vs_one"] == pytest.approx(2.0) and rows["ray"]["rounds"] == 3
    assert rows["gpus"]["wall_s"] == 4.5 and rows["gpus"]["one_gpu_wall_s"] == 10.0


def test_a_count_of_rounds_under_one_is_refused_naming_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fleet().main(["--out", str(tmp_path / "f.json"), "--times", "0"])
    assert "--times 0: expected a count of at least 1" in capsys.readouterr().err
