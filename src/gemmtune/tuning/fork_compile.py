"""Triton's front ends side by side, in forked children.

Each Triton compile starts with its front end: Python that walks the kernel's AST into MLIR,
holding the GIL, about 85 ms of a 0.2-0.3 s compile on the H200's host. The threads of
``compiler.compile_ahead`` therefore take at least N x 85 ms for N candidates (docs/tuning-time.md, compiling ahead).
A child forked from the process has an interpreter and a GIL of its own and starts in
milliseconds with everything imported, so children compile side by side.

A forked child must not use CUDA (the parent's context is not its own), so it neither launches
nor loads a binary: ``capture`` calls a candidate once in the parent with Triton's JIT cache
hook recording what Triton would compile (source, target, options) and compiling and launching
none of it; a ``Child`` compiles those kernels into Triton's on-disk cache and builds their
launchers (a C build each). The parent then builds and launches the candidate as before, and
Triton loads the binaries from its cache.

Best effort: a child that fails, or has not finished DEADLINE_S after it started, leaves its
kernels to the parent's own compile, which meets any error again and reports it. After a missed
deadline this process forks no more.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import select
import signal
import threading
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("gemmtune.tuning.fork_compile")

DEADLINE_S = 30.0
MESSAGE_BYTES = 1000  # a child's report: "ok" or its error, within one atomic pipe write

_local = threading.local()  # .found: the list a capture in this thread fills, else None
_hook_lock = threading.Lock()
_gave_up = False  # a child missed its deadline: compile in the parent only from now on


@dataclass(frozen=True)
class Source:
    """One kernel as ``triton.compile`` takes it."""

    src: object  # triton.compiler.ASTSource
    target: object  # triton.backends.compiler.GPUTarget
    options: dict


def usable() -> bool:
    """Whether compiles may go to forked children in this process now."""
    from triton import knobs

    from gemmtune import settings

    return hasattr(os, "fork") and not _gave_up and not knobs.compilation.always_compile and settings.compile_fork()


def capture(call: Callable[[], object]) -> list[Source]:
    """The kernels that ``call()`` has Triton compile and that Triton's on-disk cache lacks. The
    call runs with every JIT compile in this thread skipped: such a kernel is neither compiled
    nor launched (the JIT returns None), while kernels Triton holds in memory and torch's own
    operations run as usual."""
    _install_hook()
    _local.found = found = []
    try:
        call()
    finally:
        _local.found = None
    return found


class _Hook:
    """Triton's JIT cache hook (``knobs.runtime.jit_cache_hook``, called before each compile):
    in a thread that is capturing, records the kernel and skips it; in any other, defers to the
    hook it replaced. Installed at the first capture and left in place."""

    def __init__(self, chained) -> None:
        self.chained = chained

    def __call__(self, **kwargs):
        found = getattr(_local, "found", None)
        if found is None:
            return self.chained(**kwargs) if self.chained is not None else None
        source = _source(kwargs["fn"].jit_function, kwargs["compile"])
        if not on_disk(source):
            found.append(source)
        return True


def _install_hook() -> None:
    from triton import knobs

    with _hook_lock:
        current = knobs.runtime.jit_cache_hook
        if not isinstance(current, _Hook):
            knobs.runtime.jit_cache_hook = _Hook(current)


def _source(jit, compile: dict) -> Source:
    """What the JIT would hand ``triton.compile``, from what it hands its cache hook. The options
    come from their JSON form as ``JITFunction.preload`` reads them back (lists to tuples)."""
    target = jit.device_caches[compile["device"]][2]
    options = json.loads(compile["specialization_data"])["options"]
    options = {name: tuple(value) if isinstance(value, list) else value for name, value in options.items()}
    return Source(jit.ASTSource(jit, compile["signature"], compile["constants"], compile["configs"][0]), target,
                  options)


def on_disk(source: Source) -> bool:
    """Whether Triton's on-disk cache holds ``source``'s binary: the lookup ``triton.compile``
    makes before compiling."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    backend = make_backend(source.target)
    options = backend.parse_options(dict(source.options, **source.src.parse_options()))
    key = get_cache_key(source.src, backend, options, env_vars=get_cache_invalidating_env_vars())
    name = f"{source.src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name)
    return bool(group) and name in group


def launcher_key(source: Source) -> tuple | None:
    """What ``source``'s launcher (its C build) depends on before the kernel is compiled: its
    signature; None for a kernel with tensor descriptors, whose launcher also depends on the
    compiled kernel's descriptor metadata."""
    signature = tuple(source.src.signature.items())
    return None if any(str(kind).startswith("tensordesc") for _, kind in signature) else signature


class Child:
    """A forked child compiling ``sources`` into Triton's on-disk cache, building the launchers of
    ``early`` (sources with a ``launcher_key``) while it does, and after each compile the
    launcher of each source with tensor descriptors."""

    def __init__(self, sources: list[Source], early: list[Source] = ()) -> None:
        read, write = os.pipe()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12: fork with threads alive
                pid = os.fork()
        except OSError:  # no memory or processes left for a child: the caller compiles in-process
            os.close(read)
            os.close(write)
            raise
        if pid == 0:
            os.close(read)
            _child(sources, list(early), write)
        os.close(write)
        self.pid, self._read, self._started = pid, read, time.monotonic()
        self._lock = threading.Lock()  # several jobs' threads may wait on one child
        self.outcome: str | None = None

    def wait(self) -> str:
        """Until the child ends, or DEADLINE_S after it started (it is killed then): "ok" if it
        compiled every kernel, else why not."""
        global _gave_up
        with self._lock:
            if self.outcome is not None:
                return self.outcome
            left = DEADLINE_S - (time.monotonic() - self._started)
            ready, _, _ = select.select([self._read], [], [], max(0.0, left))
            if ready:
                report = _read_to_end(self._read)
                self.outcome = report.decode(errors="replace") or "ended without a report"
            else:
                os.kill(self.pid, signal.SIGKILL)
                _gave_up = True
                self.outcome = f"no report after {DEADLINE_S:.0f} s: killed; compiles stay in this process from now on"
                log.warning("a compile child %s", self.outcome)
            os.close(self._read)
            os.waitpid(self.pid, 0)
            return self.outcome


def _read_to_end(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, MESSAGE_BYTES):
        chunks.append(chunk)
    return b"".join(chunks)


def _child(sources: list[Source], early: list[Source], report: int) -> None:
    """The child's whole life: compile, report on the pipe, exit without running the parent's
    exit handlers (torch's would touch CUDA) or its garbage collector (it could free the
    parent's CUDA tensors)."""
    gc.disable()
    status, message = 1, "failed"
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # warnings the parent's own compile prints again if it must
        os.dup2(devnull, 2)
        import triton

        threads = [threading.Thread(target=_launcher, args=(source.src, _NO_METADATA)) for source in early]
        for thread in threads:
            thread.start()
        failures = []
        for source in sources:  # one kernel's failure (its job's thread meets it again) stops no other
            try:
                kernel = triton.compile(source.src, target=source.target, options=source.options)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            if launcher_key(source) is None:
                _launcher(kernel.src, kernel.metadata)
        for thread in threads:
            thread.join()
        status, message = (1, failures[0]) if failures else (0, "ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which compiles again
        message = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            os.write(report, message.encode(errors="replace")[:MESSAGE_BYTES])
        finally:
            os._exit(status)


# What a launcher reads of a compiled kernel's metadata, for a kernel without tensor descriptors,
# so that its launcher can be built while the kernel compiles.
_NO_METADATA = types.SimpleNamespace(tensordesc_meta=None, global_scratch_size=0, global_scratch_align=1,
                                     profile_scratch_size=0, profile_scratch_align=1,
                                     launch_cooperative_grid=False, launch_pdl=False)


def _launcher(src, metadata) -> None:
    """A kernel's launcher built into Triton's cache (a C build: about 0.3 s on the H200's
    host), where a GPU driver is active; nothing otherwise (a test compiling for a GPU on a
    machine without one), and nothing on failure: the parent builds it when it loads the
    kernel."""
    with contextlib.suppress(Exception):
        from triton.runtime import driver

        driver.active.launcher_cls(src, metadata)
