"""The hot path: a problem's identity -> its built kernel, in a dict. A miss goes to the store,
then (in mode ``tune``) to the tuner; the answer is cached here so the next call is a lookup."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

from gemmtune import backends, settings
from gemmtune.device import Device, current
from gemmtune.problem import Problem, bucket
from gemmtune.results import Status, Trial
from gemmtune.shapes import append_miss, entry
from gemmtune.store import ServerStore, Store, open_store
from gemmtune.serving.modes import ByMode
from gemmtune.tuning.tuner import TuneOptions, graph_choice, lean_choice, tune_many, tune_problem

log = logging.getLogger("gemmtune")


class DispatchKey(NamedTuple):
    """What a served call's kernel is looked up by: the problem it is (sizes, dtype, layout,
    epilogue, TF32; an fp8 product's scaling and output dtype) and the CUDA device it runs on."""

    layout: str
    m: int
    n: int
    k: int
    dtype: str
    bias: bool
    tf32: bool
    activation: str
    device: int | None  # a tensor's get_device(); None: the current device
    scaling: str = "none"
    out_dtype: str = ""  # an fp8 product's; "" for the others (their output's is their dtype)

    def problem(self) -> Problem:
        return Problem(self.m, self.n, self.k, self.dtype, self.layout, self.bias, self.tf32, self.activation,
                       self.scaling, self.out_dtype)

    @classmethod
    def of(cls, problem: Problem, device: int | None = None) -> DispatchKey:
        """The key of ``problem`` on the CUDA device ``device`` (None: the current device)."""
        p = problem
        return cls(p.layout, p.m, p.n, p.k, p.dtype, p.bias, p.tf32, p.activation, device, p.scaling,
                   p.out_dtype if p.scaled else "")


class Choice(NamedTuple):
    """What serves a problem: a backend and its config, with the problem's times as its tuning
    measured them (None where nothing was measured: a fallback to cuBLAS)."""

    backend: str
    config: dict
    time_ms: float | None = None
    cublas_ms: float | None = None

    @classmethod
    def of(cls, result) -> Choice:
        return cls(result.backend, result.config, result.time_ms, result.cublas_ms)

    def label(self) -> str:
        """The label of the trial it was (``Trial.label``), by which its tuning's trials name it."""
        return Trial(self.backend, self.config, Status.OK).label()


REFERENCE_CHOICE = Choice(backends.REFERENCE, {})


class Dispatcher:
    def __init__(self, store: Store | ServerStore | None = None) -> None:
        self.kernels: dict[DispatchKey, object] = {}  # read directly by the hot path
        # api.linear's front path: its operands' own attributes -> the kernel that served them
        self.front: dict[tuple, object] = {}
        self._store = store
        self._lock = threading.Lock()
        self._capture_misses: set[tuple] = set()
        self._local = threading.local()  # .deferring: this thread is inside deferring()
        # the kernels eager calls run instead of the choice's where a host-bound model measured
        # faster with them (``serve_lean``); kept when built kernels are dropped
        self.lean: dict[DispatchKey, Trial] = {}

    @property
    def store(self) -> Store | ServerStore:
        if self._store is None:
            self._store = open_store()
        return self._store

    def kernel(self, key: DispatchKey) -> object:
        """The kernel for ``key``: from this table, else from the store or a tuning (a miss)."""
        kernel = self.kernels.get(key)
        if kernel is None:
            with self._lock:
                kernel = self.kernels.get(key) or self._with_lean(key, self._resolve(key.problem(),
                                                                                     current(key.device)))
                self.kernels[key] = kernel
        return kernel

    def capture_miss(self, key: DispatchKey) -> None:
        """A shape first seen while a CUDA graph is being captured: nothing can be tuned or built
        inside a capture, so torch runs it there. Said once per shape, and appended to
        ``GEMMTUNE_MISSES`` for the next offline tune."""
        with self._lock:
            if key in self._capture_misses:
                return
            self._capture_misses.add(key)
        problem = key.problem()
        log.warning("gemmtune: %s was first seen inside CUDA graph capture, so the graph runs cuBLAS for it; "
                    "call the model once before capturing to capture the tuned kernel", problem.describe())
        _append_miss(problem)

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """While the block runs, a miss in this thread is served by cuBLAS instead of being
        tuned (other threads tune theirs as usual), and when it ends every kernel built meanwhile
        is dropped: ``optimize`` records a model's GEMMs this way, then tunes them together."""
        self._local.deferring = True
        try:
            yield
        finally:
            self._local.deferring = False
            self.forget()

    def is_deferring(self) -> bool:
        """Whether this thread is inside ``deferring()``."""
        return getattr(self._local, "deferring", False)

    def forget(self) -> None:
        """Drop built kernels (after the store changed, or in tests)."""
        with self._lock:
            self.kernels.clear()
            self.front.clear()

    def choice(self, problem: Problem, device: Device) -> Choice:
        """What serves ``problem`` on ``device``, as a served call finds it (the store, then a
        tuning), without building the kernel: the compiler asks this of the GEMMs it lowers
        (``gemmtune.inductor``)."""
        for choice in self._stored(problem, device):
            try:
                backends.get(choice.backend).parse_config(choice.config)
            except Exception as exc:  # noqa: BLE001 - an entry the library rejects here is passed over
                log.warning("gemmtune: the stored %s for %s is not a valid config here (%s); passing it over",
                            choice.backend, problem.describe(), exc)
                continue
            return choice
        return self._fresh(problem, device)

    def trials(self, problem: Problem, device: Device) -> list[Trial]:
        """The trials stored with the choice that serves ``problem`` (its own shape's, else its
        bucket's; none where nothing is stored): every candidate's kernel time, as tuned."""
        target = bucket(problem, settings.bucket_policy())
        for candidate in dict.fromkeys((problem, target)):
            if self.store.get(device.fingerprint(), candidate.key()) is not None:
                return self.store.trials(device.fingerprint(), candidate.key())
        return []

    def _resolve(self, problem: Problem, device: Device):
        for choice in self._stored(problem, device):
            try:
                kernel = backends.build(problem, choice.backend, choice.config, device)
            except Exception as exc:  # noqa: BLE001 - an entry the library rejects here is passed over
                log.warning("gemmtune: the stored %s for %s cannot be built here (%s); passing it over",
                            choice.backend, problem.describe(), exc)
                continue
            return self._with_graph_kernel(problem, device, choice, kernel)
        choice = self._fresh(problem, device)
        return self._with_graph_kernel(problem, device, choice,
                                       backends.build(problem, choice.backend, choice.config, device))

    def graph_pick(self, problem: Problem, device: Device, chosen: str) -> Trial | None:
        """What CUDA graphs capture for ``problem`` instead of its choice ``chosen`` (a trial's
        label): the faster kernel its stored tuning found for them (``tuner.graph_choice``) where
        its backend serves the problem here; None where the choice serves graphs too."""
        pick = graph_choice(self.trials(problem, device), chosen)
        return pick if pick is not None and _serves(pick.backend, problem, device) else None

    def _with_graph_kernel(self, problem: Problem, device: Device, choice: Choice, kernel):
        """``kernel`` (the choice's), paired with the one CUDA graphs should capture where its
        tuning found a faster kernel for them (``graph_pick``: ``ByMode``); ``kernel`` alone
        otherwise."""
        pick = self.graph_pick(problem, device, choice.label())
        graph = None if pick is None else _built(pick, problem, device, "for CUDA graphs")
        if graph is None:
            return kernel
        log.info("gemmtune: %s runs %s in eager calls and %s in CUDA graphs", problem.describe(), choice.label(),
                 pick.label())
        return ByMode(kernel, graph)

    def lean_pick(self, problem: Problem, device: Device, chosen: str) -> Trial | None:
        """What a host-bound model's eager calls of ``problem`` could run instead of its choice
        ``chosen`` (a trial's label): the Triton kernel its stored tuning timed
        (``tuner.lean_choice``) where its backend serves the problem here; else None."""
        pick = lean_choice(self.trials(problem, device), chosen)
        return pick if pick is not None and _serves(pick.backend, problem, device) else None

    def serve_lean(self, picks: Mapping[Problem, Trial], index: int) -> None:
        """From now on, eager calls of each problem on GPU ``index`` run its picked trial's
        kernel, and CUDA graphs capture what they captured before (``ByMode``): every caller of
        those GEMMs in this process, not one model's alone."""
        self._set_lean({DispatchKey.of(problem, index): trial for problem, trial in picks.items()})

    def drop_lean(self, problems: Sequence[Problem], index: int) -> None:
        """Eager calls of ``problems`` on GPU ``index`` run their choice's kernel again."""
        self._set_lean({DispatchKey.of(problem, index): None for problem in problems})

    def _set_lean(self, picks: Mapping[DispatchKey, Trial | None]) -> None:
        """Each key's lean pick set (None: dropped), its built kernel and every bound call dropped,
        so that the next call resolves it anew."""
        with self._lock:
            for key, trial in picks.items():
                if trial is None:
                    self.lean.pop(key, None)
                else:
                    self.lean[key] = trial
                self.kernels.pop(key, None)
            self.front.clear()

    def _with_lean(self, key: DispatchKey, kernel):
        """``kernel`` (a problem's, as resolved), its eager calls on the kernel ``serve_lean``
        picked for ``key`` where there is one: ``ByMode`` of that and what CUDA graphs capture."""
        pick = self.lean.get(key)
        eager = None if pick is None else _built(pick, key.problem(), current(key.device), "for eager calls")
        if eager is None:
            return kernel
        return ByMode(eager, kernel.graph if isinstance(kernel, ByMode) else kernel)

    def _stored(self, problem: Problem, device: Device) -> Iterator[Choice]:
        """The stored choices that can serve ``problem``: its own shape's first, then its bucket's."""
        target = bucket(problem, settings.bucket_policy())  # the problem whose result serves this one
        for candidate in dict.fromkeys((problem, target)):
            stored = self.store.get(device.fingerprint(), candidate.key())
            if stored is not None and _serves(stored.backend, problem, device):
                yield Choice.of(stored)

    def prepare(self, problems: Sequence[Problem], device: Device) -> None:
        """Tune in one batch the buckets of ``problems`` that the store has nothing for, as
        ``choice`` would tune them one by one on first sight: their candidates compile side by
        side, and a problem that differs from an earlier one in its epilogue alone tries that
        one's best candidates (``tune_many``). Nothing while deferring, in lookup mode, or for
        fewer than two; where the batch fails, ``choice`` tunes (or falls back) per problem."""
        if self.is_deferring() or settings.mode() == "lookup":
            return
        targets = dict.fromkeys(bucket(p, settings.bucket_policy()) for p in problems)
        missing = [t for t in targets if next(self._stored(t, device), None) is None]
        if len(missing) < 2:
            return
        try:
            results = tune_many(missing, device, self.store, TuneOptions())
        except Exception:  # noqa: BLE001 - a failed tuning must not break the user's program
            log.warning("gemmtune: tuning %d shapes together failed; tuning each alone", len(missing), exc_info=True)
            return
        for result in results:
            _say_tuned(result)

    def _fresh(self, problem: Problem, device: Device) -> Choice:
        """The choice for a problem the store has nothing for: cuBLAS while deferring or in mode
        ``lookup``, else a tuning of its bucket's problem, stored."""
        if self.is_deferring():
            return REFERENCE_CHOICE
        if settings.mode() == "lookup":  # logged once: the fallback is cached like any kernel
            log.info("gemmtune: no tuned kernel for %s on this device; using cuBLAS (GEMMTUNE_MODE=lookup)",
                     problem.describe())
            _append_miss(problem)
            return REFERENCE_CHOICE
        target = bucket(problem, settings.bucket_policy())
        try:
            result = tune_problem(target, device, options=TuneOptions())
        except Exception:  # noqa: BLE001 - a failed tuning must not break the user's program
            log.warning("gemmtune: tuning %s failed; using cuBLAS", target.describe(), exc_info=True)
            return REFERENCE_CHOICE
        self.store.put(result)
        _say_tuned(result)
        if not _serves(result.backend, problem, device):
            return REFERENCE_CHOICE
        return Choice.of(result)


def _say_tuned(result) -> None:
    log.info("gemmtune: tuned %s in %.1f s: %s %.4f ms vs cuBLAS %.4f ms",
             Problem.from_key(result.problem_key).describe(), result.tune_s, result.label(), result.time_ms,
             result.cublas_ms or float("nan"))


def _append_miss(problem: Problem) -> None:
    path = settings.misses_file()
    if path is not None:
        append_miss(path, entry(problem))


def _built(pick: Trial, problem: Problem, device: Device, purpose: str):
    """The kernel of ``pick`` (a stored trial chosen ``purpose``: for CUDA graphs, for eager
    calls) for ``problem``, or None where it cannot be built here (said once per resolve; the
    choice's kernel serves in its place)."""
    try:
        return backends.build(problem, pick.backend, pick.config, device)
    except Exception as exc:  # noqa: BLE001 - the choice serves in its place
        log.warning("gemmtune: %s, picked %s on %s, cannot be built here (%s)", pick.label(), purpose,
                    problem.describe(), exc)
        return None


def _serves(backend_name: str, problem: Problem, device: Device) -> bool:
    """Whether a result tuned for a shape's bucket can run the shape itself (the TMA kernel,
    say, cannot run rows that are not 16-byte aligned)."""
    return bool(backends.get(backend_name).candidates(problem, device))


DISPATCHER = Dispatcher()
