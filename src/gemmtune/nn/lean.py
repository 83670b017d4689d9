"""Lean kernels: where the host paces a model's eager run, its GEMMs' eager calls may run the Triton
kernels whose bound launches cost the host less than ``F.linear``'s call, though they take up to
``tuner.LEAN_CEILING`` times cuBLAS's time on the GPU (``tuner.lean_choice``). ``optimize`` tries
them where the GPU has room for that extra time, and keeps them where the run measures faster
with them (``tried``); a layer whose GEMM runs one then counts as served (``keep.served``).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from gemmtune.device import current
from gemmtune.nn import keep
from gemmtune.problem import Problem
from gemmtune.results import Trial, TuneResult
from gemmtune.serving.dispatch import DISPATCHER

# the share of a forward's wall time its host takes to queue it, from which the host paces it
# (BERT-base at 32 x 128 on an H200: 4.4 ms of host work for 1.9 of GPU work, docs/models.md)
HOST_BOUND = 0.9
# of the room a host-paced run leaves the GPU (its host's time less its GPU's), the share that lean
# kernels' extra GPU time may take: the rest is margin for the two readings' noise
ROOM_SHARE = 0.5


class Pace(NamedTuple):
    """How the host paces one call of a run started on an idle GPU: ``share``, the share of the
    call's wall time that queuing it takes the host; ``host_ms``, that time."""

    share: float
    host_ms: float


def host_pace(run: Callable[[], object], forms: list[keep.Form]) -> Pace:
    """``Pace`` of one call, with every layer in its torch form (the medians of three calls; a run
    that reads a result on the host mid-way counts as queuing it all). From HOST_BOUND on, the host
    paces the run. The layers are left in gemmtune's form."""
    shares, queued, index = [], [], keep.device_index(forms)
    try:
        for form in forms:
            form.to_torch()
        for _ in range(3):
            torch.cuda.synchronize(index)
            started = time.perf_counter()
            run()
            done = time.perf_counter()
            torch.cuda.synchronize(index)
            shares.append((done - started) / max(time.perf_counter() - started, 1e-9))
            queued.append((done - started) * 1e3)
    finally:
        for form in forms:
            form.to_gemmtune()
    return Pace(statistics.median(shares), statistics.median(queued))


def gpu_ms(run: Callable[[], object], forms: list[keep.Form], host_ms: float) -> float | None:
    """The GPU's time for one call of the run, the layers in the form they are in: the call queued
    behind a sleep kernel that outlasts the host's queuing of it (``host_ms``), so that the GPU runs
    its kernels back to back, timed by events around them (the median of three). Where the run
    waits for the GPU mid-way, the host's time after the wait counts too, and the room a host-paced
    run leaves the GPU reads smaller than it is. None where torch has no sleep kernel (a private
    function of ``torch.cuda``): the room is then not known."""
    if not hasattr(torch.cuda, "_sleep"):
        return None
    index = keep.device_index(forms)
    times = []
    with torch.cuda.device(index):
        cycles = int(_cycles_per_ms(index) * (2.0 * host_ms + 1.0))
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


@functools.cache
def _cycles_per_ms(index: int) -> float:
    """The clock cycles per millisecond of torch's sleep kernel on GPU ``index``, timed once."""
    cycles = 10_000_000
    with torch.cuda.device(index):
        torch.cuda._sleep(cycles // 100)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(start.elapsed_time(end), 1e-3)


def lean_picks(layer_problems: dict, results: dict[str, TuneResult]) -> dict[Problem, Trial]:
    """Per GEMM the layers performed (``layer_problems``: each layer's ``Problem.key()`` values)
    and tuned (``results``), the kernel its eager calls could run in a model paced by its host
    (``Dispatcher.lean_pick``: a Triton finalist nearly as fast as cuBLAS, whose launch costs the
    host less), where there is one."""
    device, picks = current(), {}
    for key in set().union(*layer_problems.values()) & results.keys():
        problem = Problem.from_key(key)
        pick = DISPATCHER.lean_pick(problem, device, results[key].label())
        if pick is not None:
            picks[problem] = pick
    return picks


class Lean(NamedTuple):
    """The kernels ``lean_picks`` found, serving their GEMMs' eager calls (``Dispatcher.serve_lean``)
    because the run measured faster with them: ``eager``, that speedup."""

    picks: dict[Problem, Trial]
    index: int
    eager: keep.Speedup

    def drop(self) -> None:
        """Eager calls of those GEMMs run their choice's kernel again."""
        DISPATCHER.drop_lean(list(self.picks), self.index)

    def keys(self) -> set[str]:
        """The ``Problem.key()`` values of the GEMMs whose eager calls these kernels serve."""
        return {problem.key() for problem in self.picks}

    def __str__(self) -> str:
        gemms = f"{len(self.picks)} GEMM" + ("s" if len(self.picks) > 1 else "")
        return f"the eager calls of {gemms} on Triton kernels, whose launches cost the host less"


def tried(run: Callable[[], object], forms: list[keep.Form], layer_problems: dict, results: dict[str, TuneResult],
          calls: Mapping[str, int]) -> tuple[Lean | None, str]:
    """Where the run is paced by its host (``host_pace``) and some of its GEMMs have a kernel
    whose launch costs the host less (``lean_picks``) and whose extra GPU time the run's room on the
    GPU takes (``affordable``; ``calls``: each GEMM's calls in a run, by ``Problem.key()``): those
    kernels serve the GEMMs' eager calls, and the run with every layer in gemmtune's form is timed
    against torch's form (``speedup``). They stay where it measures faster beyond its noise (a
    ``Lean``), else they go (None); with what happened in words, for optimize's log line (empty
    where the host does not pace the run). A Triton kernel's bound launch costs the host less than
    ``F.linear``'s call: BERT-base's eager forward ran 1.15-1.19x as fast with them on an H200,
    where gemmtune's choices (cuBLASLt's, faster on the GPU) ran it 0.88-0.94x
    (host-lean-h200-20261129.json)."""
    if not forms or not keep.on_a_gpu(forms):
        return None, ""
    pace = host_pace(run, forms)
    if pace.share < HOST_BOUND:
        return None, ""
    paced = f"the host paces the eager run ({pace.share:.2f} of its wall time)"
    picks = lean_picks(layer_problems, results)
    if not picks:
        return None, f"{paced}, and no GEMM has a Triton finalist nearly as fast as cuBLAS to serve its eager calls"
    gpu = gpu_ms(run, forms, pace.host_ms)
    if gpu is not None:  # else every pick is tried, and the timing below decides alone
        paced = (f"the host paces the eager run ({pace.share:.2f} of its wall time; {pace.host_ms:.2f} ms of host "
                 f"work for {gpu:.2f} ms of GPU work)")
        picks = affordable(picks, extra_ms(picks, results), calls, pace.host_ms - gpu)
        if not picks:
            return None, f"{paced}, too little room on the GPU for kernels slower there that launch faster"
    index = keep.device_index(forms)
    DISPATCHER.serve_lean(picks, index)
    found = Lean(picks, index, keep.speedup(run, forms))
    if found.eager.pays():
        return found, f"{paced}: {found}"
    found.drop()
    return None, f"{paced}: {found} read {found.eager}, so they go"


def affordable(picks: dict[Problem, Trial], extra: Mapping[Problem, float], calls: Mapping[str, int],
               room_ms: float) -> dict[Problem, Trial]:
    """Of ``picks``, those whose kernels' extra GPU time over their choices' kernels (``extra``, ms a
    call, times the GEMM's ``calls`` in a run; one where not given) fits in ROOM_SHARE of
    ``room_ms``, the host's time to queue the run less the GPU's time for it, the least extra a call
    first. Past that room the GPU would pace the run, and what the faster launches save the host
    would be lost on the GPU: ViT-style models whose GPU work nearly matches their host's read
    0.64-0.96x with lean kernels (models-h200-unseen-20261129.json)."""
    budget, chosen = ROOM_SHARE * room_ms, {}
    for problem in sorted(picks, key=lambda p: extra[p]):
        cost = max(extra[problem], 0.0) * calls.get(problem.key(), 1)
        if cost <= budget:
            chosen[problem] = picks[problem]
            budget -= cost
    return chosen


def extra_ms(picks: dict[Problem, Trial], results: dict[str, TuneResult]) -> dict[Problem, float]:
    """Per picked GEMM, how much longer its lean kernel takes than its choice's kernel (ms a call),
    from the final rounds of its stored tuning, where both were timed side by side; the pick's whole
    time where the choice's is not on record there (``keep.final_pair``)."""
    extra = {}
    for problem, pick in picks.items():
        pair = keep.final_pair(problem, results[problem.key()].label())
        extra[problem] = pick.timing.median - (pair[1].timing.median if pair is not None else 0.0)
    return extra
