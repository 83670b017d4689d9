"""Candidates in a child process: a crash (an illegal memory access, a segfault), a hang or an
out-of-memory in one candidate becomes a failed Trial with its reason, the child is restarted
and tuning goes on; the user's process never runs a candidate.

Parent and child speak JSON over a pipe (plain data both ways: backend names, config dicts,
Trials as dicts), one request at a time. A CUDA error poisons a context for good, so after a
failed launch the child checks its context and, if it is broken, answers and then asks to be
replaced.
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Iterable

from gemmtune.device import Device
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing, Trial
from gemmtune.tuning.compiler import Compiled
from gemmtune.tuning.processes import main_hidden

log = logging.getLogger("gemmtune.tuning.worker")

BOOT_TIMEOUT_S = 180.0  # a fresh child imports torch and triton and creates a CUDA context
# Candidates' processes started ahead (``start_early``), by device index, until a runner adopts one.
_early: dict[int, tuple] = {}
_CUDA_ERROR_NOT_INITIALIZED = 3


class WorkerFailed(Exception):
    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class IsolatedRunner:
    """The ``runner.Runner`` in a child process (a ``runner.LocalRunner`` there, or the injected
    runner_factory's); also closes it (``close``, or as a context manager)."""

    def __init__(self, device: Device, *, timeout_s: float = 300.0, device_index: int = 0,
                 runner_factory=None) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self._index = device_index
        self._factory = runner_factory  # tests inject faulty runners; None: runner.LocalRunner
        self._process = None
        self._conn = None
        self._session: dict | None = None
        self.restarts = 0

    def start(self, problem: Problem, seed: int) -> None:
        self._session = {"op": "start", "problem": problem.key(), "seed": seed}
        self._call(self._session)

    def compile(self, candidates: list[tuple[str, dict]]) -> list[Compiled]:
        """Compiled ahead in the child's threads; nothing when the child died doing it (the
        restarted child builds each candidate when it evaluates it)."""
        try:
            reply = self._call({"op": "compile", "candidates": [list(c) for c in candidates]})
        except WorkerFailed as failure:
            log.warning("gemmtune: compiling ahead failed (%s); restarting the worker", failure.reason)
            self._restart()
            return []
        return [Compiled.from_dict(d) for d in reply["compiled"]]

    def evaluate(self, backend_name: str, config: dict, screen_budget_ms: float) -> Trial:
        request = {"op": "evaluate", "backend": backend_name, "config": config, "screen_budget_ms": screen_budget_ms}
        try:
            return Trial.from_dict(self._call(request)["trial"])
        except WorkerFailed as failure:
            log.warning("gemmtune: %s %s; restarting the worker", Trial(backend_name, config, failure.status).label(),
                        failure.reason)
            self._restart()
            return Trial(backend_name, config, failure.status, reason=failure.reason)

    def evaluate_many(self, backend_name: str, configs: list[dict], screen_budget_ms: float) -> list[Trial]:
        """As one request; where the child dies doing it, each config again on its own, so the one
        that kills it is isolated and the others still measured."""
        request = {"op": "evaluate_many", "backend": backend_name, "configs": configs,
                   "screen_budget_ms": screen_budget_ms}
        try:
            return [Trial.from_dict(t) for t in self._call(request)["trials"]]
        except WorkerFailed as failure:
            log.warning("gemmtune: screening %d %s candidates together failed (%s); one at a time instead",
                        len(configs), backend_name, failure.reason)
            self._restart()
            return [self.evaluate(backend_name, config, screen_budget_ms) for config in configs]

    def final(self, candidates: list[tuple[str, dict]], budget_ms: float,
              min_rounds: int) -> dict[str, tuple[Timing, Timing, Timing | None, str]]:
        request = {"op": "final", "candidates": [list(c) for c in candidates], "budget_ms": budget_ms,
                   "min_rounds": min_rounds}
        try:
            reply = self._call(request)
        except WorkerFailed as failure:  # a finalist that crashes only when re-run: keep the reference
            log.warning("gemmtune: the final round failed (%s); keeping %s", failure.reason, candidates[0][0])
            self._restart()
            reply = self._call({**request, "candidates": [list(candidates[0])]})
        return {label: (Timing(tuple(samples)), Timing(tuple(cost)), None if host is None else Timing(tuple(host)),
                        recheck) for label, (samples, cost, host, recheck) in reply["final"].items()}

    def close(self) -> None:
        if self._process is not None and self._process.is_alive():
            try:
                self._conn.send_bytes(b'{"op": "exit"}')
                self._process.join(timeout=10)
            except OSError:
                pass
        self._stop()

    def __enter__(self) -> "IsolatedRunner":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, request: dict, timeout_s: float | None = None) -> dict:
        if self._process is None:
            self._spawn()
        self._conn.send_bytes(json.dumps(request).encode())
        if not self._conn.poll(timeout_s or self.timeout_s):
            self._stop()
            raise WorkerFailed(Status.TIMEOUT, f"no answer within {timeout_s or self.timeout_s:.0f} s")
        try:
            reply = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._process.join(timeout=10)
            code = self._process.exitcode
            self._stop()
            raise WorkerFailed(Status.LAUNCH_ERROR, f"the worker died (exit code {code})") from None
        if "error" in reply:
            if reply.get("broken"):  # the child exits after this answer
                self._stop()
                raise WorkerFailed(Status.LAUNCH_ERROR, reply["error"][:300])
            raise RuntimeError(f"gemmtune worker: {reply['error']}")
        if reply.get("broken"):  # answered, but its CUDA context is gone: replace it now
            self._restart()
        return reply

    def _spawn(self) -> None:
        early = _early.pop(self._index, None) if self._factory is None else None
        if early is not None:
            self._process, self._conn = early
            try:
                self._call({"op": "ping"}, timeout_s=BOOT_TIMEOUT_S)
                return
            except (WorkerFailed, OSError) as failure:  # it died booting: a fresh one, as without it
                log.debug("gemmtune: the candidates' process started early failed (%s); starting another", failure)
                self._stop()
        self._process, self._conn = _launch("spawn", self._index, self._factory)
        self._call({"op": "ping"}, timeout_s=BOOT_TIMEOUT_S)

    def _restart(self) -> None:
        self._stop()
        self.restarts += 1
        if self._session is not None:
            self._call(self._session)

    def _stop(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


def start_early(indices: Iterable[int]) -> None:
    """Start the candidates' processes of these device indices now, forked from this process
    before it has a CUDA context: they skip the import of torch that a spawned one pays (3-4 s on
    the H200 hosts, then 1.2 s for its context), and their context starts while this process makes
    its own. An ``IsolatedRunner`` of the index adopts its process when it first needs one.
    Nothing is started where forking is not safe here: the CUDA driver or Triton already loaded
    (the children must load their own), or other threads running (a fork copies their locks held)."""
    if (_driver_started() or "triton" in sys.modules or threading.active_count() > 1
            or "fork" not in multiprocessing.get_all_start_methods()):
        return
    for index in indices:
        if index not in _early:
            _early[index] = _launch("fork", index, None)


def _driver_started() -> bool:
    """Whether this process has started the CUDA driver (``cuInit``, which torch calls to count
    GPUs where NVML cannot, and to make a context): a child forked after it cannot use CUDA.
    Before ``cuInit`` every other driver call answers CUDA_ERROR_NOT_INITIALIZED; without a
    driver, the children run Triton's interpreter and no CUDA state is copied."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    context = ctypes.c_void_p()
    return driver.cuCtxGetCurrent(ctypes.byref(context)) != _CUDA_ERROR_NOT_INITIALIZED


def discard_early() -> None:
    """End the processes started early that no runner adopted."""
    while _early:
        process, conn = _early.popitem()[1]
        process.kill()
        process.join(timeout=10)
        conn.close()


def _launch(method: str, index: int, factory) -> tuple:
    """A candidates' process for device ``index`` started by ``method`` (fork or spawn), and
    this side's end of its pipe; it answers once booted."""
    context = multiprocessing.get_context(method)
    conn, child = context.Pipe()
    process = context.Process(target=serve, args=(child, index, factory), daemon=True)
    with main_hidden():
        process.start()
    child.close()
    return process, conn


def serve(conn, device_index: int, runner_factory=None) -> None:
    """The child's loop: one JSON request in, one JSON reply out, until told to exit."""
    from gemmtune import settings

    # Before triton is imported: compiled kernels persist where gemmtune (and doctor) say.
    os.environ["TRITON_CACHE_DIR"] = str(settings.triton_cache_dir())
    import torch

    from gemmtune.device import current
    from gemmtune.tuning.runner import LocalRunner

    if torch.cuda.is_available():
        torch.cuda.set_device(device_index)
    device = current(device_index if torch.cuda.is_available() else None)
    runner = (runner_factory or LocalRunner)(device)
    while True:
        request = json.loads(conn.recv_bytes())
        if request["op"] == "exit":
            return
        try:
            reply = _handle(runner, request)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
            # an error that left the CUDA context broken is a crash like any other: the parent
            # records it and restarts this process; any other error is a bug it raises
            reply = {"error": f"{type(exc).__name__}: {exc}", "broken": not _context_healthy(device)}
        conn.send_bytes(json.dumps(reply).encode())
        if reply.get("broken"):
            os._exit(3)


def _handle(runner, request: dict) -> dict:
    op = request["op"]
    if op == "ping":
        return {}
    if op == "start":
        import torch

        from gemmtune.tuning.runner import float32_precision

        problem = Problem.from_key(request["problem"])
        torch.set_float32_matmul_precision(float32_precision(problem))  # this process tunes, nothing else
        runner.start(problem, request["seed"])
        return {}
    if op == "compile":
        compiled = runner.compile([tuple(c) for c in request["candidates"]])
        return {"compiled": [c.to_dict() for c in compiled], "broken": not _context_healthy(runner.device)}
    if op == "evaluate":
        trial = runner.evaluate(request["backend"], request["config"], request["screen_budget_ms"])
        return {"trial": trial.to_dict(), "broken": not trial.ok and not _context_healthy(runner.device)}
    if op == "evaluate_many":
        trials = runner.evaluate_many(request["backend"], request["configs"], request["screen_budget_ms"])
        return {"trials": [t.to_dict() for t in trials],
                "broken": not all(t.ok for t in trials) and not _context_healthy(runner.device)}
    if op == "final":
        final = runner.final([tuple(c) for c in request["candidates"]], request["budget_ms"], request["min_rounds"])
        return {"final": {label: [list(timing.samples), list(cost.samples),
                                  None if host is None else list(host.samples), recheck]
                          for label, (timing, cost, host, recheck) in final.items()}}
    raise ValueError(f"unknown request {op!r}")


def _context_healthy(device: Device) -> bool:
    """False once a CUDA error has poisoned this process's context (every later call fails)."""
    if device.interpreter:
        return True
    import torch

    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception:  # noqa: BLE001 - any error here means the context is unusable
        return False
    return True
