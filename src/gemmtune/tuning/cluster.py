"""Many problems tuned across the hosts of a Ray cluster (``gemmtune tune --ray``): one Ray task per
problem group (``spread.groups``), each holding one GPU (none on a CPU-only cluster, where the
tasks run Triton's interpreter), all writing into one store. Ray places the tasks and retries a
task whose worker or host died (``RETRIES`` times); a group whose task still fails is given up and
said so, as ``spread`` does on one host.

The store must be one every host reaches: a server's URL (``GEMMTUNE_STORE=postgresql://...``),
or a path on a filesystem all hosts share; a SQLite path on a cluster of several hosts is taken
as such, and a warning says so. Ray (``pip install ray``) is imported only here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from gemmtune.problem import Problem
from gemmtune.results import Trial, TuneResult
from gemmtune.tuning import spread
from gemmtune.tuning.tuner import TuneOptions, tune_many

log = logging.getLogger("gemmtune")

RETRIES = 1  # Ray's retries of a task whose worker died


def tune(problems: Sequence[Problem], *, address: str | None = None, location: str | None = None,
         options: TuneOptions = TuneOptions(), retune: bool = False, isolate: bool = True,
         runner_factory: Callable | None = None,
         on_result: Callable[[TuneResult], None] | None = None) -> spread.Spread:
    """Tune ``problems`` on the Ray cluster at ``address`` ("auto": the one this host is part of;
    None: a local instance started here and stopped after), into the store at ``location``."""
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
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        task = ray.remote(num_gpus=gpus, max_retries=RETRIES, retry_exceptions=False)(_tune_group)
        pending = {task.remote([p.key() for p in group], location, options, retune, isolate, runner_factory): group
                   for group in spread.groups(problems)}
        done = spread.Spread()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            group = pending.pop(ready[0])
            try:
                replies = ray.get(ready[0])
            except (ray.exceptions.RayError, OSError) as error:
                log.warning("gemmtune: the Ray task tuning %s failed after %d retries (%s); it is given up",
                            group[0].describe(), RETRIES, type(error).__name__)
                done.given_up.extend(group)
                continue
            for reply in replies:
                result = result_of_reply(reply)
                done.results[result.problem_key] = result
                if on_result is not None:
                    on_result(result)
        return done
    finally:
        if started_here:
            ray.shutdown()


def _tune_group(keys: list[str], location: str | None, options: TuneOptions, retune: bool, isolate: bool,
                runner_factory: Callable | None) -> list[dict]:
    """A Ray task: tune one group on the GPU Ray gave it (or the interpreter) into the store;
    the results as plain data. The candidates run in ``runner_factory``'s runner where given (tests:
    one that ends the task's process), else in a process of their own where ``isolate``, else in
    the task's."""
    import torch

    from gemmtune.device import current
    from gemmtune.store import open_store
    from gemmtune.tuning.worker import IsolatedRunner

    device = current()
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    runner = runner_factory(device) if runner_factory is not None else (
        IsolatedRunner(device, device_index=index) if isolate else None)
    problems = [Problem.from_key(key) for key in keys]
    try:
        with open_store(location) as store:
            return [reply_of_result(r) for r in tune_many(problems, device, store, options, retune=retune,
                                                          runner=runner)]
    finally:
        if isinstance(runner, IsolatedRunner):
            runner.close()


def reply_of_result(result: TuneResult) -> dict:
    """A result as plain data, for a Ray task's return."""
    return {"problem_key": result.problem_key, "device": result.device, "backend": result.backend,
            "config": result.config, "time_ms": result.time_ms, "cublas_ms": result.cublas_ms,
            "tune_s": result.tune_s, "rel_err": result.rel_err, "from_store": result.from_store,
            "gpu_timings": result.gpu_timings, "trials": [t.to_dict() for t in result.trials]}


def result_of_reply(data: dict) -> TuneResult:
    data = dict(data)
    trials = tuple(Trial.from_dict(t) for t in data.pop("trials"))
    return TuneResult(**data, trials=trials)
