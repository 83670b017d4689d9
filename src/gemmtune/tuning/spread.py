"""Many problems tuned over every GPU of a host (``gemmtune tune --gpus``): one thread per GPU in
this process, each running its candidates in a process of its own on its GPU (a
``worker.IsolatedRunner``), all writing into one store (the SQLite file, which several
connections share safely, or a server's), the problems handed out a group at a time as GPUs come
free, the costliest groups first.

A group is the problems that differ in their epilogue alone (a lead and its followers, which
inherit the lead's best candidates: ``tuner.tune_many``), so a group never straddles two GPUs.
The tuner's own work (planning, choosing, storing) is light and stays in this process; the
candidates' processes are where anything can crash. A candidate that crashes or hangs is a
failed trial, as in one-GPU tuning; a group whose tuning fails outright (its candidates' process
dies while it starts a problem, say) costs only that group: what of it was finished is in the
store already, the rest is handed to the next free GPU. A group that fails ``ATTEMPTS`` times is
given up, and said so. Without a GPU the candidates run Triton's interpreter on the CPU.

Before, each GPU had a worker process that ran the tuner and started the candidates' process:
two processes to start per GPU, each importing torch and making a CUDA context (3.4-3.9 s on
these hosts): on one GPU the scheduler cost 8.2% over plain tuning, 2 H100s were 1.62x as fast
as one. Now +1.1% and 1.89x (docs/tuning-time.md).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gemmtune.problem import Problem
from gemmtune.results import TuneResult
from gemmtune.tuning.tuner import TuneOptions, tune_many

log = logging.getLogger("gemmtune")

ATTEMPTS = 2  # times a group may fail before it is given up


@dataclass
class Spread:
    """What a spread tuning found: a result per problem tuned, and the problems given up."""

    results: dict[str, TuneResult] = field(default_factory=dict)
    given_up: list[Problem] = field(default_factory=list)
    restarts: int = 0


def groups(problems: Sequence[Problem]) -> list[list[Problem]]:
    """The problems in groups that share all but their epilogue, in the order first seen."""
    by_shape: dict[Problem, list[Problem]] = {}
    for problem in problems:
        by_shape.setdefault(problem.without_epilogue(), []).append(problem)
    return list(by_shape.values())


def costliest_first(batch: list[list[Problem]]) -> list[list[Problem]]:
    """Groups in the order they are handed out: by their multiply-adds, most first (ties in the
    order given), so that the group a GPU is left finishing alone at the end is a short one."""
    return sorted(batch, key=lambda group: -sum(p.m * p.n * p.k for p in group))


def tune(problems: Sequence[Problem], gpus: Sequence[int | None], *, location: str | None = None,
         options: TuneOptions = TuneOptions(), retune: bool = False, runner_factory: Callable | None = None,
         on_result: Callable[[TuneResult], None] | None = None) -> Spread:
    """Tune ``problems`` on each of ``gpus`` (a CUDA device index, or None for the CPU
    interpreter) into the store at ``location`` (``open_store``'s). ``runner_factory`` (tests:
    importable by name) replaces the ``runner.LocalRunner`` in each GPU's candidates' process."""
    if not gpus:
        raise ValueError("tune(gpus=...): expected at least one device")
    spread = Spread()
    waiting = deque(costliest_first(groups(problems)))
    failures: dict[str, int] = {}
    done: queue.Queue = queue.Queue()
    lanes = [_Lane(gpu, location, options, retune, runner_factory, done) for gpu in gpus]
    try:
        while waiting or not all(lane.idle for lane in lanes):
            for lane in lanes:
                if lane.idle and waiting:
                    lane.hand(waiting.popleft())
            lane, group, results, why = done.get()
            lane.idle = True
            if results is None:
                spread.restarts += 1
                retry_or_give_up(group, failures, waiting, spread, why)
                continue
            for result in results:
                spread.results[result.problem_key] = result
                if on_result is not None:
                    on_result(result)
    finally:
        for lane in lanes:
            lane.stop()
    return spread


def retry_or_give_up(group: list[Problem], failures: dict[str, int], waiting: deque, spread: Spread,
                      why: str) -> None:
    """``group`` back in ``waiting`` for the next free GPU, or given up where it has failed
    ATTEMPTS times (said, with ``why``, the last failure)."""
    key = group[0].without_epilogue().key()
    failures[key] = failures.get(key, 0) + 1
    if failures[key] < ATTEMPTS:
        log.warning("gemmtune: tuning %s failed (%s); it is tuned again on the next free GPU", group[0].describe(), why)
        waiting.append(group)
        return
    log.warning("gemmtune: tuning %s failed %d times (the last: %s); it is given up", group[0].describe(),
                failures[key], why)
    spread.given_up.extend(group)


class _Lane:
    """One GPU: a thread that tunes the groups it is handed with the candidates in a process of
    their own, telling ``done`` of each (results, or None and why)."""

    def __init__(self, gpu: int | None, location: str | None, options: TuneOptions, retune: bool,
                 runner_factory: Callable | None, done: queue.Queue) -> None:
        self.gpu, self.idle = gpu, True
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(location, options, retune, runner_factory, done),
                                        name=f"gemmtune-gpu-{gpu}", daemon=True)
        self._thread.start()

    def hand(self, group: list[Problem]) -> None:
        self.idle = False
        self._inbox.put(group)

    def stop(self) -> None:
        """Ends the thread once it is idle; one still tuning (tuning was interrupted) is left to
        end with this process, its candidates' process with it."""
        self._inbox.put(None)
        if self.idle:
            self._thread.join()

    def _run(self, location, options, retune, runner_factory, done: queue.Queue) -> None:
        with contextlib.ExitStack() as stack:
            try:
                device, store, runner = self._start(stack, location, runner_factory)
            except Exception as error:  # noqa: BLE001 - said of every group handed here
                why = f"its GPU's tuning could not start: {type(error).__name__}: {error}"[:300]
                while (group := self._inbox.get()) is not None:
                    done.put((self, group, None, why))
                return
            while (group := self._inbox.get()) is not None:
                try:
                    results = tune_many(group, device, store, options, retune=retune, runner=runner)
                except Exception as error:  # noqa: BLE001 - the group goes to the next free GPU
                    done.put((self, group, None, f"{type(error).__name__}: {error}"[:300]))
                    continue
                done.put((self, group, results, ""))

    def _start(self, stack: contextlib.ExitStack, location: str | None, runner_factory: Callable | None):
        """This GPU's device, a connection to the store and the candidates' runner (closed by ``stack``)."""
        from gemmtune.device import current
        from gemmtune.store import open_store
        from gemmtune.tuning.worker import IsolatedRunner

        device = current(self.gpu)
        index = self.gpu if self.gpu is not None else 0  # None: the interpreter, where no index counts
        store = stack.enter_context(open_store(location))
        runner = stack.enter_context(IsolatedRunner(device, device_index=index, runner_factory=runner_factory))
        return device, store, runner
