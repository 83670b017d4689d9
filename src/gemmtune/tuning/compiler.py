"""Compiling candidates ahead, in parallel, in the process that will run them: threads each
build one planned candidate and launch it once on the runner's operands, so Triton compiles it
for exactly the argument specialization the runner uses and keeps the binary in memory and in
its on-disk cache. The runner that verifies and times the candidate then finds it compiled: a
shape's compiles cost the longest of them, not their sum.

Threads, and forked children for Triton's front end. Triton releases the GIL in its compiler
passes and while ptxas runs, but its front end (about 85 ms a compile on the H200's host) is
Python that holds it; so each job's kernels are first compiled by a child forked for it
(``fork_compile``), which starts in milliseconds with everything imported and touches no CUDA,
and the job's thread then loads them from Triton's cache. A pool of spawned processes was no
answer: each imported torch and created a CUDA context first, and on the H200's host a pool of 8
took 3.4 s to start, then 1.6-2.4 s per process before its first compile finished
(docs/tuning-time.md).

A compile failure (shared memory, registers, a compiler error) comes back as a typed failure
that the tuner records without building the candidate again; anything else is left to the
runner, which meets it again and classifies it there.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from gemmtune import backends
from gemmtune.device import Device
from gemmtune.problem import Problem
from gemmtune.results import Status
from gemmtune.tuning import fork_compile

log = logging.getLogger("gemmtune.tuning.compiler")

MAX_WORKERS = 16
# How long a thread running Python keeps the GIL before it must hand it on, while compiling
# ahead (Python's default: 5 ms). Each compile starts with Triton's front end, Python that holds
# the GIL (about 85 ms of a 0.2-0.3 s compile on the H200's host); the rest (MLIR, LLVM, ptxas,
# the C build of the launcher) runs without it. Handed on every 5 ms, the front ends of a batch
# advance together and finish together, so every compile's GIL-free rest, and the launcher's C
# build at the first launch, start only at the end; handed on rarely, they finish one after
# another and each one's rest overlaps the front ends after it.
SWITCH_INTERVAL_S = 0.25


@dataclass(frozen=True)
class Compiled:
    """What compiling one candidate ahead gave: OK, or a compile-time failure with its reason."""

    backend: str
    config: dict
    status: Status
    reason: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"backend": self.backend, "config": self.config, "status": self.status.value,
                "reason": self.reason, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: dict) -> "Compiled":
        return cls(data["backend"], data["config"], Status(data["status"]), data["reason"], data["seconds"])


def compile_ahead(jobs: Sequence[tuple[Problem, str, dict, tuple]], device: Device,
                  workers: int | None = None, meanwhile: Callable[[], None] | None = None) -> list[Compiled]:
    """Each job (problem, backend name, config dict, operands: a, b and bias shaped as the
    runner's) built and launched once, in up to ``workers`` threads; the results in the jobs'
    order. ``meanwhile``, if given, runs while the compile children work, before the threads
    start. Nothing under Triton's interpreter, which runs a kernel instead of compiling it and is
    not safe to run in several threads."""
    workers = default_workers() if workers is None else workers
    if workers < 1 or not jobs or device.interpreter:
        return []
    started = time.perf_counter()
    waits = _fork_children(jobs, device, workers)
    if meanwhile is not None:
        meanwhile()
    with _long_switch_interval(), ThreadPoolExecutor(min(workers, len(jobs)),
                                                     thread_name_prefix="gemmtune-compile") as pool:
        own_jit: dict[str, list] = {}  # the jobs of each backend compiled by its own JIT
        for job in jobs:
            if job[1] in backends.OWN_JIT:
                own_jit.setdefault(job[1], []).append(job)
        together = {name: pool.submit(_compile_together, group, device, workers) for name, group in own_jit.items()}
        futures = [pool.submit(_compile_one, problem, name, config, device, operands, children, together.get(name))
                   for (problem, name, config, operands), children in zip(jobs, waits)]
        results = [future.result() for future in futures]
    log.debug("compiled %d candidates of %d problems ahead in %.2f s on up to %d threads and %d children",
              len(results), len({problem for problem, *_ in jobs}), time.perf_counter() - started, workers,
              len({child for children in waits for child in children}))
    return results


def _fork_children(jobs: Sequence[tuple[Problem, str, dict, tuple]], device: Device, workers: int) -> list[list]:
    """Per job, the compile children (``fork_compile.Child``) its thread waits for before it
    builds the candidate: the one compiling the job's kernels, and those building its kernels'
    launchers. None for a job whose kernels Triton has, whose operands are not on a GPU, or whose
    candidate fails before any compile (its thread meets that again); none at all where forking
    is off. At most ``workers`` children, each taking every so many jobs (a child's copied pages
    cost memory). A launcher depends on the kernel's signature alone, which most candidates
    share, so the first child to meet a signature builds it."""
    if not fork_compile.usable():
        return [[] for _ in jobs]
    captured = [_capture(job, device) for job in jobs]
    keys = [{fork_compile.launcher_key(source) for source in sources} - {None} for sources in captured]
    count = min(workers, sum(map(bool, captured)))
    shares: list[list] = [[] for _ in range(count)]
    early: list[list] = [[] for _ in range(count)]  # per child, the sources whose launchers it builds
    owners: list[int | None] = []  # per job, the child compiling its kernels
    builders: dict[tuple, int] = {}  # launcher key -> the child building it
    dealt = 0  # jobs with kernels so far: each goes to the next child in turn
    for sources in captured:
        owner = dealt % count if sources else None
        dealt += bool(sources)
        owners.append(owner)
        for source in sources:
            shares[owner].append(source)
            key = fork_compile.launcher_key(source)
            if key is not None and key not in builders:
                builders[key] = owner
                early[owner].append(source)
    children = []
    for share, first in zip(shares, early):
        try:
            children.append(fork_compile.Child(share, early=first))
        except OSError as exc:  # the threads compile what the missing children would have
            log.warning("gemmtune: could not fork a compile child (%s); compiling the rest in this process", exc)
            break
    needed = [set() if owner is None else {owner} | {builders[key] for key in job_keys}
              for owner, job_keys in zip(owners, keys)]
    return [[children[i] for i in sorted(indices) if i < len(children)] for indices in needed]


def _capture(job: tuple[Problem, str, dict, tuple], device: Device) -> list:
    """The kernels job's candidate has Triton compile, that Triton's cache lacks
    (``fork_compile.capture``); none where its operands are not on a GPU or it fails first."""
    problem, name, config, operands = job
    if not operands[0].is_cuda or name in backends.OWN_JIT:  # capturing would compile it here, one at a time
        return []
    try:
        with _on_device(operands[0].device.index):
            return fork_compile.capture(lambda: backends.build(problem, name, config, device)(*operands))
    except Exception as exc:  # noqa: BLE001 - the job's thread builds it again and reports
        log.debug("%s %s: nothing compiled in a child (%s)", name, config, exc)
        return []


_switch_lock = threading.Lock()
_switch_users = 0  # compile_ahead calls under way (tuning in several threads of one process)
_switch_before = 0.0  # the interval to restore when the last of them ends


@contextlib.contextmanager
def _long_switch_interval() -> Iterator[None]:
    """SWITCH_INTERVAL_S while any compile_ahead of this process runs, the interval from before
    once the last one ends. Other Python threads of the process wait up to that long for the
    GIL meanwhile (a second or two of compiling)."""
    global _switch_users, _switch_before
    with _switch_lock:
        if _switch_users == 0:
            _switch_before = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_before)


def _compile_together(jobs: Sequence[tuple[Problem, str, dict, tuple]], device: Device, workers: int) -> None:
    """The first calls of ``jobs``, all of one backend compiled by its own JIT (``OWN_JIT``), made
    by that backend together (its ``compile_together``: CuTe DSL's in worker processes); each
    job's thread then makes its own first call, which finds the kernel compiled. A job that fails
    here fails again there, where it is reported."""
    started, name = time.perf_counter(), jobs[0][1]
    try:
        backends.get(name).compile_together([functools.partial(_first_call, *job, device) for job in jobs], workers)
    except Exception as exc:  # noqa: BLE001 - each job's own first call compiles it then, one at a time
        log.warning("gemmtune: %s could not compile its %d candidates together (%s); compiling them one at a time",
                    name, len(jobs), exc)
        return
    log.debug("%s: %d candidates compiled together in %.2f s", name, len(jobs), time.perf_counter() - started)


def _compile_one(problem: Problem, backend_name: str, config: dict, device: Device, operands: tuple,
                 children: Sequence[fork_compile.Child] = (), together: Future | None = None) -> Compiled:
    """The job's first call, once its compile ``children`` and its backend's ``_compile_together``
    (``together``, where the backend compiles by its own JIT) are done."""
    started = time.perf_counter()
    for child in children:
        if (outcome := child.wait()) != "ok":
            log.debug("%s %s: a compile child reported %s; compiling here what it did not", backend_name, config,
                      outcome)
    if together is not None:
        together.result()
    try:
        _first_call(problem, backend_name, config, operands, device)
    except Exception as exc:  # noqa: BLE001 - reported to the tuner, which decides what it means
        status, reason = classify(exc)
        return Compiled(backend_name, config, status, reason, time.perf_counter() - started)
    return Compiled(backend_name, config, Status.OK, "", time.perf_counter() - started)


def _first_call(problem: Problem, backend_name: str, config: dict, operands: tuple, device: Device) -> None:
    """The candidate built and run once on ``operands``, to the end of its kernel."""
    index = operands[0].device.index if operands[0].is_cuda else None
    with _on_device(index):  # a new thread's current device is the first GPU, not the runner's
        backends.build(problem, backend_name, config, device)(*operands)
        if index is not None:
            import torch

            torch.cuda.synchronize()


def _on_device(index: int | None):
    if index is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(index)


def default_workers() -> int:
    from gemmtune import settings

    asked = settings.compile_workers()
    return asked if asked is not None else max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))


def classify(exc: Exception) -> tuple[Status, str]:
    """A candidate's failure as a typed Status and a one-line reason: Triton's resource and
    compile errors by their types, anything else a launch error."""
    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources, PTXASError
    except ImportError:
        return Status.LAUNCH_ERROR, reason
    if isinstance(exc, OutOfResources):
        return Status.OUT_OF_RESOURCES, reason
    if isinstance(exc, (CompilationError, PTXASError)):
        return Status.COMPILE_ERROR, reason
    return Status.LAUNCH_ERROR, reason
