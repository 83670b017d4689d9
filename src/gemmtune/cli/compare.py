"""``gemmtune compare``: one model, run in eager mode, under each torch.compile mode, through
gemmtune (with and without a CUDA graph) and through ``gemmtune.compile``, side by side in one
process: setup time from empty caches, GPU time, host time per call (with its ratio to eager's,
timed in alternating rounds) and the largest error against a float64 run. By default the seeds'
MLP (Linear 1024->1024, ReLU, Linear 1024->1024 on a batch of 256), where max-autotune once made
a model 29x slower than eager.

On a machine without a GPU only eager and gemmtune run (the layers fall back to torch) and the
timings are CPU timings; the compile modes are skipped, since timing them there says nothing
about the GPU.

Setup is what each mode's own work costs in a process that has compiled something before: a
throwaway torch.compile runs first, so inductor's start-up (its compile workers, 8-9 s on an
H200's host) and Triton's (the C build of its driver) land on no mode. Without it the first
compile mode paid them all and the modes after it none.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from gemmtune.problem import torch_dtypes

MODES = ("eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs",
         "gemmtune", "gemmtune+cudagraph", "gemmtune.compile")
COMPILE_MODES = MODES[1:5]
DTYPES = torch_dtypes()


@dataclass(frozen=True)
class Row:
    mode: str
    setup_s: float
    gpu_ms: float | None  # median event time per call; None on the CPU
    host_us_per_call: float
    host_vs_eager: float  # median per-round ratio of host time to eager's, timed in alternating rounds
    max_rel_err: float


def seed_mlp(features: int = 1024) -> nn.Module:
    return nn.Sequential(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, features))


def load_model(spec: str, features: int = 1024) -> nn.Module:
    """``seed-mlp`` (``features`` wide: the input's last dimension), or ``package.module:factory``
    naming a function that returns the model."""
    if spec == "seed-mlp":
        return seed_mlp(features)
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"--model {spec!r}: expected 'seed-mlp' or 'package.module:factory'")
    factory = getattr(importlib.import_module(module_name), attr)
    model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def run(model: nn.Module, x: torch.Tensor, modes=MODES, *, calls: int = 200, rounds: int = 15,
        on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Each mode's Row, in order; a model copy per mode, so no mode sees another's changes.
    Host time is timed in ``rounds`` alternating with eager's (a GPU machine's host speed
    drifts by tens of percent within a run: only a ratio timed side by side compares; with five
    rounds the median ratio of one fp32 run read 1.01 while the two medians read 59 and 70 us)."""
    on_gpu = x.device.type == "cuda"
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"compare: mode {mode!r} is unknown; accepted: {', '.join(MODES)}")
    with torch.no_grad():
        model = model.to(device=x.device, dtype=x.dtype)
        reference = copy.deepcopy(model).double()(x.double())  # the same rounded weights, exact math
        eager, _ = prepare("eager", copy.deepcopy(model), x)
        if on_gpu and any(mode != "eager" for mode in modes):
            _start_compilers(x)
        rows = []
        for mode in modes:
            if not on_gpu and mode not in ("eager", "gemmtune"):
                continue
            fn, setup_s = prepare(mode, copy.deepcopy(model), x)
            out = fn()
            err = float((out.double() - reference).norm() / reference.norm())
            pairs = [(_host_us(fn, calls), _host_us(eager, calls)) for _ in range(rounds)]
            row = Row(mode, setup_s, _gpu_ms(fn) if on_gpu else None, statistics.median(p[0] for p in pairs),
                      statistics.median(p[0] / p[1] for p in pairs), err)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def prepare(mode: str, model: nn.Module, x: torch.Tensor) -> tuple[Callable[[], torch.Tensor], float]:
    """A zero-argument call of ``model`` on ``x`` in ``mode``, and what setting it up cost."""
    import gemmtune

    started = time.perf_counter()
    if mode == "eager":
        fn = lambda: model(x)  # noqa: E731
    elif mode in COMPILE_MODES or mode == "gemmtune.compile":
        torch._dynamo.reset()
        compiled = gemmtune.compile(model) if mode == "gemmtune.compile" else \
            torch.compile(model, mode=None if mode == "default" else mode)
        fn = lambda: compiled(x)  # noqa: E731
        fn()  # compiles and autotunes (gemmtune.compile: tunes what the store lacks)
    else:
        gemmtune.optimize(model, (x,))
        fn = lambda: model(x)  # noqa: E731
        fn()
        if mode == "gemmtune+cudagraph":
            fn = _graphed(fn)
    _sync(x)
    return fn, time.perf_counter() - started


def _start_compilers(x: torch.Tensor) -> None:
    """Start inductor and Triton in this process, on a function no mode shares: see the module's
    docstring."""
    torch._dynamo.reset()
    torch.compile(lambda t: (t * 2).relu())(x)
    torch._dynamo.reset()
    _sync(x)


def _graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    from gemmtune.tuning import measure

    replay = measure.graphed({"model": fn})["model"]
    if replay is fn:
        raise RuntimeError("compare: the gemmtune model cannot be captured in a CUDA graph (see the log)")
    return replay


def _gpu_ms(fn) -> float:
    from gemmtune.device import current
    from gemmtune.tuning import measure

    return measure.measure({"model": fn}, current(), graphs=False)["model"].median


def _host_us(fn, calls: int) -> float:
    from gemmtune.device import current
    from gemmtune.tuning import measure

    return measure.host_loop_ms(fn, current(), calls=calls) * 1e3


def _sync(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize()


def document(rows: list[Row], *, model: str, dtype: str, input_shape, device: str) -> dict:
    """The ``compare`` file of RESULTS.md."""
    import triton

    from gemmtune.version import __version__

    return {"kind": "compare", "device": device, "torch": torch.__version__, "triton": triton.__version__,
            "gemmtune": __version__, "date": datetime.date.today().isoformat(), "model": model, "dtype": dtype,
            "input_shape": list(input_shape), "gpu_timings": device != "cpu", "rows": [asdict(r) for r in rows]}


def chart(doc: dict, path) -> None:
    """Bars of host time per call and GPU time per mode, setup time written on each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    fig, (host, gpu) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["mode"] for r in rows]
    host.barh(names, [r["host_us_per_call"] for r in rows], color="tab:blue")
    host.set_xlabel("host time per call (µs, synchronous loop)")
    for i, r in enumerate(rows):
        host.annotate(f" setup {r['setup_s']:.1f} s", (r["host_us_per_call"], i), va="center", fontsize=8)
    host.invert_yaxis()
    if all(r["gpu_ms"] is not None for r in rows):
        gpu.barh(names, [r["gpu_ms"] * 1e3 for r in rows], color="tab:green")
        gpu.set_xlabel("GPU time per call (µs, events)")
        gpu.invert_yaxis()
    else:
        gpu.set_axis_off()
        gpu.text(0.5, 0.5, "CPU run: no GPU timings", ha="center", va="center")
    fig.suptitle(f"{doc['model']} ({doc['dtype']}, input {doc['input_shape']}) on {doc['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
