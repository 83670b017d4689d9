"""Timing: the one place that decides how candidates are measured.

On a GPU every call is timed by its own CUDA event pair, after a write of a buffer twice the
L2's size: without that flush a decode GEMM's weights stay in L2 between calls and the kernel
reads 2-3x faster than it will inside a model. Candidates are measured in interleaved rounds
(each round times every candidate once, in a shuffled order) so clock and thermal drift hit
all of them alike. Raw samples are kept; selection reads their median and spread.

Each candidate is captured into a CUDA graph and the graph is replayed between the events:
otherwise any host stall between the start event and the kernel's launch (a slow Python path,
the vCPU descheduled) lands in the sample, and did, by up to 3x on 10 µs GEMMs. What the host
path costs is measured apart, by ``host_loop_ms``. A candidate that cannot be captured (a host
sync inside) sends the whole comparison back to plain launches, so all sides stay alike.

A measurement may be taken in ``sessions``: its rounds split into blocks, each candidate captured
anew (and the flush buffer allocated anew) for each. A captured graph of a short kernel keeps an
offset of its own for as long as it is replayed: two measurements of the same candidates on the
same buffers, one after the other, read a 7-100 µs kernel's ratio to cuBLAS a median 0.8% apart,
twice what their rounds' spread leads one to expect (docs/tuning-time.md, "What moves a
reading"). In sessions those offsets are averaged over, and the rounds' spread shows them.
"""

from __future__ import annotations

import gc
import logging
import random
import time
import warnings
from collections.abc import Callable, Mapping

from gemmtune.device import Device
from gemmtune.results import Timing

log = logging.getLogger("gemmtune.tuning.measure")

MIN_ROUNDS = 10
MAX_ROUNDS = 200
FEWEST_ROUNDS = 5
LONG_ROUNDS = 4  # min_rounds may overrun the budget this many times before long rounds take fewer
# At least twice the L2, and no less than triton's do_bench (256 MiB): zeroing it also keeps the
# GPU busy for tens of microseconds, so the host's launch path of the next call is hidden and
# the events time the kernel alone. Host cost is judged separately (host_loop_ms).
MIN_FLUSH_BYTES = 256 << 20


def measure(fns: Mapping[str, Callable[[], object]], device: Device, *, budget_ms: float = 400.0,
            min_rounds: int = MIN_ROUNDS, seed: int = 0, graphs: bool = True,
            stop: Callable[[dict[str, Timing]], bool] | None = None, sessions: int = 1) -> dict[str, Timing]:
    """Time each zero-argument callable; returns their samples in milliseconds. ``budget_ms``
    of wall time, at least ``min_rounds`` rounds, except that rounds too long to take that
    many within LONG_ROUNDS budgets take fewer (at least FEWEST_ROUNDS, or min_rounds if fewer):
    samples of a millisecond-long kernel vary by a fraction of a percent, and on a small GPU
    twenty of them cost seconds. ``stop(timings)``, if given, sees the first two rounds and
    ends the measurement there when it answers True (a candidate that cannot win).

    ``graphs`` replays each callable from a CUDA graph (GPU time alone); False times plain calls.
    ``sessions``: the rounds split into that many blocks (of two rounds at least), the graphs
    captured anew for each (see the module's docstring).
    """
    if not fns:
        return {}
    # A garbage collection inside a timed call stalls the host after the start event is queued,
    # so the GPU idles and the sample grows by the pause: none runs while measuring. (Collecting
    # first is not needed for that, and costs 50-100 ms with torch loaded: more than a warm
    # screening of a candidate.)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if device.interpreter:
            return _measure_cpu(fns, rounds=max(3, min_rounds // 3), seed=seed, stop=stop)
        return _measure_cuda(fns, device, budget_ms=budget_ms, min_rounds=min_rounds, seed=seed, stop=stop,
                             graphs=graphs, sessions=sessions)
    finally:
        if was_enabled:
            gc.enable()


def _measure_cuda(fns, device, *, budget_ms, min_rounds, seed, stop, graphs, sessions) -> dict[str, Timing]:
    """Two rounds first, timed on the host's clock: what a round really costs (the flush
    included, which takes longer on fewer SMs), so the rest fills ``budget_ms`` of wall time
    at any SM count. Those two rounds are samples too, the first session's first."""
    import torch

    runners, flush = _session(fns, device, graphs)
    graphs = graphs and not any(runners.get(name) is fn for name, fn in fns.items())  # False: capture failed
    started = time.perf_counter()
    samples = _cuda_round(runners, flush, rounds=2, rng=random.Random(seed))
    per_round_ms = (time.perf_counter() - started) * 1e3 / 2
    if stop is not None and stop(_timings(samples)):
        return _timings(samples)
    rounds = _rounds(budget_ms, min_rounds, per_round_ms)
    for index, count in enumerate(session_rounds(rounds, sessions)):
        if index:
            del runners, flush  # the last session's graphs and buffer go before the next are made
            torch.cuda.synchronize()
            runners, flush = _session(fns, device, graphs)
        count -= 2 if index == 0 else 0
        if count > 0:
            more = _cuda_round(runners, flush, rounds=count, rng=random.Random(seed + 1 + index))
            samples = {name: samples[name] + more[name] for name in samples}
    return _timings(samples)


def session_rounds(rounds: int, sessions: int) -> list[int]:
    """``rounds`` split into at most ``sessions`` blocks as even as can be, the larger first, each
    of two rounds at least (the first holds the two that measure a round's cost)."""
    count = max(1, min(sessions, rounds // 2))
    return [rounds // count + (1 if index < rounds % count else 0) for index in range(count)]


def _session(fns, device, graphs: bool):
    """The callables to time (each captured in a CUDA graph where ``graphs``), warmed up, and a
    flush buffer: what one session of a measurement times with."""
    import torch

    runners = graphed(fns) if graphs else dict(fns)
    flush = torch.empty(max(2 * device.l2_bytes, MIN_FLUSH_BYTES) // 4, dtype=torch.int32, device="cuda")
    for fn in runners.values():  # warm-up: compiles, loads modules, creates handles
        fn()
    torch.cuda.synchronize()
    return runners, flush


def _rounds(budget_ms: float, min_rounds: int, per_round_ms: float) -> int:
    """How many rounds a measurement takes in all (see ``measure``)."""
    per_round_ms = max(per_round_ms, 1e-3)
    floor = min_rounds
    if min_rounds * per_round_ms > LONG_ROUNDS * budget_ms:
        floor = max(min(min_rounds, FEWEST_ROUNDS), int(LONG_ROUNDS * budget_ms / per_round_ms))
    return int(min(MAX_ROUNDS, max(floor, budget_ms / per_round_ms)))


def _timings(samples: dict[str, list[float]]) -> dict[str, Timing]:
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def replay_ms(fns: list[Callable[[], object]], *, repeats: int = 3) -> float | None:
    """The GPU time per call of ``fns`` called one after another, as a model's kernels run: all
    captured in one CUDA graph, with no flush between them (what one wrote, the next reads from
    L2); the fastest of ``repeats`` replays, timed between CUDA events. None where they cannot
    be captured."""
    import torch

    replays = captured({"calls": lambda: [fn() for fn in fns]})
    if replays is None:
        return None
    replay = replays["calls"]
    replay()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best / len(fns)


def graphed(fns: Mapping[str, Callable[[], object]]) -> dict[str, Callable[[], object]]:
    """Each callable captured into its own CUDA graph; calling one replays it and returns what
    the captured call returned. The graphs share one memory pool, so an output stays valid only
    until another of them replays. The plain callables if any cannot be captured."""
    replays, why = _capture(fns)
    if replays is None:
        log.warning("%s cannot be captured in a CUDA graph (%s); timing plain calls", *why)
        return dict(fns)
    return replays


def captured(fns: Mapping[str, Callable[[], object]]) -> dict[str, Callable[[], object]] | None:
    """``graphed``'s replays, or None (and no warning) if any callable cannot be captured."""
    return _capture(fns)[0]


def _capture(fns) -> tuple[dict | None, tuple[str, str] | None]:
    """The replays, or None and (the name that cannot be captured, why)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capturing stream, as capture requires
        syncing = _syncing(fns)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if syncing:
        # Probed first: a capture that a host sync invalidates fails inside torch's capture_end
        # and leaves the CUDA random generator mid-capture, breaking every later torch.randn.
        return None, (syncing, "it synchronizes with the host")
    pool = torch.cuda.graph_pool_handle()
    replays = {}
    for name, fn in fns.items():
        graph = torch.cuda.CUDAGraph()
        try:
            # On the side stream, of the current GPU: torch's default capture stream is made once
            # per process, on the GPU current then, and capturing on it makes that GPU current, so
            # a second GPU's kernels were captured off their device (a cuBLASLt launch then ran on
            # GPU 1's stream with GPU 0 current, failed, and left an illegal memory access:
            # tests/test_two_gpus.py).
            with torch.cuda.graph(graph, pool=pool, stream=side):
                out = fn()
        except RuntimeError as exc:
            torch.cuda.synchronize()
            _reset_rng_capture_state()
            return None, (name, str(exc))
        replays[name] = _replayer(graph, out)
    return replays, None


def _replayer(graph, out) -> Callable[[], object]:
    def replay() -> object:
        graph.replay()
        return out

    return replay


def _syncing(fns: Mapping[str, Callable[[], object]]) -> str | None:
    """Runs each callable once (its warm-up) with torch's sync debug mode set to error; the name
    of the first that synchronizes with the host, or None."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # torch's note that the mode is a prototype is not the user's
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode("error")
    try:
        for name, fn in fns.items():
            try:
                fn()
            except RuntimeError as exc:
                if "synchroniz" not in str(exc):
                    raise
                return name
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def _reset_rng_capture_state() -> None:
    """After a failed capture, gives each CUDA default generator a fresh state with the same seed
    and offset: the failed capture_end never closed the old state's capture bookkeeping."""
    import torch

    for generator in torch.cuda.default_generators:
        fresh = torch.Generator(device=generator.device)
        fresh.manual_seed(generator.initial_seed())
        fresh.set_offset(generator.get_offset())
        generator.graphsafe_set_state(fresh.graphsafe_get_state())


def _cuda_round(fns, flush, *, rounds: int, rng: random.Random) -> dict[str, list[float]]:
    import torch

    names = list(fns)
    events = {name: [] for name in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            flush.zero_()
            start.record()
            fns[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: [s.elapsed_time(e) for s, e in pairs] for name, pairs in events.items()}


def _measure_cpu(fns, *, rounds: int, seed: int, stop) -> dict[str, Timing]:
    rng = random.Random(seed)
    names = list(fns)
    for fn in fns.values():
        fn()
    samples = {name: [] for name in names}
    for done in range(rounds):
        if done == 2 and stop is not None and stop(_timings(samples)):
            break
        rng.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return _timings(samples)


def host_loop_ms(fn: Callable[[], object], device: Device, *, calls: int = 100, repeats: int = 3) -> float:
    """Wall time per call of back-to-back calls: what a user's loop pays, host overhead included.

    For a GEMM of a few microseconds the launch path, not the kernel, sets this figure, which
    is why selection looks at it beside the event-timed kernel.
    """
    return host_times(fn, device, calls=calls, repeats=repeats)[0]


def host_times(fn: Callable[[], object], device: Device, *, calls: int = 100,
               repeats: int = 3) -> tuple[float, float]:
    """``host_loop_ms``, and the host's own time per call: the same loop timed up to its last
    launch, before waiting for the GPU. A kernel that keeps the GPU busy longer than its launch
    takes hides its launch path in the first figure; in a model whose other operators keep the
    host busy, as in eager decoding, the second is what the call adds. The fastest of
    ``repeats`` loops: other processes only ever add time."""
    loop, issue = host_rounds({"call": fn}, device, rounds=repeats, calls=calls)["call"]
    return min(loop.samples), min(issue.samples)


def host_rounds(fns: Mapping[str, Callable[[], object]], device: Device, *, rounds: int = 11, calls: int = 50,
                seed: int = 0) -> dict[str, tuple[Timing, Timing]]:
    """``host_times`` of several calls in the same interleaved rounds, for comparing them: per
    name, the loop's time per call and the host's own, one sample a round, each round's order
    shuffled. Timed one after another, two loops of the same call read up to several percent
    apart (the host's clocks, other processes); the per-round ratios of these cancel that."""
    sync = _synchronizer(device)
    names = list(fns)
    for name in names:  # warm: a first call may load or build something
        fns[name]()
    sync()
    loops: dict[str, list[float]] = {name: [] for name in names}
    issues: dict[str, list[float]] = {name: [] for name in names}
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            issued = time.perf_counter()
            sync()
            loops[name].append((time.perf_counter() - t0) * 1e3 / calls)
            issues[name].append((issued - t0) * 1e3 / calls)
    return {name: (Timing(tuple(loops[name])), Timing(tuple(issues[name]))) for name in fns}


def beats(ways: Mapping[str, Callable[[], object]], candidate: str, device: Device, *,
          budget_ms: float = 20.0, rounds: int = 5, calls: int = 10) -> bool:
    """Whether the way named ``candidate`` of two ``ways`` costs less per call than the other
    beyond the noise of either figure, a call's cost being the longer of its GPU time
    (``measure``, ``budget_ms`` of it, plain calls) and its host's own time (``host_rounds`` of
    ``rounds`` loops of ``calls``): a call queued behind others waits for both. How a layer
    chooses its way at its first call of a row count (``gemmtune.nn.padded``,
    ``gemmtune.nn.residual``)."""
    (baseline,) = set(ways) - {candidate}
    gpu = measure(ways, device, budget_ms=budget_ms, graphs=False)
    host = host_rounds(ways, device, rounds=rounds, calls=calls)
    cost = {way: max(gpu[way].median, host[way][1].median) for way in ways}
    noise = max(gpu[candidate].spread_against(gpu[baseline]), host[candidate][1].spread_against(host[baseline][1]))
    return cost[candidate] < cost[baseline] * (1.0 - noise)


def _synchronizer(device: Device) -> Callable[[], None]:
    if device.interpreter:
        return lambda: None
    import torch

    return torch.cuda.synchronize


def loops(fns: Mapping[str, Callable[[], object]], device: Device, *, budget_ms: float = 2000.0,
          rounds: int = 9, loop_ms: float = 20.0,
          enter: Mapping[str, Callable[[], None]] | None = None) -> dict[str, Timing]:
    """Each zero-argument callable (a model's forward, say) timed as a user's loop runs it: calls
    queued back to back with no sync between them, after the GPU went idle, so host time that the
    GPU waits for lands in the sample (a model whose host work exceeds its GPU work shows every
    microsecond a call adds), and no L2 flush. One sample per round, in milliseconds per call, of
    enough calls to fill about ``loop_ms``; rounds interleaved in shuffled order, as many as
    ``budget_ms`` allows, at least three, at most ``rounds``. ``enter[name]``, where given, runs
    before each loop of ``name``, untimed (puts the model in that side's form)."""
    enter = enter or {}
    names = list(fns)
    sync = _synchronizer(device)
    clock = time.perf_counter
    per_call = {}
    for name in names:  # warm-up, then one timed call each: how many calls fill a loop
        enter.get(name, lambda: None)()
        fns[name]()
        sync()
        t0 = clock()
        fns[name]()
        sync()
        per_call[name] = max(clock() - t0, 1e-6) * 1e3
    calls = max(1, min(100, round(loop_ms / max(per_call.values()))))
    round_ms = calls * sum(per_call.values())
    rounds = max(3, min(rounds, int(budget_ms / max(round_ms, 1e-3))))
    timer = _loop_timer(device)
    rng = random.Random(0)
    samples: dict[str, list[float]] = {name: [] for name in names}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            rng.shuffle(names)
            for name in names:
                enter.get(name, lambda: None)()
                samples[name].append(timer(fns[name], calls) / calls)
    finally:
        if was_enabled:
            gc.enable()
    return _timings(samples)


def _loop_timer(device: Device) -> Callable[[Callable[[], object], int], float]:
    """A function timing ``calls`` queued calls of a callable, in milliseconds: between CUDA
    events recorded after the GPU went idle, else on the host's clock."""
    if device.interpreter:
        def on_host(fn, calls: int) -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - t0) * 1e3
        return on_host
    import torch

    def on_gpu(fn, calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    return on_gpu
