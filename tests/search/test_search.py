"""Search strategies on a synthetic space with a known optimum, a fake evaluate and a fake clock."""

import itertools
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from gemmtune.search import DEFAULT_TOPK, STRATEGIES, Budget, neighbours_by_fields, run


@dataclass(frozen=True)
class Cfg:
    block_m: int
    block_n: int
    stages: int


BLOCKS = (16, 32, 64, 128)
SPACE = [Cfg(m, n, s) for m, n, s in itertools.product(BLOCKS, BLOCKS, (2, 3, 4, 5))]
BEST = Cfg(64, 32, 3)


def cost(c: Cfg) -> float:
    """Separable and convex in the block index and stages, with its unique minimum at BEST."""
    return 1.0 + (BLOCKS.index(c.block_m) - 2) ** 2 + (BLOCKS.index(c.block_n) - 1) ** 2 + (c.stages - 3) ** 2


def fails(c: Cfg) -> bool:
    return c.block_m == 128 and c.block_n == 128  # too big for the fake device


class Bench:
    """A fake measurement: records each call and advances the fake clock by one second."""

    def __init__(self):
        self.calls, self.now = [], 0.0

    def evaluate(self, c):
        self.calls.append(c)
        self.now += 1.0
        return None if fails(c) else cost(c)

    def clock(self):
        return self.now


NEIGHBOURS = neighbours_by_fields(SPACE, asdict)
EVERY_OPTION = dict(predict=cost, neighbours=NEIGHBOURS)


def best_of(found):
    return min((c for c, t in found.items() if t is not None), key=found.__getitem__)


def search(strategy, budget=Budget(), **options):
    bench = Bench()
    found = run(strategy, SPACE, bench.evaluate, budget, clock=bench.clock, **{**EVERY_OPTION, **options})
    assert list(found) == bench.calls, "results are in evaluation order, one per call"
    assert len(set(bench.calls)) == len(bench.calls), "no config is evaluated twice"
    return found, bench.calls


def test_exhaustive_walks_the_space_in_order_and_records_failures():
    found, calls = search("exhaustive")
    assert calls == SPACE
    assert [c for c, t in found.items() if t is None] == [c for c in SPACE if fails(c)]
    assert best_of(found) == BEST


def test_topk_evaluates_the_default_count_in_predicted_order():
    _, calls = search("topk", predict=lambda c: -c.stages)
    # stages 5 first; ties keep the space's order
    assert calls == [c for c in SPACE if c.stages == 5][:DEFAULT_TOPK]


def test_topk_count_follows_trials_and_never_exceeds_the_space():
    assert len(search("topk", Budget(trials=3))[1]) == 3
    assert search("topk", Budget(trials=1000))[1] == sorted(SPACE, key=cost)


def test_topk_with_a_perfect_predictor_finds_the_optimum_in_one_trial():
    assert search("topk", Budget(trials=1))[0] == {BEST: 1.0}


def test_topk_with_an_anti_correlated_predictor_evaluates_the_worst_first():
    _, calls = search("topk", predict=lambda c: -cost(c))
    assert calls[0] == max(SPACE, key=cost)
    assert [cost(c) for c in calls] == sorted((cost(c) for c in calls), reverse=True)


def test_topk_without_predict_raises():
    with pytest.raises(ValueError, match="predict"):
        run("topk", SPACE, Bench().evaluate)


def test_random_defaults_to_sixteen_trials_and_is_reproducible_per_seed():
    _, first = search("random", seed=1)
    assert len(first) == 16
    assert search("random", seed=1)[1] == first
    assert search("random", seed=2)[1] != first
    assert set(search("random", Budget(trials=len(SPACE)), seed=1)[1]) == set(SPACE)


def test_random_with_only_a_seconds_budget_is_not_capped_at_sixteen():
    assert len(search("random", Budget(seconds=1e9))[1]) == len(SPACE)


def test_descent_reaches_the_optimum_from_a_poor_start_and_then_stops():
    found, calls = search("descent", predict=None)
    assert calls[0] == SPACE[0]
    assert best_of(found) == BEST
    # path (16,16,2) -> (64,16,2) -> (64,16,3) -> BEST: the start, then 9, 6 and 5 neighbours
    # not yet measured along it, then BEST's 5 unmeasured ones, none of which improves
    assert len(calls) == 1 + 9 + 6 + 5 + 5
    assert set(calls[-5:]) <= set(NEIGHBOURS(BEST))


def test_descent_from_the_optimum_measures_its_neighbours_once_and_stops():
    _, calls = search("descent")
    assert calls == [BEST, *NEIGHBOURS(BEST)]


def test_descent_starts_from_the_next_predicted_config_when_the_start_fails():
    failing = Cfg(128, 128, 3)
    predict = lambda c: -1.0 if c == failing else cost(c)  # noqa: E731
    found, calls = search("descent", predict=predict)
    assert calls[:2] == [failing, BEST]
    assert found[failing] is None and found[BEST] == 1.0


def test_descent_without_neighbours_raises():
    with pytest.raises(ValueError, match="neighbours"):
        run("descent", SPACE, Bench().evaluate)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_respects_the_trial_budget(strategy):
    assert len(search(strategy, Budget(trials=3), predict=lambda c: -cost(c))[1]) == 3


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_stops_starting_evaluations_when_the_seconds_run_out(strategy):
    # the fake clock reads 0, 1, 2, ... before each evaluation; at 5 no new one starts
    assert len(search(strategy, Budget(seconds=5), predict=lambda c: -cost(c))[1]) == 5


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_repeated_configs_are_evaluated_once(strategy):
    bench = Bench()
    found = run(strategy, SPACE + SPACE[::-1], bench.evaluate, Budget(trials=1000), **EVERY_OPTION)
    assert len(bench.calls) == len(set(bench.calls)) == len(found)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_empty_space_evaluates_nothing(strategy):
    assert run(strategy, [], Bench().evaluate, **EVERY_OPTION) == {}


def test_unknown_strategy_lists_the_accepted_names():
    with pytest.raises(ValueError, match="strategy must be one of exhaustive, topk, random, descent; got 'anneal'"):
        run("anneal", SPACE, Bench().evaluate)


def test_neighbours_differ_in_exactly_one_field():
    c = Cfg(32, 64, 4)
    expected = ([Cfg(m, 64, 4) for m in (16, 64, 128)] + [Cfg(32, n, 4) for n in (16, 32, 128)]
                + [Cfg(32, 64, s) for s in (2, 3, 5)])
    assert sorted(NEIGHBOURS(c), key=SPACE.index) == NEIGHBOURS(c)
    assert set(NEIGHBOURS(c)) == set(expected) and len(NEIGHBOURS(c)) == 9


def test_neighbours_are_limited_to_the_space_and_accept_tuples():
    space = [(16, 2), (32, 2), (16, 3), (64, 3)]
    neighbours = neighbours_by_fields(space, lambda t: {"block": t[0], "stages": t[1]})
    assert neighbours((16, 2)) == [(32, 2), (16, 3)]
    assert neighbours((64, 3)) == [(16, 3)]
    assert neighbours((64, 2)) == [(16, 2), (32, 2), (64, 3)]  # a config outside the space works too


@pytest.mark.parametrize("kwargs, field", [
    ({"trials": 0}, "trials"), ({"trials": -1}, "trials"), ({"trials": True}, "trials"),
    ({"trials": 2.0}, "trials"), ({"seconds": 0}, "seconds"), ({"seconds": -1.0}, "seconds"),
    ({"seconds": float("nan")}, "seconds"), ({"seconds": True}, "seconds"),
])
def test_budget_rejects_invalid_limits_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Budget(**kwargs)


def test_budget_accepts_valid_limits():
    assert Budget(trials=1, seconds=0.5) == Budget(1, 0.5)
    assert Budget(seconds=3).seconds == 3


def test_importing_search_loads_no_torch_triton_or_numpy():
    """The search package itself is torch-free. ``import gemmtune`` loads torch (it registers the
    custom ops), so the package is imported here under a bare ``gemmtune`` namespace."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    code = ("import sys, types; package = types.ModuleType('gemmtune'); "
            f"package.__path__ = [{os.path.join(src, 'gemmtune')!r}]; sys.modules['gemmtune'] = package; "
            "import gemmtune.search; "
            "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
