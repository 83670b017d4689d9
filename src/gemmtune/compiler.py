"""Compiling candidates ahead, in parallel: a pool of processes launches each planned candidate
once on operands shaped like the tuner's, so Triton compiles it there and stores the binary in
its on-disk cache. The runner that verifies and times the candidate then loads the binary
instead of compiling it: a shape's compiles cost the longest of them, not their sum.

The processes come from a fork server that imports torch and triton once, so each starts in a
fraction of a second; they serve every problem tuned in a burst and are shut down after
IDLE_CLOSE_S without work, since each holds a CUDA context that a training job may need.
A compile failure (shared memory, registers, a compiler error) comes back as a typed failure
that the tuner records without building the candidate again; anything else that goes wrong in
the pool is left to the runner, which meets it again and classifies it there.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout  # not the builtin one before Python 3.11
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from gemmtune.problem import Problem
from gemmtune.processes import main_hidden
from gemmtune.results import Status

log = logging.getLogger("gemmtune.compiler")

MAX_WORKERS = 8  # each holds a CUDA context (~0.5 GB of GPU memory) and one problem's operands
IDLE_CLOSE_S = 30.0
COMPILE_TIMEOUT_S = 120.0  # for one problem's candidates; what is not compiled by then the runner builds
_PRELOAD = ["torch", "triton", "gemmtune.backends", "gemmtune.verify"]


@dataclass(frozen=True)
class Compiled:
    """What compiling one candidate ahead gave: OK, or a compile-time failure with its reason."""

    backend: str
    config: dict
    status: Status
    reason: str = ""
    seconds: float = 0.0


class CompilePool:
    """Worker processes that compile candidates; ``compile`` blocks until all are done."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = default_workers() if workers is None else workers
        self._executor: ProcessPoolExecutor | None = None
        self._compiled: set[tuple[str, str, str]] = set()  # (problem key, backend, config) done
        self._lock = threading.Lock()  # the idle timer's close against a compile starting
        self._idle: threading.Timer | None = None

    def compile(self, problem: Problem, candidates: Sequence[tuple[str, dict]], triton_cache_dir: str,
                interpreter: bool = False) -> list[Compiled]:
        """Compile each (backend name, config dict) for ``problem`` not compiled by this pool
        before, in completion order. A broken pool (a worker killed mid-compile) yields no
        result for what it had not finished and is replaced on the next call."""
        fresh = [(name, config) for name, config in candidates if self._key(problem, name, config) not in self._compiled]
        if not fresh or self.workers < 1:
            return []
        with self._lock:
            if self._idle is not None:
                self._idle.cancel()
            done = self._run(problem, fresh, triton_cache_dir, interpreter)
            self._arm_idle_timer()
        self._compiled.update(self._key(problem, d.backend, d.config) for d in done if d.status is Status.OK)
        return done

    def start_in_background(self) -> None:
        """Start the processes now, on a thread, so that their start (importing torch in the
        fork server, a CUDA context each) overlaps other work; ``compile`` waits for it."""
        if self.workers >= 1 and self._executor is None:
            threading.Thread(target=self._warm, name="gemmtune-compile-pool", daemon=True).start()

    def _warm(self) -> None:
        with self._lock:
            if self._idle is not None:
                self._idle.cancel()
            executor = self._start()
            with main_hidden():
                futures = [executor.submit(os.getpid) for _ in range(self.workers)]
            try:
                for future in futures:
                    future.result()
            except BrokenProcessPool:
                self._shutdown()
            self._arm_idle_timer()

    def _arm_idle_timer(self) -> None:
        self._idle = threading.Timer(IDLE_CLOSE_S, self.close)
        self._idle.daemon = True
        self._idle.start()

    def _run(self, problem, candidates, triton_cache_dir, interpreter) -> list[Compiled]:
        executor = self._start()
        with main_hidden():  # the executor launches its processes on the first submit
            futures = [executor.submit(compile_one, problem, name, config, triton_cache_dir, interpreter)
                       for name, config in candidates]
        done = []
        try:
            for future in as_completed(futures, timeout=COMPILE_TIMEOUT_S):
                done.append(future.result())
        except BrokenProcessPool as exc:
            log.warning("a compile worker died (%s); the runner will build what it had not", exc)
            self._shutdown()
        except FuturesTimeout:
            log.warning("compiling ahead took over %.0f s; the runner will build the %d candidates left",
                        COMPILE_TIMEOUT_S, len(futures) - len(done))
            self._shutdown()  # its processes finish their current compile, then exit
        if any(d.status is Status.LAUNCH_ERROR and "CUDA" in d.reason for d in done):
            self._shutdown()  # a faulting kernel can leave its process's CUDA context unusable
        return done

    @staticmethod
    def _key(problem: Problem, backend: str, config: dict) -> tuple[str, str, str]:
        return problem.key(), backend, json.dumps(config, sort_keys=True)

    def close(self) -> None:
        """Shut the processes down (the pool restarts them when asked to compile again)."""
        with self._lock:
            if self._idle is not None:
                self._idle.cancel()
            self._shutdown()

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _start(self) -> ProcessPoolExecutor:
        if self._executor is None:
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            if context.get_start_method() == "forkserver":
                context.set_forkserver_preload(_PRELOAD)
            self._executor = ProcessPoolExecutor(self.workers, mp_context=context)
        return self._executor


def default_workers() -> int:
    from gemmtune import settings

    asked = settings.compile_workers()
    return asked if asked is not None else max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))


def compile_one(problem: Problem, backend_name: str, config: dict, triton_cache_dir: str,
                interpreter: bool) -> Compiled:
    """In a pool process: build the candidate and launch it once, which makes Triton compile it
    for exactly the argument specialization the runner will use."""
    os.environ["TRITON_CACHE_DIR"] = triton_cache_dir  # the runner's cache: it must find the binary
    import torch

    from gemmtune import backends, verify
    from gemmtune.device import current
    from gemmtune.runner import classify, matmul_precision

    started = time.perf_counter()
    try:
        with matmul_precision(problem):
            kernel = backends.build(problem, backend_name, config, current())
            operands = verify.make_operands(problem, "cpu" if interpreter else "cuda", seed=0)
            kernel(*operands)
            if not interpreter:
                torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported to the tuner, which decides what it means
        status, reason = classify(exc)
        return Compiled(backend_name, config, status, reason, time.perf_counter() - started)
    finally:
        if not interpreter:
            torch.cuda.empty_cache()  # the next candidate may be another problem's
    return Compiled(backend_name, config, Status.OK, "", time.perf_counter() - started)


_POOL: CompilePool | None = None


def shared_pool() -> CompilePool:
    """The process's pool, started on first use and shut down at exit."""
    global _POOL
    if _POOL is None:
        _POOL = CompilePool()
        atexit.register(_POOL.close)
    return _POOL
