"""Probe: one model optimized without and with ``residual=True``, side by side in one process.

Per zoo model (``benchmarks/models.py``'s names, its inference cases): the model built from seed
0 (``models.built``: a zero-initialised head gets random weights). Then ``gemmtune.optimize``
on two copies, without the option, then with it, into the same store: a GEMM both sides perform
is tuned once, so what differs between them is the sides' own doing. Per side: each GEMM it
performs (problem, calls per forward, the backend serving it), its output's error against the
model's computed in float64, and the residual sites fused. The two sides and the model without
gemmtune are timed in the same interleaved rounds, eager and as CUDA graphs; then each is profiled
(``kernels``: where its GPU time goes, eager and replayed, ``models.kernel_times``), and its eager
forward's host time by Python function (``host``: cProfile over HOST_CALLS forwards, the costliest
HOST_TOP by their own time, in us per forward), and the copies its forward makes (``copies``: each aten
copy, clone or contiguous op with its operands' shapes and strides, counted).

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/residual_sides.py OUT.json [--models mixer_b16_224]
"""
import cProfile
import logging
import pstats
import statistics

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import models
from gemmtune.nn import residual
from gemmtune.serving.dispatch import DISPATCHER, DispatchKey

log = logging.getLogger("gemmtune.probe")
ROUNDS = 12
CALLS = 10
HOST_CALLS = 50
HOST_TOP = 25


def side(case, base: nn.Module, inputs: dict, on: bool) -> tuple[nn.Module, dict, dict]:
    tuned, kwargs, tune_s, said = models.tune_side(case, base, inputs, residual=on)
    index = torch.cuda.current_device()
    gemms = {problem.key(): {"calls": calls, "backend": models.backend_of(
        DISPATCHER.kernels.get(DispatchKey.of(problem, index)))}
        for problem, calls in models.recorded(case, tuned, kwargs, deferring=False)}
    return tuned, kwargs, {"tune_s": tune_s, "said": said, "gemms": gemms,
                           "residual_fused": list(residual.fused(tuned)) if on else None}


def timed(steps: list) -> list[float]:
    """Each step's median ms per call, the steps interleaved round by round."""
    times = [[] for _ in steps]
    for _ in range(ROUNDS):
        for i, step in enumerate(steps):
            times[i].append(models.loop_ms(step, CALLS, "cuda"))
    return [statistics.median(t) for t in times]


def host_profile(step) -> list:
    """[function, calls, own us, cumulative us] per forward of ``step``'s costliest functions."""
    step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(HOST_CALLS):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = [[f"{name[0].rsplit('/', 2)[-1]}:{name[1]}:{name[2]}", calls / HOST_CALLS, own / HOST_CALLS * 1e6,
             cumulative / HOST_CALLS * 1e6] for name, (_, calls, own, cumulative, _) in stats.items()]
    return sorted(rows, key=lambda row: -row[2])[:HOST_TOP]


class Copies(TorchDispatchMode):
    """Counts each copying aten op by its operands' shapes and strides."""

    OPS = ("aten.copy_", "aten.clone", "aten.contiguous", "aten._to_copy", "aten.native_layer_norm")

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(self.OPS):
            shapes = [(tuple(a.shape), a.stride()) for a in args if isinstance(a, torch.Tensor)]
            key = f"{name} {shapes}"
            self.seen[key] = self.seen.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def copies(step) -> dict[str, int]:
    with Copies() as mode:
        step()
    return mode.seen


def probe(case, model: nn.Module, inputs: dict) -> dict:
    reference, why = models.float64_output(case, model, inputs)
    sides, steps = {}, {"torch": models.step_of(case, model, model, case.kwargs(model, inputs))}
    tuned = {}
    for name, on in (("off", False), ("on", True)):
        tuned[name], kwargs, sides[name] = side(case, model, inputs, on)
        steps[name] = models.step_of(case, tuned[name], tuned[name], kwargs)
    with torch.no_grad():
        for name in ("off", "on"):
            out = models.first_tensor(steps[name]()).float()
            sides[name]["ref_err"] = models.rel_err(out, reference) if reference is not None else why
        base_out = models.first_tensor(steps["torch"]()).float()
        eager = dict(zip(steps, timed(list(steps.values()))))
        graphs = {name: models.captured(step)[0] for name, step in steps.items()}
        graph = dict(zip(graphs, timed(list(graphs.values()))))
        kernels = {name: {"eager": models.kernel_times(steps[name], top=12),
                          "graph": models.kernel_times(graphs[name], top=12)} for name in steps}
        host = {name: host_profile(step) for name, step in steps.items()}
        copied = {name: copies(step) for name, step in steps.items()}
    sides["on"]["residual_fused_after"] = list(residual.fused(tuned["on"]))  # the sites have chosen by now
    off, on = sides["off"]["gemms"], sides["on"]["gemms"]
    differ = {key: {"off": off.get(key), "on": on.get(key)} for key in off.keys() | on.keys()
              if off.get(key) != on.get(key)}
    row = {"model": case.model, "batch": case.batch,
           "torch_ref_err": models.rel_err(base_out, reference) if reference is not None else why,
           "eager_ms": eager, "graph_ms": graph, "kernels": kernels, "host": host, "copies": copied, "sides": sides,
           "gemms_differing": differ}
    log.warning("%s: eager %s, graph %s, errors torch %s off %s on %s, %d GEMMs differ", case.model,
                {k: round(v, 3) for k, v in eager.items()}, {k: round(v, 3) for k, v in graph.items()},
                row["torch_ref_err"], sides["off"]["ref_err"], sides["on"]["ref_err"], len(differ))
    models.release("cuda")
    return row


def main() -> None:
    args = models.probe_parser(__doc__, "mixer_b16_224").parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    models.probe_rows(args.out, args.models, probe)


if __name__ == "__main__":
    main()
