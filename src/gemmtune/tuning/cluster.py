"""Many problems tuned across the hosts of a Ray cluster (``gemmtune tune --ray``): one Ray actor
per GPU of the cluster (per CPU on a CPU-only cluster, where it runs Triton's interpreter), each a
tuner that holds its GPU, its candidates' process and a connection to the store, and is handed a
problem group (``spread.groups``) at a time as it comes free, the costliest groups first, as
``spread`` does over one host's GPUs. Every result goes into one store.

Actors, not a Ray task per group: Ray starts a new worker process for each task that holds a GPU
(``max_calls`` is 1 for them), so every group would pay a process's start, torch's import, a
CUDA context and a candidates' process of its own; an actor pays them once.

An actor that dies (its process or its host ended) costs the group it was tuning: that group goes
to the next free actor, and a new actor takes the dead one's place where the cluster still has a
GPU for it. A group that fails ``spread.ATTEMPTS`` times is given up, and said so. Groups wait for
an actor that has started; if none is tuning and none starts within STALL_S, the groups left are
given up.

The store must be one every host reaches: a server's URL (``GEMMTUNE_STORE=postgresql://...``),
or a path on a filesystem all hosts share; a SQLite path on a cluster of several hosts is taken
as such, and a warning says so. Ray (``pip install ray``) is imported only here.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence

from gemmtune.problem import Problem
from gemmtune.results import Trial, TuneResult
from gemmtune.tuning import spread
from gemmtune.tuning.tuner import TuneOptions, tune_many

log = logging.getLogger("gemmtune")

STALL_S = 600.0  # how long groups wait for an actor to start while none is tuning


def tune(problems: Sequence[Problem], *, address: str | None = None, location: str | None = None,
         options: TuneOptions = TuneOptions(), retune: bool = False, isolate: bool = True,
         runner_factory: Callable | None = None,
         on_result: Callable[[TuneResult], None] | None = None) -> spread.Spread:
    """Tune ``problems`` on the Ray cluster at ``address`` ("auto": the one this host is part of;
    None: a local instance started here and stopped after), into the store at ``location``.
    ``runner_factory`` (tests) makes each actor's runner in the actor's own process."""
    import ray
    import torch

    from gemmtune.store.server import is_url

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({} if address else {"num_gpus": torch.cuda.device_count()}))
    try:
        if len(ray.nodes()) > 1 and not is_url(location):
            log.warning("gemmtune: tuning on %d hosts into %s: unless every host shares that path, set "
                        "GEMMTUNE_STORE to a server's URL so that the choices meet in one store",
                        len(ray.nodes()), location or "the default SQLite file")
        waiting = deque(spread.costliest_first(spread.groups(problems)))
        pool = _Pool(ray, (location, options, retune, isolate, runner_factory), waiting)
        try:
            return _drive(pool, waiting, on_result)
        finally:
            pool.close()
    finally:
        if started_here:
            ray.shutdown()


def _drive(pool: _Pool, waiting: deque, on_result: Callable[[TuneResult], None] | None) -> spread.Spread:
    """The pool's results until each of ``waiting``'s groups (the pool's own queue, which a failed
    group rejoins) is tuned or given up."""
    done = spread.Spread()
    failures: dict[str, int] = {}
    while waiting or pool.busy:
        event = pool.next_event()
        if event is None:  # no actor tuning, none started in time
            why = f"no Ray actor started within {STALL_S:.0f} s (is a GPU free on the cluster?)"
            while waiting:
                group = waiting.popleft()
                log.warning("gemmtune: tuning %s is given up: %s", group[0].describe(), why)
                done.given_up.extend(group)
            continue
        group, replies, why = event
        if replies is None:
            done.restarts += 1
            spread.retry_or_give_up(group, failures, waiting, done, why)
            continue
        for reply in replies:
            result = result_of_reply(reply)
            done.results[result.problem_key] = result
            if on_result is not None:
                on_result(result)
    return done


class _Pool:
    """The actors of one tuning: those starting, those free, and those tuning a group of ``waiting``
    (handed out as actors come free)."""

    def __init__(self, ray, arguments: tuple, waiting: deque) -> None:
        self._ray, self._waiting = ray, waiting
        gpus = int(ray.cluster_resources().get("GPU", 0))
        self._resource = "GPU" if gpus else "CPU"
        self._class = (ray.remote(num_gpus=1, num_cpus=0) if gpus else ray.remote(num_cpus=1))(_Tuner)
        self._arguments = arguments
        self._starting: dict = {}  # the ready() call's reference -> its actor
        self._free: list = []
        self._tuning: dict = {}  # the tune() call's reference -> (its actor, its group)
        slots = gpus or int(ray.cluster_resources().get("CPU", 1))
        for _ in range(max(1, min(slots, len(waiting)))):
            self._start()

    @property
    def busy(self) -> bool:
        return bool(self._tuning)

    def next_event(self) -> tuple[list[Problem], list[dict] | None, str] | None:
        """The next group done, the waiting groups handed to the actors free meanwhile: (the
        group, its replies, "") when it is tuned, (the group, None, why) when its tuning failed;
        None when none is tuning and none started within STALL_S."""
        ray = self._ray
        while True:
            while self._free and self._waiting:
                actor, group = self._free.pop(), self._waiting.popleft()
                self._tuning[actor.tune.remote([p.key() for p in group])] = (actor, group)
            if not self._tuning and not self._starting:
                return None
            ready, _ = ray.wait([*self._tuning, *self._starting], num_returns=1,
                                timeout=None if self._tuning else STALL_S)
            if not ready:
                return None
            if ready[0] not in self._starting:
                break
            self._started(self._starting.pop(ready[0]), ready[0])  # an actor started, or failed to
        reference = ready[0]
        actor, group = self._tuning.pop(reference)
        try:
            replies = ray.get(reference)
        except ray.exceptions.RayActorError as error:
            self._replace(actor)
            return group, None, f"its Ray actor died ({type(error).__name__})"
        except ray.exceptions.RayError as error:
            self._free.append(actor)
            return group, None, f"{type(error).__name__}: {error}"[:300]
        self._free.append(actor)
        return group, replies, ""

    def close(self) -> None:
        """Each free actor closes its runner and store; then every actor is ended."""
        ray = self._ray
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get([actor.close.remote() for actor in self._free], timeout=60)
        for actor in [*self._free, *self._starting.values(), *(a for a, _ in self._tuning.values())]:
            ray.kill(actor, no_restart=True)

    def _start(self) -> None:
        actor = self._class.remote(*self._arguments)
        self._starting[actor.ready.remote()] = actor

    def _started(self, actor, reference) -> None:
        ray = self._ray
        try:
            ray.get(reference)
        except ray.exceptions.RayError as error:
            log.warning("gemmtune: a Ray actor could not start its tuning (%s: %s)", type(error).__name__,
                        str(error)[:300])
            ray.kill(actor, no_restart=True)
            return
        self._free.append(actor)

    def _replace(self, dead) -> None:
        """A new actor in ``dead``'s place, where the cluster still has a GPU (a CPU) for it."""
        ray = self._ray
        ray.kill(dead, no_restart=True)
        alive = len(self._starting) + len(self._free) + len(self._tuning)
        if ray.cluster_resources().get(self._resource, 0) >= alive + 1:
            self._start()


class _Tuner:
    """A Ray actor: one GPU's tuner (the interpreter's on a CPU-only cluster), its candidates' runner
    and a connection to the store, kept for every group it is handed. The candidates run in
    ``runner_factory``'s runner where given (tests: one that ends the actor's process), else in a
    process of their own where ``isolate``, else in the actor's."""

    def __init__(self, location: str | None, options: TuneOptions, retune: bool, isolate: bool,
                 runner_factory: Callable | None) -> None:
        import torch

        from gemmtune.device import current
        from gemmtune.store import open_store
        from gemmtune.tuning.worker import IsolatedRunner

        self._options, self._retune = options, retune
        self._stack = contextlib.ExitStack()
        self._device = current()
        self._store = self._stack.enter_context(open_store(location))
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        self._runner = runner_factory(self._device) if runner_factory is not None else (
            self._stack.enter_context(IsolatedRunner(self._device, device_index=index)) if isolate else None)

    def ready(self) -> bool:
        return True

    def tune(self, keys: list[str]) -> list[dict]:
        """The group of problems ``keys`` tuned into the store; the results as plain data."""
        problems = [Problem.from_key(key) for key in keys]
        return [reply_of_result(r) for r in tune_many(problems, self._device, self._store, self._options,
                                                      retune=self._retune, runner=self._runner)]

    def close(self) -> None:
        self._stack.close()


def reply_of_result(result: TuneResult) -> dict:
    """A result as plain data, for an actor's reply."""
    return {"problem_key": result.problem_key, "device": result.device, "backend": result.backend,
            "config": result.config, "time_ms": result.time_ms, "cublas_ms": result.cublas_ms,
            "tune_s": result.tune_s, "rel_err": result.rel_err, "from_store": result.from_store,
            "gpu_timings": result.gpu_timings, "trials": [t.to_dict() for t in result.trials]}


def result_of_reply(data: dict) -> TuneResult:
    data = dict(data)
    trials = tuple(Trial.from_dict(t) for t in data.pop("trials"))
    return TuneResult(**data, trials=trials)
