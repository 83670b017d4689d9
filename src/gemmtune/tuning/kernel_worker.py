"""A user's kernel tuned in a child process (``gemmtune.autotune(isolate=True)``): a config that
faults (an illegal address poisons a CUDA context for good), kills its process or hangs becomes a
failed trial, and the user's process never runs a config it has not seen run.

The child gets plain data: where to import the decorated kernel from (its module and name: the
child imports the same object, hooks and reference included), each tensor argument's bytes in a
file of its own with its dtype, shape, strides and device, the other arguments' values, and each
config's grid, computed in the parent (a grid function is code of the caller's). It rebuilds the
call on copies, so the caller's tensors are never touched, tunes it as in process
(``autotuner.tune``), and answers with the trials as JSON. Before each launch it writes the
config's index to a progress file: where the child dies or hangs, the parent reads which config
was running, records it as failed, and starts a fresh child for the configs left.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from gemmtune.device import Device
from gemmtune.kernel_config import BACKEND, KernelConfig
from gemmtune.results import Status, Trial, TuneResult
from gemmtune.shapes import KERNEL_CALL
from gemmtune.tuning import autotuner
from gemmtune.tuning.processes import main_hidden

log = logging.getLogger("gemmtune")

TIMEOUT_S = 600.0  # a whole tuning in the child; a config that hangs ends it
SCALARS = (bool, int, float, str, type(None))


@runtime_checkable
class Tunable(Protocol):
    """What the child needs of the decorated kernel (``gemmtune.autotune.Autotuned``)."""

    configs: list
    data: list[KernelConfig]
    module: str | None  # the module of the kernel's Python function

    def tuning_call(self, launch, named: dict) -> autotuner.Call: ...

    def tuning_options(self) -> dict: ...

    def launch_for_tuning(self, config, args: tuple, kwargs: dict, grid, named: dict) -> None: ...


@dataclass
class Job:
    """One call to tune in a child, as plain data (``to_dict``) and the files it names."""

    module: str
    qualname: str
    key: str
    positional: list[str]
    keywords: list[str]
    scalars: dict[str, Any]
    tensors: dict[str, dict]  # name -> file, dtype, shape, stride, span, device
    grids: dict[int, list[int]]  # config index -> grid
    candidates: list[int]
    progress: str


def where(obj: Tunable) -> tuple[str, str] | None:
    """The module and the name in it that hold ``obj`` (the decorated kernel), so that another
    process imports the same object; None where none does (a kernel made in ``__main__`` or in a
    function, or held by no module's name)."""
    module_name = obj.module
    if not module_name or module_name == "__main__":
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    names = [name for name, value in vars(module).items() if value is obj]
    return (module_name, names[0]) if names else None


def unsupported(named: dict) -> str | None:
    """Why the call's arguments cannot travel to a child, or None."""
    for name, value in named.items():
        if not isinstance(value, (torch.Tensor, *SCALARS)):
            return f"argument {name} is a {type(value).__name__} (tensors and plain values travel)"
    return None


def tune(kernel: Tunable, place: tuple[str, str], args: tuple, kwargs: dict, grid, named: dict,
         candidates: list[int], device: Device, key: str, timeout_s: float | None = None) -> tuple[TuneResult | None, Any]:
    """Tune the call in children until one finishes (see the module's docstring); the TuneResult
    to store (None where none can be trusted) and the triton.Config chosen. ``timeout_s``: a
    child's whole tuning (TIMEOUT_S by default)."""
    started = time.perf_counter()
    timeout_s = timeout_s or TIMEOUT_S
    failed: list[Trial] = []
    left = list(candidates)
    with tempfile.TemporaryDirectory(prefix="gemmtune-kernel-") as folder:
        job = _job(kernel, place, key, args, kwargs, grid, named, left, Path(folder))
        while left:
            job.candidates = left
            reply, why, status = _run_child(job, device, timeout_s)
            if reply is not None:
                return _result(kernel, reply, failed, device, key, started)
            index = _last_running(job.progress)
            if index is None or index not in left:
                log.warning("gemmtune.autotune: the tuning process of %s failed before running a config (%s); "
                            "the first config is served", key, why)
                return None, kernel.configs[candidates[0]]
            failed.append(Trial(BACKEND, kernel.data[index].as_dict(), status, reason=f"{why} while running it"))
            left.remove(index)
            log.warning("gemmtune.autotune: config %s of %s %s; tuning goes on without it",
                        kernel.data[index].label(), key, why)
    log.warning("gemmtune.autotune: every config of %s failed in its tuning process; the first config is served", key)
    return None, kernel.configs[candidates[0]]


def _job(kernel: Tunable, place, key: str, args: tuple, kwargs: dict, grid, named: dict, left: list[int],
         folder: Path | None) -> Job:
    """The call as plain data; each tensor's bytes in a file of ``folder``, or only its layout
    where ``folder`` is None (a recorded call: ``tune_recorded`` fills fresh tensors)."""
    tensors = {name: _saved(value, None if folder is None else folder / f"{i}.bin")
               for i, (name, value) in enumerate(named.items()) if isinstance(value, torch.Tensor)}
    scalars = {name: value for name, value in named.items() if not isinstance(value, torch.Tensor)}
    grids = {i: _grid(grid, {**named, **kernel.configs[i].all_kwargs()}) for i in left}
    positional = list(named)[:len(args)]
    return Job(place[0], place[1], key, positional, list(kwargs), scalars, tensors, grids, left,
               "" if folder is None else str(folder / "progress"))


def recorded_call(kernel: Tunable, key: str, args: tuple, kwargs: dict, grid, named: dict,
                  candidates: list[int]) -> dict | None:
    """A call of ``kernel`` as a misses file's line (``shapes.KERNEL_CALL``): where to import the
    kernel from, its arguments' layouts and values, the configs to try (``candidates``, pruned
    as the call was) and each one's grid; None where it cannot be (a kernel no other process can
    import, an argument that is not a tensor or a plain value)."""
    place = where(kernel)
    if place is None or unsupported(named) is not None:
        return None
    job = _job(kernel, place, key, args, kwargs, grid, named, candidates, None)
    return {"kind": KERNEL_CALL, **{k: v for k, v in vars(job).items() if k != "progress"}}


def tune_recorded(call: dict, device: Device) -> tuple[TuneResult | None, str]:
    """Tune a recorded call (``recorded_call``) in this process on fresh tensors of its layouts
    (floating point: normal values; integers and booleans: zeros, a safe index): the result to
    store under the key the serving process computed, and the kernel's name."""
    started = time.perf_counter()
    kernel = _resolve(call["module"], call["qualname"])
    if not isinstance(kernel, Tunable):
        raise TypeError(f"{call['module']}.{call['qualname']} is a {type(kernel).__name__}, "
                        "not a gemmtune.autotune kernel")
    candidates = [i for i in call["candidates"] if i < len(kernel.configs)]
    reply = _tuned({**call, "candidates": candidates, "progress": ""}, torch.cuda.current_device()
                   if not device.interpreter else None)
    result, _ = _result(kernel, reply, [], device, call["key"], started)
    return result, f"{call['module']}.{call['qualname']}"


def _grid(grid, meta: dict) -> list[int]:
    value = grid(meta) if callable(grid) else grid
    value = tuple(value) + (1,) * (3 - len(value))
    return [int(v) for v in value]


def _saved(t: torch.Tensor, path: Path | None) -> dict:
    """The tensor's layout, and its bytes from its first element to its last reachable one in
    ``path`` (none where ``path`` is None)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    spec = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "stride": list(t.stride()),
            "span": span, "device": t.device.type}
    if path is not None:
        flat = torch.as_strided(t, (span,), (1,), t.storage_offset()).contiguous().cpu()
        path.write_bytes(flat.view(torch.uint8).numpy().tobytes() if span else b"")
        spec["file"] = str(path)
    return spec


def _loaded(spec: dict) -> torch.Tensor:
    dtype = getattr(torch, spec["dtype"])
    device = "cuda" if spec["device"] == "cuda" and torch.cuda.is_available() else "cpu"
    if "file" not in spec:  # a recorded call's: fresh values
        flat = torch.randn(spec["span"], device=device).to(dtype) if dtype.is_floating_point \
            else torch.zeros(spec["span"], dtype=dtype, device=device)
        return flat.as_strided(spec["shape"], spec["stride"], 0)
    data = Path(spec["file"]).read_bytes()
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype) if data else torch.empty(0, dtype=dtype)
    return flat.to(device).as_strided(spec["shape"], spec["stride"], 0)


def _run_child(job: Job, device: Device, timeout_s: float) -> tuple[dict | None, str, Status]:
    """The child's reply, or None, why it gave none and the status of the config it was running."""
    Path(job.progress).write_text("")
    context = multiprocessing.get_context("spawn")
    conn, child_end = context.Pipe()
    index = torch.cuda.current_device() if not device.interpreter else None
    process = context.Process(target=serve, args=(child_end, json.dumps(vars(job)), index), daemon=True)
    with main_hidden():
        process.start()
    child_end.close()
    try:
        if not conn.poll(timeout_s):
            return None, f"gave no answer within {timeout_s:.0f} s", Status.TIMEOUT
        try:
            reply = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            process.join(timeout=10)
            return None, f"ended its process (exit code {process.exitcode})", Status.LAUNCH_ERROR
        if "error" in reply:
            return None, f"failed: {reply['error']}", Status.LAUNCH_ERROR
        return reply, "", Status.OK
    finally:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)
        conn.close()


def _last_running(progress: str) -> int | None:
    text = Path(progress).read_text().strip() if Path(progress).exists() else ""
    return int(text) if text.isdigit() else None


def _result(kernel: Tunable, reply: dict, failed: list[Trial], device: Device, key: str,
            started: float) -> tuple[TuneResult | None, Any]:
    trials = tuple(failed) + tuple(Trial.from_dict(t) for t in reply["trials"])
    chosen = reply["chosen"]
    if chosen is None:
        return None, kernel.configs[0]
    best = min((t for t in trials if t.ok and t.timing is not None), key=lambda t: t.timing.median)
    return TuneResult(key, device.fingerprint(), BACKEND, best.config, best.timing.median, None,
                      time.perf_counter() - started, best.rel_err, trials,
                      gpu_timings=not device.interpreter), kernel.configs[chosen]


def _resolve(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def serve(conn, job_text: str, device_index: int | None) -> None:
    """The child: rebuild the call, tune it, answer with the trials."""
    from gemmtune import settings

    os.environ["TRITON_CACHE_DIR"] = str(settings.triton_cache_dir())  # before triton is imported
    try:
        reply = _tuned(json.loads(job_text), device_index)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which serves the first config
        reply = {"error": f"{type(error).__name__}: {error}"[:500]}
    conn.send_bytes(json.dumps(reply).encode())


def _tuned(job: dict, device_index: int | None) -> dict:
    from gemmtune.device import current

    if device_index is not None:
        torch.cuda.set_device(device_index)
    kernel = _resolve(job["module"], job["qualname"])
    named = dict(job["scalars"]) | {name: _loaded(spec) for name, spec in job["tensors"].items()}
    named = {name: named[name] for name in job["positional"] + job["keywords"]}
    args = tuple(named[name] for name in job["positional"])
    kwargs = {name: named[name] for name in job["keywords"]}
    grids = {int(i): tuple(g) for i, g in job["grids"].items()}
    progress = open(job["progress"] or os.devnull, "w")  # noqa: SIM115 - written until the process ends
    running = [None]

    def launch(config) -> None:
        index = kernel.configs.index(config)
        if running[0] != index and job["progress"]:
            running[0] = index
            progress.seek(0)
            progress.write(f"{index}\n")
            progress.truncate()
            progress.flush()
            os.fsync(progress.fileno())
        kernel.launch_for_tuning(config, args, kwargs, grids[index], named)

    call = kernel.tuning_call(launch, named)
    candidates = [(kernel.data[i], kernel.configs[i]) for i in job["candidates"]]
    result, config = autotuner.tune(call, candidates, current(device_index), job["key"], **kernel.tuning_options())
    return {"trials": [t.to_dict() for t in result.trials] if result is not None else [],
            "chosen": None if result is None else kernel.configs.index(config)}
