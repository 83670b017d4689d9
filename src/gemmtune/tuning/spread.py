"""Many problems tuned over every GPU of a host (``gemmtune tune --gpus``): one worker process per
GPU, all writing into one store (the SQLite file, which several processes share safely, or a
server's), the problems handed out a group at a time as workers come free.

A group is the problems that differ in their epilogue alone (a lead and its followers, which
inherit the lead's best candidates: ``tuner.tune_many``), so a group never straddles two workers.
A worker that dies (a crash the candidates' own isolation did not contain, an out-of-memory, a
kill) costs only the group it was tuning: what of it was finished is in the store already, the
rest is handed to the next free worker, and the dead worker is replaced. A group that kills
``ATTEMPTS`` workers is given up, and said so. Without a GPU the workers run Triton's
interpreter on the CPU, as a single process would.

Parent and workers speak JSON (problem keys out, results back) over pipes; a worker's options
travel once, when it starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from gemmtune.problem import Problem
from gemmtune.results import Trial, TuneResult
from gemmtune.tuning.processes import main_hidden
from gemmtune.tuning.tuner import TuneOptions, tune_many

log = logging.getLogger("gemmtune")

ATTEMPTS = 2  # workers a group may take down before it is given up


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


def tune(problems: Sequence[Problem], gpus: Sequence[int | None], *, location: str | None = None,
         options: TuneOptions = TuneOptions(), retune: bool = False, isolate: bool = True,
         runner_factory: Callable | None = None, on_result: Callable[[TuneResult], None] | None = None) -> Spread:
    """Tune ``problems`` with one worker per entry of ``gpus`` (a CUDA device index, or None for
    the CPU interpreter), into the store at ``location`` (``open_store``'s). ``isolate``: each
    worker runs its candidates in a process of its own, as ``gemmtune tune`` does; tests pass a
    ``runner_factory`` (importable by name) instead."""
    if not gpus:
        raise ValueError("tune(gpus=...): expected at least one device")
    spread = Spread()
    queue = deque(groups(problems))
    deaths: dict[str, int] = {}
    setup = (location, options, retune, isolate, runner_factory)
    workers = {slot: _Worker(gpu, setup) for slot, gpu in enumerate(gpus)}
    try:
        while queue or any(w.group is not None for w in workers.values()):
            for worker in workers.values():
                if worker.group is None and queue:
                    worker.hand(queue.popleft())
            busy = [w for w in workers.values() if w.group is not None]
            for conn in wait([w.conn for w in busy]):
                slot = next(s for s, w in workers.items() if w.conn is conn)
                worker = workers[slot]
                group, results = worker.collect()
                if results is None:
                    spread.restarts += 1
                    _retry_or_give_up(group, deaths, queue, spread, worker.why)
                    workers[slot] = _Worker(worker.gpu, setup)
                    continue
                for result in results:
                    spread.results[result.problem_key] = result
                    if on_result is not None:
                        on_result(result)
    finally:
        for worker in workers.values():
            worker.stop()
    return spread


def _retry_or_give_up(group: list[Problem], deaths: dict[str, int], queue: deque, spread: Spread, why: str) -> None:
    key = group[0].without_epilogue().key()
    deaths[key] = deaths.get(key, 0) + 1
    if deaths[key] < ATTEMPTS:
        log.warning("gemmtune: a tuning worker %s while tuning %s; another worker tunes it", why, group[0].describe())
        queue.append(group)
        return
    log.warning("gemmtune: %s took down %d tuning workers (the last %s); it is given up", group[0].describe(),
                deaths[key], why)
    spread.given_up.extend(group)


class _Worker:
    """One worker process on one GPU, and the group it is tuning."""

    def __init__(self, gpu: int | None, setup: tuple) -> None:
        context = multiprocessing.get_context("spawn")
        self.gpu, self.group, self.why = gpu, None, ""
        self.conn, child = context.Pipe()
        # not a daemon: a worker runs its candidates in processes of its own (IsolatedRunner), which
        # multiprocessing forbids a daemon; one whose parent is gone ends on the closed pipe
        self.process = context.Process(target=serve, args=(child, gpu, *setup))
        with main_hidden():
            self.process.start()
        child.close()

    def hand(self, group: list[Problem]) -> None:
        self.group = group
        self.conn.send_bytes(json.dumps({"problems": [p.key() for p in group]}).encode())

    def collect(self) -> tuple[list[Problem], list[TuneResult] | None]:
        """The group handed and its results; None where the worker died (``why`` says how)."""
        group, self.group = self.group, None
        try:
            reply = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.process.join(timeout=10)
            self.why = f"died (exit code {self.process.exitcode})"
            self.stop()
            return group, None
        if "error" in reply:
            self.why = f"failed ({reply['error']})"
            self.stop()
            return group, None
        return group, [result_of_reply(r) for r in reply["results"]]

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send_bytes(json.dumps({"exit": True}).encode())
            except (OSError, ValueError):
                pass
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)
        self.conn.close()


def reply_of_result(result: TuneResult) -> dict:
    """A result as plain data, for a pipe or a Ray task's return."""
    return {"problem_key": result.problem_key, "device": result.device, "backend": result.backend,
            "config": result.config, "time_ms": result.time_ms, "cublas_ms": result.cublas_ms,
            "tune_s": result.tune_s, "rel_err": result.rel_err, "from_store": result.from_store,
            "gpu_timings": result.gpu_timings, "trials": [t.to_dict() for t in result.trials]}


def result_of_reply(data: dict) -> TuneResult:
    data = dict(data)
    trials = tuple(Trial.from_dict(t) for t in data.pop("trials"))
    return TuneResult(**data, trials=trials)


@contextlib.contextmanager
def worker_state(gpu: int | None, location: str | None, isolate: bool, runner_factory: Callable | None):
    """A worker's device, store and runner (closed after)."""
    import torch

    from gemmtune.device import current
    from gemmtune.store import open_store
    from gemmtune.tuning.worker import IsolatedRunner

    if gpu is not None:
        torch.cuda.set_device(gpu)
    device = current(gpu)
    store = open_store(location)
    index = gpu if gpu is not None else (torch.cuda.current_device() if torch.cuda.is_available() else 0)
    runner = runner_factory(device) if runner_factory is not None else (
        IsolatedRunner(device, device_index=index) if isolate else None)
    try:
        yield device, store, runner
    finally:
        if isinstance(runner, IsolatedRunner):
            runner.close()
        store.close()


def tune_group(problems: list[Problem], location: str | None, options: TuneOptions, retune: bool, isolate: bool,
               runner_factory: Callable | None, gpu: int | None = None) -> list[dict]:
    """One group tuned in this process into the store (a Ray task's work); the results as data."""
    with worker_state(gpu, location, isolate, runner_factory) as (device, store, runner):
        return [reply_of_result(r) for r in tune_many(problems, device, store, options, retune=retune, runner=runner)]


def serve(conn, gpu: int | None, location: str | None, options: TuneOptions, retune: bool, isolate: bool,
          runner_factory: Callable | None) -> None:
    """A worker: tune each group it is handed into the store, answer with the results."""
    with worker_state(gpu, location, isolate, runner_factory) as (device, store, runner):
        while True:
            try:
                request = json.loads(conn.recv_bytes())
            except EOFError:  # the parent is gone
                return
            if request.get("exit"):
                return
            started = time.perf_counter()
            problems = [Problem.from_key(key) for key in request["problems"]]
            try:
                results = tune_many(problems, device, store, options, retune=retune, runner=runner)
            except Exception as error:  # noqa: BLE001 - the parent hands the group to another worker
                conn.send_bytes(json.dumps({"error": f"{type(error).__name__}: {error}"[:300]}).encode())
                return
            log.debug("gemmtune: worker on %s tuned %d problems in %.1f s", device.name, len(problems),
                      time.perf_counter() - started)
            conn.send_bytes(json.dumps({"results": [reply_of_result(r) for r in results]}).encode())
