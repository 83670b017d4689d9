"""How candidates are measured (``gemmtune.tuning.measure``) and the statistics selection reads
from the samples (``gemmtune.results.Timing``): on the CPU against a fake clock, fake CUDA events
and a fake flush buffer, then (marked ``gpu``) on the real GPU."""

import gc
import random
from types import SimpleNamespace

import pytest
import torch

from gemmtune.device import Device, current, interpreter_device
from gemmtune.results import Timing
from gemmtune.tuning import measure

GPU = Device("fake H100", (9, 0), 132, 232448, 50 << 20)  # not the interpreter: measure's CUDA path


class Clock:
    """A host clock that moves only when told: ``perf_counter`` in seconds, ``advance`` in ms."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1e3


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def taking(clock, ms, calls=None, name=None):
    """A zero-argument callable that takes ``ms`` on ``clock`` (a list: the next value each call),
    noting ``name`` in ``calls``."""
    durations = iter(ms) if isinstance(ms, list) else None

    def fn():
        if calls is not None:
            calls.append(name)
        clock.advance(next(durations) if durations is not None else ms)

    return fn


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


# ----- Timing: the statistics of the samples ----------------------------------------------------

def test_median_quantile_and_spread():
    assert Timing((3.0, 1.0, 2.0)).median == 2.0
    assert Timing((4.0, 1.0, 3.0, 2.0)).median == 2.5  # an even count: the middle two's mean
    nine = Timing(tuple(float(x) for x in (9, 1, 8, 2, 7, 3, 6, 4, 5)))
    assert (nine.quantile(0.0), nine.quantile(0.25), nine.quantile(0.75), nine.quantile(1.0)) == (1.0, 3.0, 7.0, 9.0)
    assert nine.spread == pytest.approx(0.5 * (7.0 - 3.0) / 5.0)
    assert Timing((2.0,) * 7).spread == 0.0
    assert Timing((0.0, 0.0, 0.0)).spread == 0.0  # no division by a zero median


def test_per_round_pairs_the_samples_of_the_same_rounds():
    assert Timing((2.0, 6.0, 3.0)).per_round(Timing((1.0, 2.0, 3.0))) == Timing((2.0, 3.0, 1.0))
    assert Timing((2.0, 6.0)).per_round(Timing((1.0, 2.0, 3.0))) is None  # not the same rounds
    assert Timing((2.0, 6.0)).per_round(Timing((1.0, 0.0))) is None  # a zero sample cannot divide
    assert Timing(()).per_round(Timing(())) is None


def test_ratio_to_reads_the_per_round_ratios_where_they_pair_else_the_medians():
    """Paired, the median of the ratios (0.5 here), not the ratio of the medians (0.25);
    unpaired (a round fewer), the ratio of the medians."""
    this, other = Timing((1.0, 10.0, 1.0)), Timing((2.0, 5.0, 4.0))
    assert this.ratio_to(other) == pytest.approx(0.5)
    assert this.median / other.median == pytest.approx(0.25)
    assert this.ratio_to(Timing((2.0, 5.0, 4.0, 4.0))) == pytest.approx(1.0 / 4.0)
    assert this.ratio_to(Timing((4.0, 5.0, 0.0))) == pytest.approx(1.0 / 4.0)  # a zero sample: unpaired


def test_spread_against_pairs_rounds_only_when_they_match():
    drifting = timing(1.0, 0.03)
    assert drifting.spread_against(timing(0.9, 0.03)) < 1e-9
    shorter = Timing(drifting.samples[:50])
    assert shorter.spread_against(drifting) == pytest.approx(shorter.spread + drifting.spread)


def test_spread_against_needs_four_paired_rounds():
    """Three rounds pair but are too few to read a spread from: the two spreads are added."""
    three, reference = Timing((1.0, 2.0, 4.0)), Timing((1.0, 2.0, 4.0))
    assert three.per_round(reference) == Timing((1.0, 1.0, 1.0))
    assert three.spread > 0 and three.spread_against(reference) == pytest.approx(three.spread + reference.spread)
    four = Timing((1.0, 2.0, 4.0, 8.0))
    assert four.spread_against(Timing((1.0, 2.0, 4.0, 8.0))) == 0.0  # the ratios are all 1


# ----- the rounds: how many a measurement takes ----------------------------------------------

def test_measuring_stops_after_two_rounds_when_asked_and_long_rounds_take_fewer():
    """On the interpreter's timing path (the GPU's is below): ``stop`` sees two rounds' samples. And the rounds a measurement
    takes: its minimum when rounds are cheap, fewer (never under FEWEST_ROUNDS) when the
    minimum would overrun the budget LONG_ROUNDS times, and what the budget buys otherwise."""
    seen = []
    cpu = interpreter_device()
    timings = measure.measure({"a": lambda: None, "b": lambda: None}, cpu, min_rounds=30,
                            stop=lambda t: seen.append({k: len(v.samples) for k, v in t.items()}) or True)
    assert seen == [{"a": 2, "b": 2}] and all(len(t.samples) == 2 for t in timings.values())
    assert len(measure.measure({"a": lambda: None}, cpu, min_rounds=30, stop=lambda t: False)["a"].samples) == 10
    assert measure._rounds(budget_ms=45.0, min_rounds=20, per_round_ms=0.5) == 90  # the budget buys more
    assert measure._rounds(budget_ms=45.0, min_rounds=20, per_round_ms=5.0) == 20  # 100 ms: within 4 budgets
    assert measure._rounds(budget_ms=45.0, min_rounds=20, per_round_ms=15.0) == 12  # 300 ms: 180 ms buys 12
    assert measure._rounds(budget_ms=45.0, min_rounds=20, per_round_ms=60.0) == measure.FEWEST_ROUNDS
    assert measure._rounds(budget_ms=0.5, min_rounds=3, per_round_ms=60.0) == 3  # never above min_rounds


def test_rounds_are_capped_and_a_free_round_does_not_divide_by_zero():
    """Never over MAX_ROUNDS; with no budget left, min_rounds up to FEWEST_ROUNDS."""
    assert measure._rounds(budget_ms=1e6, min_rounds=10, per_round_ms=0.01) == measure.MAX_ROUNDS
    assert measure._rounds(budget_ms=50.0, min_rounds=10, per_round_ms=0.0) == measure.MAX_ROUNDS
    assert measure._rounds(budget_ms=0.0, min_rounds=7, per_round_ms=1.0) == measure.FEWEST_ROUNDS
    assert measure._rounds(budget_ms=0.0, min_rounds=3, per_round_ms=1.0) == 3


# ----- the interpreter's path: the host clock --------------------------------------------------

def test_nothing_to_measure_measures_nothing(clock):
    assert measure.measure({}, interpreter_device()) == {}
    assert measure.measure({}, GPU) == {}  # not even the GPU's flush buffer
    assert clock.now == 0.0


def test_each_sample_is_one_call_on_the_host_clock_after_a_warm_up(clock):
    """A third of min_rounds rounds (at least three), each call one sample in milliseconds; the
    warm-up call (here 100 ms: a compile) is not a sample."""
    cpu = interpreter_device()
    timings = measure.measure({"a": taking(clock, [100.0, 1.0, 1.5, 2.0]), "b": taking(clock, 3.0)}, cpu,
                              min_rounds=9)
    assert timings["a"].samples == pytest.approx((1.0, 1.5, 2.0)) and timings["a"].median == pytest.approx(1.5)
    assert timings["b"].samples == pytest.approx((3.0, 3.0, 3.0))
    assert len(measure.measure({"a": taking(clock, 1.0)}, cpu, min_rounds=1)["a"].samples) == 3


def test_rounds_interleave_every_candidate_in_an_order_shuffled_by_the_seed(clock):
    """Each round times every candidate once, in its own shuffled order, so drift hits all alike;
    the same seed gives the same orders."""
    names = ["a", "b", "c", "d"]

    def orders(seed):
        calls = []
        fns = {name: taking(clock, 1.0, calls, name) for name in names}
        measure.measure(fns, interpreter_device(), min_rounds=24, seed=seed)  # 8 rounds
        assert calls[:4] == names  # the warm-up, in the caller's order
        return [tuple(calls[i:i + 4]) for i in range(4, len(calls), 4)]

    rounds = orders(seed=0)
    assert len(rounds) == 8 and all(sorted(r) == names for r in rounds)
    assert len(set(rounds)) > 1  # shuffled each round, not one fixed order
    assert orders(seed=0) == rounds and orders(seed=1) != rounds


def test_no_garbage_collection_runs_while_measuring(clock):
    seen = []
    fns = {"a": lambda: seen.append(gc.isenabled())}
    assert gc.isenabled()
    measure.measure(fns, interpreter_device(), min_rounds=3)
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        measure.measure(fns, interpreter_device(), min_rounds=3)
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()

    def fails():
        raise RuntimeError("a launch failed")

    with pytest.raises(RuntimeError):
        measure.measure({"fails": fails}, interpreter_device())
    assert gc.isenabled()  # back on after a failure too


# ----- the GPU's path, on fake CUDA ------------------------------------------------------------

class FakeEvent:
    """A CUDA event that records the fake clock; ``elapsed_time`` in milliseconds."""

    clock: Clock
    log: list

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = self.clock.now
        self.log.append("record")

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch, clock):
    """torch.cuda's events, synchronize and the flush buffer's allocation, on the fake clock:
    zeroing the flush buffer takes 5 ms."""
    log, buffers = [], []

    class Flush:
        def zero_(self):
            log.append("flush")
            clock.advance(5.0)

    def empty(size, dtype=None, device=None):
        buffers.append((size, dtype, device))
        return Flush()

    event = type("Event", (FakeEvent,), {"clock": clock, "log": log})
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    return SimpleNamespace(log=log, buffers=buffers)


def test_each_gpu_sample_is_the_call_between_its_events_after_the_l2_flush(clock, fake_cuda):
    """A flush before every timed call, outside its events: the samples are the calls alone."""
    log = fake_cuda.log
    fns = {"a": taking(clock, 1.0, log, "a"), "b": taking(clock, 2.0, log, "b")}
    flush = torch.empty(16, dtype=torch.int32, device="cuda")
    samples = measure._cuda_round(fns, flush, rounds=3, rng=random.Random(0))
    assert samples == {"a": pytest.approx([1.0] * 3), "b": pytest.approx([2.0] * 3)}  # not the flush's 5 ms
    timed = [log[i:i + 4] for i in range(0, len(log), 4)]
    assert len(timed) == 6 and all(entry[:2] == ["flush", "record"] and entry[3] == "record" for entry in timed)
    rounds = [sorted(entry[2] for entry in timed[i:i + 2]) for i in (0, 2, 4)]
    assert rounds == [["a", "b"]] * 3  # every candidate once a round


def test_the_gpu_path_keeps_its_pricing_rounds_and_buys_the_rest_with_the_budget(monkeypatch, clock, fake_cuda):
    """Two rounds first, on the host's clock (2 ms each here): they are samples too, and the rest
    fill the budget (40 ms buys 20 rounds in all), drawn from the next seed. The flush buffer is
    twice the L2, or MIN_FLUSH_BYTES where that is more; graphs=False times the plain callables."""
    asked = []

    def fake_round(fns, flush, *, rounds, rng):
        asked.append((sorted(fns.items()), rounds, rng.random()))
        clock.advance(2.0 * rounds)
        return {name: [1.0] * rounds for name in fns}

    monkeypatch.setattr(measure, "_cuda_round", fake_round)
    monkeypatch.setattr(measure, "graphed", lambda fns: pytest.fail("graphed with graphs=False"))
    warmed = []
    fns = {"a": lambda: warmed.append("a"), "b": lambda: warmed.append("b")}
    timings = measure.measure(fns, GPU, budget_ms=40.0, min_rounds=10, seed=3, graphs=False)
    assert warmed == ["a", "b"]  # one warm-up call each before any round
    assert [(rounds, seed) for _, rounds, seed in asked] == [(2, random.Random(3).random()),
                                                             (18, random.Random(4).random())]
    assert all(dict(items) == fns for items, _, _ in asked)
    assert {name: len(t.samples) for name, t in timings.items()} == {"a": 20, "b": 20}
    assert fake_cuda.buffers == [(measure.MIN_FLUSH_BYTES // 4, torch.int32, "cuda")]  # 2 x 50 MiB is less
    big_l2 = Device("fake big L2", (9, 0), 132, 232448, 200 << 20)
    measure.measure(fns, big_l2, budget_ms=0.0, min_rounds=2, graphs=False)
    assert fake_cuda.buffers[-1] == ((400 << 20) // 4, torch.int32, "cuda")


def test_the_gpu_path_stops_after_its_pricing_rounds_and_takes_at_least_its_minimum(monkeypatch, clock, fake_cuda):
    """``stop`` sees the two pricing rounds and may end it there; with no budget a measurement
    takes min_rounds (and never fewer than the two pricing rounds); graphs=True times the graphs."""
    asked = []

    def fake_round(fns, flush, *, rounds, rng):
        asked.append((sorted(fns), rounds))
        return {name: [1.0] * rounds for name in fns}

    monkeypatch.setattr(measure, "_cuda_round", fake_round)
    monkeypatch.setattr(measure, "graphed", lambda fns: {f"graph of {name}": fn for name, fn in fns.items()})
    seen = []
    stopped = measure.measure({"a": lambda: None}, GPU, budget_ms=50.0, min_rounds=10,
                              stop=lambda t: seen.append({k: len(v.samples) for k, v in t.items()}) or True)
    assert seen == [{"graph of a": 2}] and asked == [(["graph of a"], 2)]
    assert {name: len(t.samples) for name, t in stopped.items()} == {"graph of a": 2}
    for min_rounds, expected in ((1, 2), (2, 2), (5, 5)):
        asked.clear()
        timing = measure.measure({"mm": lambda: None}, GPU, budget_ms=0.0, min_rounds=min_rounds, graphs=False)
        assert len(timing["mm"].samples) == expected
        assert [rounds for _, rounds in asked] == ([2] if expected == 2 else [2, expected - 2])


def test_session_rounds_split_the_rounds_evenly_with_the_pricing_rounds_in_the_first():
    assert measure.session_rounds(20, 1) == [20]
    assert measure.session_rounds(20, 3) == [7, 7, 6]
    assert measure.session_rounds(21, 4) == [6, 5, 5, 5]
    assert measure.session_rounds(5, 4) == [3, 2]  # a block has two rounds at least
    assert measure.session_rounds(2, 4) == [2]
    for rounds in range(2, 60):
        for sessions in range(1, 7):
            blocks = measure.session_rounds(rounds, sessions)
            assert sum(blocks) == rounds and min(blocks) >= 2 and len(blocks) <= sessions


def test_each_session_captures_its_graphs_and_flush_buffer_anew(monkeypatch, clock, fake_cuda):
    """sessions=3 over a budget of 20 rounds: the pricing rounds and 5 more on the first graphs,
    then 7 and 6 rounds each on graphs captured again, every block warmed up and given a flush
    buffer of its own, each block's order drawn from the next seed."""
    asked, captures = [], []

    def fake_round(fns, flush, *, rounds, rng):
        asked.append((sorted(fns), rounds, rng.random()))
        clock.advance(2.0 * rounds)
        return {name: [float(len(captures))] * rounds for name in fns}

    def fake_graphed(fns):
        captures.append(sorted(fns))
        return {name: (lambda name=name, n=len(captures): warmed.append((name, n))) for name in fns}

    monkeypatch.setattr(measure, "_cuda_round", fake_round)
    monkeypatch.setattr(measure, "graphed", fake_graphed)
    warmed = []
    timings = measure.measure({"a": lambda: None, "b": lambda: None}, GPU, budget_ms=40.0, min_rounds=10, seed=3,
                              sessions=3)
    assert captures == [["a", "b"]] * 3 and len(fake_cuda.buffers) == 3
    assert sorted(warmed) == [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2), ("b", 3)]
    assert [(rounds, seed) for _, rounds, seed in asked] == [
        (2, random.Random(3).random()), (5, random.Random(4).random()), (7, random.Random(5).random()),
        (6, random.Random(6).random())]
    assert timings["a"].samples == (1.0,) * 7 + (2.0,) * 7 + (3.0,) * 6  # each session's graphs timed


def test_where_capture_failed_the_later_sessions_time_plain_calls_without_trying_again(monkeypatch, clock,
                                                                                        fake_cuda):
    captures = []

    def fake_round(fns, flush, *, rounds, rng):
        clock.advance(2.0 * rounds)
        return {name: [1.0] * rounds for name in fns}

    monkeypatch.setattr(measure, "_cuda_round", fake_round)
    monkeypatch.setattr(measure, "graphed", lambda fns: captures.append(1) or dict(fns))  # as when capture fails
    timings = measure.measure({"a": lambda: None}, GPU, budget_ms=40.0, min_rounds=10, sessions=4)
    assert captures == [1] and len(timings["a"].samples) == 20


# ----- the host's cost of a call ----------------------------------------------------------------

def test_host_times_is_the_fastest_repeat_per_call_without_the_warm_up(clock):
    """Ten calls a repeat: the warm-up (50 ms) is left out and the fastest repeat taken."""
    per_call = [50.0] + [1.0] * 10 + [0.5] * 10 + [0.7] * 10
    loop, issue = measure.host_times(taking(clock, per_call), interpreter_device(), calls=10, repeats=3)
    assert loop == pytest.approx(0.5) and issue == pytest.approx(0.5)  # no GPU to wait for
    assert measure.host_loop_ms(taking(clock, 0.25), interpreter_device(), calls=4) == pytest.approx(0.25)


def test_host_times_waits_for_the_gpu_in_the_loop_but_not_in_the_issue(monkeypatch, clock):
    """Calls that queue faster than the GPU runs them: the wait at the end (the GPU's backlog of
    4 ms) is in the loop's time per call, not in the host's."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: clock.advance(4.0))
    loop, issue = measure.host_times(taking(clock, 0.1), GPU, calls=20, repeats=2)
    assert issue == pytest.approx(0.1) and loop == pytest.approx(0.1 + 4.0 / 20)
    assert measure.host_loop_ms(taking(clock, 0.1), GPU, calls=20, repeats=2) == pytest.approx(loop)


def test_host_rounds_interleave_the_calls_and_give_a_sample_per_round(monkeypatch, clock):
    """Two calls, three rounds of four calls each: the order of the rounds' loops is shuffled,
    each sample is a round's time per call, and the GPU's backlog at each loop's end is in the
    loop's time, not the host's."""
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: clock.advance(0.4))
    fns = {"a": taking(clock, 0.1, order, "a"), "b": taking(clock, 0.2, order, "b")}
    measured = measure.host_rounds(fns, GPU, rounds=3, calls=4, seed=1)
    loop, issue = measured["a"]
    assert loop.samples == pytest.approx((0.2,) * 3) and issue.samples == pytest.approx((0.1,) * 3)
    assert measured["b"][0].samples == pytest.approx((0.3,) * 3)
    loops = [order[i] for i in range(2, len(order), 4)]  # after the warm-up call of each, a name per loop
    assert [sorted(loops[i:i + 2]) for i in (0, 2, 4)] == [["a", "b"]] * 3  # both in every round


# ----- on the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_graph_timing_keeps_host_stalls_out_of_gpu_time():
    import time

    x = torch.randn(1024, 1024, device="cuda")

    def stalls():
        time.sleep(0.002)  # a host path far longer than the flush that precedes the kernel
        return x @ x

    graphed = measure.measure({"stalls": stalls, "plain": lambda: x @ x}, current(), min_rounds=10)
    plain = measure.measure({"stalls": stalls, "plain": lambda: x @ x}, current(), min_rounds=10, graphs=False)
    assert graphed["stalls"].median < 1.5 * graphed["plain"].median
    assert plain["stalls"].median > 1.0  # ms: without graphs the stall is in the sample


@pytest.mark.gpu
def test_the_rounds_that_size_a_measurement_are_samples_and_the_budget_is_wall_time():
    """The two rounds that price a round are kept as samples, and ``stop`` may end it there;
    with no budget left a measurement takes its minimum rounds, and a budget buys rounds at
    what a round costs on the host's clock (a 1 ms kernel plus its flush: a 20 ms budget buys
    fewer than 20 rounds)."""
    x = torch.randn(256, 256, device="cuda")
    for min_rounds, expected in ((1, 2), (2, 2), (5, 5)):
        timing = measure.measure({"mm": lambda: x @ x}, current(), budget_ms=0.0, min_rounds=min_rounds)["mm"]
        assert len(timing.samples) == expected
    stopped = measure.measure({"mm": lambda: x @ x}, current(), budget_ms=50.0, min_rounds=10, stop=lambda t: True)
    assert len(stopped["mm"].samples) == 2  # a stop after the two pricing rounds ends it there
    big = torch.randn(4096, 4096, device="cuda")
    rounds = len(measure.measure({"mm": lambda: big @ big}, current(), budget_ms=20.0, min_rounds=2)["mm"].samples)
    per_call = measure.measure({"mm": lambda: big @ big}, current(), budget_ms=0.0, min_rounds=3)["mm"].median
    assert 2 <= rounds <= max(2, int(20.0 / per_call))


@pytest.mark.gpu
def test_a_candidate_that_syncs_falls_back_to_plain_timing(caplog):
    x = torch.randn(256, 256, device="cuda")
    timings = measure.measure({"syncs": lambda: (x @ x).sum().item(), "plain": lambda: x @ x}, current(),
                            min_rounds=5)
    assert set(timings) == {"syncs", "plain"} and "cannot be captured" in caplog.text
    assert torch.randn(4, device="cuda").isfinite().all()  # the random generator is left usable


@pytest.mark.gpu
def test_after_a_failed_capture_the_random_generator_still_works():
    from gemmtune.tuning.measure import _reset_rng_capture_state

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError):
        with torch.cuda.graph(graph):
            torch.randn(8, device="cuda").sum().item()  # a sync invalidates the capture
    torch.cuda.synchronize()
    _reset_rng_capture_state()
    first = torch.randn(1000, device="cuda")
    assert first.isfinite().all() and not torch.equal(first, torch.randn(1000, device="cuda"))


@pytest.mark.gpu
def test_a_graphed_call_returns_its_output_for_the_current_inputs():
    x = torch.randn(64, 64, device="cuda")
    replay = measure.graphed({"square": lambda: x @ x})["square"]
    x.copy_(torch.randn(64, 64, device="cuda"))  # the graph reads x's memory at replay
    torch.testing.assert_close(replay(), x @ x)


# ----- loops: a model's forward as a user's loop runs it -----------------------------------------

def test_a_loop_sample_is_the_time_per_call_of_calls_queued_back_to_back(clock):
    """Calls per loop fill ``loop_ms`` for the slower side; rounds as many as the budget allows,
    at most ``rounds``; each side's ``enter`` runs before each of its loops, untimed."""
    calls, entered = [], []
    fns = {"a": taking(clock, 2.0, calls, "a"), "b": taking(clock, 4.0, calls, "b")}
    enter = {"a": lambda: entered.append("a") or clock.advance(1000.0), "b": lambda: entered.append("b")}
    timings = measure.loops(fns, interpreter_device(), budget_ms=10_000.0, rounds=5, loop_ms=20.0, enter=enter)
    assert timings["a"].samples == pytest.approx((2.0,) * 5) and timings["b"].samples == pytest.approx((4.0,) * 5)
    assert calls.count("a") == 2 + 5 * 5 and calls.count("b") == 2 + 5 * 5  # two to size the loop, 5 per loop
    assert entered.count("a") == 1 + 5 and entered.count("b") == 1 + 5
    assert timings["a"].ratio_to(timings["b"]) == pytest.approx(0.5)


def test_loops_take_at_least_three_rounds_and_fewer_where_the_budget_is_short(clock):
    fns = {"a": taking(clock, 50.0), "b": taking(clock, 50.0)}
    assert len(measure.loops(fns, interpreter_device(), budget_ms=1.0, rounds=9)["a"].samples) == 3
    assert len(measure.loops(fns, interpreter_device(), budget_ms=550.0, rounds=9)["a"].samples) == 5
