"""The tuning flow end to end on the current device (the CPU interpreter in CI), and the
noise-aware selection rule on synthetic timings."""

import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmtune import backends, search
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing, Trial
from gemmtune.tuning import tuner
from gemmtune.tuning.tuner import TuneOptions, _faster, _finalists, _settled, graph_choice, select, tune_problem


def timing(median, spread=0.0, order_seed=None):
    """Evenly spaced samples whose half inter-quartile range is ``spread`` of the median, in
    rising order (a drift every timing of the rounds shares) or shuffled by ``order_seed``
    (noise of its own)."""
    samples = [median * (1 - 2 * spread + 4 * spread * i / 100) for i in range(101)]
    if order_seed is not None:
        random.Random(order_seed).shuffle(samples)
    t = Timing(tuple(samples))
    assert abs(t.spread - spread) < 1e-9 and abs(t.median - median) < 1e-12
    return t


def flat(ms, rounds=11):
    """A cost or host time that read ``ms`` in every round."""
    return Timing((ms,) * rounds)


def decide(cublas_ms, other_ms, cublas_spread=0.0, other_spread=0.0, shared_drift=False):
    timings = {"cublas": timing(cublas_ms, cublas_spread, None if shared_drift else 1),
               "x": timing(other_ms, other_spread, None if shared_drift else 2)}
    return select("cublas", timings, timings)


def test_a_clear_win_is_taken():
    assert decide(1.0, 0.8) == "x"


def test_a_win_under_two_percent_keeps_cublas():
    assert decide(1.0, 0.985) == "cublas"


def test_a_win_inside_the_noise_keeps_cublas():
    # independent noise of 3% each: their per-round ratio spreads by about 3.6%
    assert decide(1.0, 0.97, cublas_spread=0.03, other_spread=0.03) == "cublas"
    assert decide(1.0, 0.93, cublas_spread=0.03, other_spread=0.03) == "x"


def test_drift_shared_by_the_rounds_is_not_noise():
    """Both timings drift together by 3% (clocks, power): the ratio is steady, so a 5% win
    stands, where adding the two spreads (6%) would have thrown it away."""
    assert decide(1.0, 0.95, cublas_spread=0.03, other_spread=0.03, shared_drift=True) == "x"
    assert decide(1.0, 0.99, cublas_spread=0.03, other_spread=0.03, shared_drift=True) == "cublas"  # under MIN_GAIN


def test_a_win_is_read_from_the_per_round_ratios():
    """The clocks drift over the rounds (cuBLAS from 1.0 to 1.2) and the candidate is 3% faster
    in 51 rounds, level in 50: the median of its per-round ratios is 0.97, a win, while the
    ratio of the two medians (0.984) mixes the drift in and reads it as under MIN_GAIN."""
    clocks = [1 + 0.2 * i / 100 for i in range(101)]
    cublas = Timing(tuple(clocks))
    other = Timing(tuple(c * (0.97 if i % 2 == 0 else 1.0) for i, c in enumerate(clocks)))
    assert other.median / cublas.median > 1 - 0.02 and other.ratio_to(cublas) == pytest.approx(0.97)
    timings = {"cublas": cublas, "x": other}
    assert select("cublas", timings, timings) == "x"


def test_slower_never_wins():
    assert decide(1.0, 1.2) == "cublas"


def test_a_cheaper_launch_does_not_win_with_a_slower_kernel():
    """Host-bound costs: cuBLAS's call 12 us for an 8.7 us kernel, the candidate's 10.6 us for
    a 10.6 us kernel. Cheaper in a plain loop, 22% slower replayed from a CUDA graph."""
    timings = {"cublas": timing(0.0087, 0.01), "x": timing(0.0106, 0.01)}
    assert select("cublas", timings, {"cublas": flat(0.012), "x": flat(0.0106)}) == "cublas"
    # the same launch saving with a kernel as fast as cuBLAS's wins
    timings["x"] = timing(0.0087, 0.01)
    assert select("cublas", timings, {"cublas": flat(0.012), "x": flat(0.0092)}) == "x"


def test_a_graph_replays_cublas_where_the_choice_kernel_is_slower_beyond_min_gain():
    """A choice whose kernel read within its noise of cuBLAS's in the final rounds, and 5% slower
    over them: a CUDA graph replays cuBLAS's kernel."""
    trials = [finalist("cublas", {}, 0.0300, seed=1), finalist("triton_tiled", {"n": 1}, 0.0315, seed=2)]
    assert graph_choice(trials, trials[1].label()) is trials[0]
    assert graph_choice(trials, "cublas") is None


def test_a_faster_kernel_with_a_costlier_launch_does_not_win():
    """Decode at batch 16, eager: a 41 us kernel hides a 20 us launch in a loop of its own calls,
    but in a model whose other operators keep the host busy, the 20 us are what the step pays.
    So a candidate whose host time per call is over cuBLAS's by more than HOST_SLACK is not
    chosen, however fast its kernel; the next cheapest one may be."""
    from gemmtune.tuning.tuner import HOST_SLACK

    timings = {"cublas": timing(0.043, 0.005), "tma": timing(0.040, 0.005), "bound": timing(0.0415, 0.005)}
    costs = dict(timings)
    slow_launch = {"cublas": flat(0.015), "tma": flat(0.015 * (1 + 2 * HOST_SLACK)), "bound": flat(0.008)}
    assert select("cublas", timings, costs, slow_launch) == "bound"
    del timings["bound"], costs["bound"]
    assert select("cublas", timings, costs, slow_launch) == "cublas"
    assert select("cublas", timings, costs, {**slow_launch, "tma": flat(0.015 * (1 + HOST_SLACK / 2))}) == "tma"
    assert select("cublas", timings, costs, {"cublas": None, "tma": flat(0.03)}) == "tma"  # not measured: no rule
    assert select(None, timings, costs, slow_launch) == "tma"  # cuBLAS failed verification


def test_among_winners_that_cost_the_same_the_fastest_kernel_is_chosen():
    """Three kernels under a launch-bound cost of 10 us (within noise of each other), cuBLAS's
    call at 12 us: whichever reads cheapest by a hair, the fastest kernel is taken, as cheap in
    a loop and faster in a CUDA graph; a kernel cheaper beyond the noise still wins outright."""
    timings = {"cublas": timing(0.0060, 0.01), "a": timing(0.0050, 0.01), "b": timing(0.0040, 0.01),
               "c": timing(0.0045, 0.01)}
    costs = {"cublas": timing(0.012, 0.01, 1), "a": timing(0.00990, 0.01, 2), "b": timing(0.0100, 0.01, 3),
             "c": timing(0.0101, 0.01, 4)}
    assert select("cublas", timings, costs) == "b"
    costs["a"] = timing(0.0080, 0.01, 2)
    assert select("cublas", timings, costs) == "a"


def test_near_equal_winners_are_told_apart_by_the_order_they_were_tried_not_by_noise():
    """Two cuBLASLt algorithms 5% under cuBLAS and within a percent of each other: whichever
    reads faster by noise in these rounds, the one tried first wins, so that two tunings agree;
    one faster beyond MIN_GAIN still wins wherever it was tried."""
    costs = {"cublas": timing(0.100, 0.005, 1), "lt1": timing(0.0950, 0.005, 2), "lt2": timing(0.0945, 0.005, 3)}
    for first, second in (("lt1", "lt2"), ("lt2", "lt1")):
        assert select("cublas", costs, costs, order=["cublas", first, second]) == first
        swapped = {**costs, "lt1": costs["lt2"], "lt2": costs["lt1"]}
        assert select("cublas", swapped, swapped, order=["cublas", first, second]) == first
    costs["lt2"] = timing(0.090, 0.005, 3)
    assert select("cublas", costs, costs, order=["cublas", "lt1", "lt2"]) == "lt2"
    # without an order, the labels' own order: still the same choice whatever the noise
    assert select("cublas", {**costs, "lt2": timing(0.0945, 0.005, 3)}, {**costs, "lt2": timing(0.0945, 0.005, 3)}) \
        == "lt1"


def test_a_winner_whose_kernel_is_slower_gives_way_to_the_next_cheapest():
    timings = {"cublas": timing(0.0087, 0.01), "x": timing(0.0106, 0.01), "y": timing(0.0080, 0.01)}
    costs = {"cublas": flat(0.012), "x": flat(0.0090), "y": flat(0.0100)}
    assert select("cublas", timings, costs) == "y"


def test_half_the_margin_names_a_narrow_loser():
    """A 2.5% cheaper call under 3% of noise: not a win, but within half the margin of one, which
    the tuner settles over more rounds (_settled)."""
    costs = {"cublas": timing(1.0, 0.03, 1), "x": timing(0.975, 0.03, 2)}
    assert select("cublas", costs, costs) == "cublas"
    assert select("cublas", costs, costs, margin=0.5) == "x"
    assert select("cublas", {**costs, "x": timing(0.995, 0.03, 2)}, {**costs, "x": timing(0.995, 0.03, 2)},
                  margin=0.5) == "cublas"


@pytest.mark.interpreter
def test_tune_problem_verifies_and_records_every_candidate():
    problem = Problem(33, 47, 65, "float32", "linear", bias=True)
    result = tune_problem(problem, current(), options=TuneOptions(seed=1))
    assert result.problem_key == problem.key()
    assert result.backend in backends.names()
    labels = {t.label() for t in result.trials}
    assert "cublas" in labels and any(t.backend == "triton_tiled" for t in result.trials)
    assert all(t.ok for t in result.trials), [t.reason for t in result.trials if not t.ok]
    assert result.rel_err is not None and result.rel_err < 1e-4
    assert result.cublas_ms > 0 and result.time_ms > 0
    # the finalists' timings are the final round's, cuBLAS among them; the rest keep their screening
    finals = [t for t in result.trials if t.final]
    assert any(t.backend == "cublas" for t in finals) and result.label() in {t.label() for t in finals}
    # the best screened, then the best of each backend left out, then cuBLAS
    measured = {t.backend for t in result.trials if t.backend != "cublas"}
    assert len(finals) <= TuneOptions().finalists + len(measured) + 1 and len(finals) < len(result.trials)
    assert len({len(t.timing.samples) for t in finals}) == 1  # timed in the same rounds


@pytest.mark.interpreter
def test_a_wrong_kernel_is_recorded_and_never_chosen(monkeypatch):
    tiled = backends.get("triton_tiled")
    real_build = tiled.build

    def broken_build(problem, config, device):
        kernel = real_build(problem, config, device)

        def wrong(a, b, bias, out=None):
            return kernel(a, b, bias, out=out).mul_(1.01)  # fast and 1% off

        return wrong

    monkeypatch.setattr(tiled, "build", broken_build)
    # cuBLAS and the broken backend alone: under the interpreter, with the CPU shared, another
    # Triton backend can out-time cuBLAS, and what is asserted is that the wrong one never wins
    result = tune_problem(Problem(16, 16, 32, "float32", "nn"), current(),
                          options=TuneOptions(seed=2, backends=("cublas", "triton_tiled")))
    wrong = [t for t in result.trials if t.backend == "triton_tiled"]
    assert wrong and all(t.status is Status.WRONG_RESULT for t in wrong)
    assert all("tolerance" in t.reason for t in wrong)
    assert result.backend == "cublas"


def test_a_candidate_that_raises_becomes_a_failed_trial(monkeypatch):
    tiled = backends.get("triton_tiled")

    def exploding_build(problem, config, device):
        raise RuntimeError("launch failed: boom")

    monkeypatch.setattr(tiled, "build", exploding_build)
    result = tune_problem(Problem(8, 8, 8, "float32", "nn"), current(),
                          options=TuneOptions(seed=3, backends=("cublas", "triton_tiled")))
    failed = [t for t in result.trials if t.backend == "triton_tiled"]
    assert failed and all(t.status is Status.LAUNCH_ERROR and "boom" in t.reason for t in failed)
    assert result.backend == "cublas"


def test_unknown_backend_in_options():
    with pytest.raises(ValueError, match="unknown backend"):
        tune_problem(Problem(8, 8, 8, "float32"), current(), options=TuneOptions(backends=("cutlass",)))


def test_strategy_is_validated():
    with pytest.raises(ValueError, match="accepted: exhaustive, topk, random, descent"):
        TuneOptions(strategy="bayes")


@pytest.mark.interpreter
def test_a_trial_budget_caps_each_modelled_backend():

    problem = Problem(16, 32, 64, "float32", "nn")
    result = tune_problem(problem, current(), options=TuneOptions(strategy="topk", budget=search.Budget(trials=1), seed=4))
    per_backend = {}
    for t in result.trials:
        per_backend[t.backend] = per_backend.get(t.backend, 0) + 1
    modelled = [name for name in per_backend if name.startswith("triton_")]
    assert modelled and all(per_backend[name] == 1 for name in modelled)
    assert per_backend["cublas"] == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("best_is_compiled", [False, True])
def test_a_backend_s_configs_compiled_already_are_all_screened_and_count_in_the_strategy(monkeypatch,
                                                                                        best_is_compiled):
    # cute's kind of backend (CACHED_COMPILES), played by the tiled kernel: the configs it says
    # are compiled stand for those whose kernels the compile cache holds
    tiled = backends.get("triton_tiled")
    problem = Problem(32, 32, 64, "float32", "nn")
    space = tiled.candidates(problem, current())
    best = search.plan("topk", space, search.Budget(trials=1), predict=lambda c: tiled.predict_ms(problem, current(), c))
    compiled = [c for c in space if (c in best) == best_is_compiled][:3]
    monkeypatch.setattr(backends, "CACHED_COMPILES", ("triton_tiled",))
    monkeypatch.setattr(tiled, "compiled", lambda p, configs: [c for c in configs if c in compiled], raising=False)
    options = TuneOptions(strategy="topk", budget=search.Budget(trials=1), seed=4, backends=("cublas", "triton_tiled"))
    # compiling ahead plans only what the strategy picks that is not compiled yet
    assert tuner._plan(problem, current(), options) == ([] if best_is_compiled else [("triton_tiled", best[0].as_dict())])
    result = tune_problem(problem, current(), options=options)
    tried = [dict(t.config) for t in result.trials if t.backend == "triton_tiled"]
    # every compiled one, whatever the cost model says, and the budget's best predicted (once)
    assert sorted(map(str, tried)) == sorted({str(c.as_dict()) for c in [*compiled, *best]})
    assert all(t.ok for t in result.trials)


def test_cublas_runs_at_the_problems_float32_precision():
    import torch

    from gemmtune.tuning.runner import matmul_precision

    before = torch.get_float32_matmul_precision()
    with matmul_precision(Problem(8, 8, 8, "float32", tf32=True)):
        assert torch.get_float32_matmul_precision() == "high"
    with matmul_precision(Problem(8, 8, 8, "float32", tf32=False)):
        assert torch.get_float32_matmul_precision() == "highest"
    assert torch.get_float32_matmul_precision() == before


@pytest.mark.interpreter
def test_a_wrong_cublas_is_never_chosen(monkeypatch):
    """Under MPS at 38 SMs of an H200, cuBLAS returned wrong bf16 products for 1000x1000x1000:
    tuning goes on among the verified candidates instead of failing or trusting it."""
    cublas = backends.get("cublas")
    right = cublas.build

    def wrong(problem, config, device):
        kernel = right(problem, config, device)
        return lambda a, b, bias, out=None: kernel(a, b, bias, out=out).add_(1.0)

    monkeypatch.setattr(cublas, "build", wrong)
    problem = Problem(33, 48, 40, "float32", "nn")
    result = tune_problem(problem, current(), options=TuneOptions(seed=3, backends=("cublas", "triton_tiled")))
    assert result.backend == "triton_tiled" and result.cublas_ms is None
    assert [t.status for t in result.trials if t.backend == "cublas"] == [Status.WRONG_RESULT]


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's case")
def test_triton_imported_before_the_interpreter_was_chosen_is_said_not_failed(tmp_path):
    """Triton fixes its own helpers as compiled or interpreted when first imported: a program
    that imports triton before gemmtune picks the interpreter cannot run Triton kernels. That is
    said once, and tuning keeps to torch's kernels instead of failing every Triton candidate."""
    script = ("import triton, gemmtune\n"
              "r = gemmtune.tune([gemmtune.Problem(33, 47, 65, 'float32', 'linear')])\n"
              "print(sorted({t.backend + ':' + t.status.value for t in r[0].trials}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), GEMMTUNE_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Set TRITON_INTERPRET=1 in the environment before anything imports triton" in done.stderr
    assert done.stdout.strip() == "['cublas:ok', 'cublas_padded:ok']"


def trial(backend, n):
    return Trial(backend, {"n": n}, Status.OK, timing=flat(0.01), vs_reference=1.0 - n / 100)


def test_the_finalists_hold_the_best_of_every_backend():
    """Screening ranks kernel times; a call's cost adds its backend's launch path, which only the
    final rounds measure, so each backend's best screened candidate is a finalist."""
    ranked = [trial("cublaslt", 9), trial("cublaslt", 8), trial("triton_stream", 7), trial("cublaslt", 6),
              trial("triton_tiled", 5), trial("cublaslt", 4), trial("triton_tiled", 3)]
    chosen = _finalists(ranked, 2)
    assert [(t.backend, t.config["n"]) for t in chosen] == [("cublaslt", 9), ("cublaslt", 8), ("triton_stream", 7),
                                                             ("triton_tiled", 5)]
    assert _finalists(ranked[:1], 4) == ranked[:1]


class Rounds:
    """A runner whose final rounds read what it is given, and that keeps what it was asked."""

    def __init__(self, reads):
        self.reads, self.asked = reads, []

    def final(self, candidates, budget_ms, min_rounds):
        self.asked.append([backend for backend, _ in candidates])
        return self.reads


def final_reads(reference, other, ratio, spread=0.01, seed=0, reason=""):
    """What a runner's final rounds answer for cuBLAS at 0.1 ms and ``other`` at ``ratio`` of it."""
    return {reference.label(): (timing(0.1, spread, seed + 1), timing(0.1, spread, seed + 1), None, ""),
            other.label(): (timing(0.1 * ratio, spread, seed + 2), timing(0.1 * ratio, spread, seed + 2), None, reason)}


@pytest.mark.parametrize("first,again,kept", [(0.975, 0.95, "lt"), (0.975, 0.995, "cublas"), (0.985, 0.97, "lt"),
                                              (0.985, 0.985, "cublas")])
def test_a_contender_near_the_margin_is_settled_over_both_sets_of_rounds(first, again, kept):
    """A gain read 2.5% (a narrow win) or 1.5% (a narrow loss) is settled over the final rounds
    and fresh ones of the two alone, pooled: kept where the pooled rounds show it beyond the
    margin, cuBLAS otherwise."""
    reference, contender = Trial("cublas", {}, Status.OK), Trial("cublaslt", {"algo": 1}, Status.OK)
    runner = Rounds(final_reads(reference, contender, again, seed=10))
    chosen = _settled(contender, reference, final_reads(reference, contender, first), runner, TuneOptions(),
                      Problem(64, 64, 64))
    assert runner.asked == [["cublas", "cublaslt"]]
    assert chosen is (contender if kept == "lt" else reference)


def test_a_contender_wrong_after_its_settling_rounds_is_never_chosen():
    reference, contender = Trial("cublas", {}, Status.OK), Trial("cublaslt", {"algo": 1}, Status.OK)
    first = final_reads(reference, contender, 0.5)
    wrong = final_reads(reference, contender, 0.5, reason="after timing: rel_err 3e-1")
    problem = Problem(64, 64, 64)
    assert _settled(contender, reference, first, Rounds(wrong), TuneOptions(), problem) is reference
    assert _settled(contender, reference, first, Rounds({reference.label(): wrong[reference.label()]}), TuneOptions(),
                    problem) is reference


def test_only_a_narrow_win_is_settled():
    assert _faster(timing(0.09, 0.005, 1), timing(0.1, 0.005, 2), by=2)
    assert not _faster(timing(0.97, 0.005, 1), timing(1.0, 0.005, 2), by=2)


def finalist(backend, config, median, rounds=24, seed=0):
    """A stored trial of the final rounds: ``rounds`` samples around ``median``, 1% of noise."""
    rng = random.Random(seed)
    return Trial(backend, config, Status.OK, timing=Timing(tuple(median * (1 + rng.uniform(-0.01, 0.01))
                                                                 for _ in range(rounds))))


def test_a_graph_replays_the_fastest_finalist_kernel_where_the_choice_is_slower():
    """Chosen on a call's cost: cuBLAS, whose call the host paces. A cuBLASLt algorithm 6% faster
    in the final rounds is what a CUDA graph should replay; a screened-only trial (other rounds)
    and a failed one never are."""
    trials = [finalist("cublas", {}, 0.0300, seed=1), finalist("cublaslt", {"algo": 1}, 0.0282, seed=2),
              finalist("cublaslt", {"algo": 2}, 0.0250, rounds=5, seed=3),
              Trial("triton_tiled", {"n": 1}, Status.WRONG_RESULT, reason="rel_err")]
    assert graph_choice(trials, "cublas") is trials[1]
    assert graph_choice(trials, trials[1].label()) is None  # the choice is the fastest already
    assert graph_choice(trials[:1] + trials[2:], "cublas") is None


def test_a_graph_keeps_the_choice_where_no_kernel_beats_it_beyond_min_gain():
    trials = [finalist("cublas", {}, 0.0300, seed=1), finalist("cublaslt", {"algo": 1}, 0.0297, seed=2)]
    assert graph_choice(trials, "cublas") is None
    # nor where the final rounds are not on record: too few, or no cuBLAS among them
    short = [finalist("cublas", {}, 0.03, rounds=5), finalist("cublaslt", {"algo": 1}, 0.02, rounds=5)]
    assert graph_choice(short, "cublas") is None
    assert graph_choice(trials[1:], trials[1].label()) is None


def test_near_equal_graph_kernels_are_told_apart_by_the_order_they_were_tried():
    first, second = finalist("cublaslt", {"algo": 1}, 0.0250, seed=2), finalist("cublaslt", {"algo": 2}, 0.0248, seed=3)
    reference = finalist("cublas", {}, 0.0300, seed=1)
    assert graph_choice([reference, first, second], "cublas") is first
    assert graph_choice([reference, second, first], "cublas") is second


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.5, 1.5), min_size=1, max_size=6), st.integers(0, 2 ** 16), st.data())
def test_a_graph_kernel_is_never_slower_than_the_choice_or_cublas(medians, seed, data):
    """Whatever the finalists' times and whichever of them was chosen, a graph kernel, where there
    is one, beats the choice's kernel by more than MIN_GAIN, and cuBLAS's too unless it is
    cuBLAS's; and where the choice's kernel is slower than cuBLAS's beyond that, there is one."""
    from gemmtune.tuning.tuner import MIN_GAIN

    trials = [finalist("cublas", {}, 1.0, seed=seed)] + [finalist("cublaslt", {"algo": i}, m, seed=seed + i + 1)
                                                          for i, m in enumerate(medians)]
    chosen = data.draw(st.sampled_from(trials)).label()
    pick = graph_choice(trials, chosen)
    timings = {t.label(): t.timing for t in trials}
    if pick is not None:
        assert pick.timing.ratio_to(timings[chosen]) < 1 - MIN_GAIN
        assert pick is trials[0] or pick.timing.ratio_to(timings["cublas"]) < 1 - MIN_GAIN
    if timings["cublas"].ratio_to(timings[chosen]) < 1 - 2 * MIN_GAIN:
        assert pick is not None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.90, 1.0), min_size=2, max_size=5), st.permutations(range(5)))
def test_the_choice_does_not_depend_on_the_order_the_rounds_report_it(medians, order):
    """The same costs, listed in another order: the same choice (the search's order decides ties)."""
    labels = ["cublas"] + [f"lt{i}" for i in range(len(medians))]
    costs = {"cublas": timing(1.0, 0.005, 1), **{f"lt{i}": timing(m, 0.005, i + 2) for i, m in enumerate(medians)}}
    shuffled = {label: costs[label] for label in sorted(labels, key=lambda l: order[labels.index(l) % 5])}
    assert select("cublas", costs, costs, order=labels) == select("cublas", shuffled, shuffled, order=labels)


def test_a_backend_with_its_own_topk_count_gets_it_unless_the_options_give_one():
    from gemmtune.backends import cute

    assert tuner._budget("cute", TuneOptions()) == search.Budget(trials=cute.CuteBackend.topk)
    assert tuner._budget("triton_tiled", TuneOptions()) == search.Budget()  # search's DEFAULT_TOPK
    asked = search.Budget(trials=3, seconds=2.0)
    assert tuner._budget("cute", TuneOptions(budget=asked)) == asked
    assert tuner._budget("cute", TuneOptions(strategy="exhaustive")) == search.Budget()
    assert tuner._budget("cute", TuneOptions(budget=search.Budget(seconds=2.0))) == \
        search.Budget(trials=cute.CuteBackend.topk, seconds=2.0)


def test_a_host_bound_model_s_eager_calls_may_run_the_fastest_triton_finalist_within_the_ceiling():
    """cuBLAS chosen, a cuBLASLt algorithm faster on the GPU: the lean kernel is the fastest
    finalist of a lean backend (a bound Triton launch) whose kernel is within LEAN_CEILING of
    cuBLAS's, not the cuBLASLt one nor a TMA kernel's, whose calls build descriptors."""
    from gemmtune.tuning.tuner import LEAN_CEILING, lean_choice

    trials = [finalist("cublas", {}, 0.0300, seed=1), finalist("cublaslt", {"algo": 1}, 0.0280, seed=2),
              finalist("triton_tiled", {"n": 1}, 0.0345, seed=3),
              finalist("triton_splitk", {"n": 2}, 0.0330, seed=4),
              finalist("triton_persistent", {"n": 4}, 0.0290, seed=6),
              finalist("triton_stream", {"n": 3}, 0.0200, rounds=5, seed=5)]  # screened only: other rounds
    assert lean_choice(trials, "cublas") is trials[3]
    assert lean_choice(trials, trials[1].label()) is trials[3]
    assert lean_choice(trials, trials[4].label()) is trials[3]  # a persistent kernel's calls are not lean
    assert lean_choice(trials, trials[2].label()) is None  # the choice is a lean kernel already
    slow = [trials[0], finalist("triton_tiled", {"n": 1}, 0.0300 * (LEAN_CEILING + 0.05), seed=3)]
    assert lean_choice(slow, "cublas") is None  # beyond the ceiling
    assert lean_choice(trials[:2], "cublas") is None  # no Triton finalist
    assert lean_choice([finalist("cublas", {}, 0.03, rounds=5), finalist("triton_tiled", {}, 0.03, rounds=5)],
                       "cublas") is None  # the final rounds are not on record
