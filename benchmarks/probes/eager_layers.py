"""Probe: why ``optimize``'s eager check sends a model's served layers back to torch where its
graph check keeps them (docs/models.md, shortfalls: BERT-base, the Whisper encoder, torchvision's
ViT-B). A model of the zoo (``benchmarks/models.py``'s names, its first bf16 inference case) goes
through ``optimize(check=False)``, so every layer gemmtune serves serves its eager calls too.
Then, per served layer, on the input the model gives it:

- the kernels the dispatcher built for its problem (the eager one and, where tuning found another
  for CUDA graphs, the graph one: ``ByMode``);
- GPU us per call of the served eager call and of torch's forward of the layer (F.linear and its
  activation), each timed over calls queued behind a GPU sleep (all launched before the GPU
  reaches them: the kernels' time alone), and the host us per call of each;
- the GPU us per call of both replayed as CUDA graphs (the served side then runs its graph kernel).

And the whole model: base and tuned forwards' GPU ms per call queued behind a sleep, and their
host ms per call.

    PYTHONPATH=src python3 benchmarks/probes/eager_layers.py OUT.json [--model bert-base]
"""
import argparse
import copy
import json
import logging
import sys
import time
from pathlib import Path

import torch

import gemmtune
from gemmtune.nn.keep import TakenOver
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.serving.modes import ByMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import BF16, backend_of, entry_of  # noqa: E402

log = logging.getLogger("eager_layers")
CALLS = 40
SLEEP_CYCLES = 300_000_000  # about 0.2 s of GPU time: longer than the host takes to queue CALLS calls


def queued(fn, calls: int = CALLS) -> tuple[float, float]:
    """(GPU us, host us) per call of ``calls`` calls launched while the GPU sleeps."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls, host * 1e6 / calls


def graphed_us(fn, calls: int = CALLS) -> float | str:
    """GPU us per call of ``fn`` captured ``calls`` times in a CUDA graph and replayed; the error
    where it cannot be captured."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / calls
    except Exception as exc:  # noqa: BLE001 - recorded: a layer that cannot be captured is a finding
        return f"{type(exc).__name__}: {exc}"


def kernels() -> list[dict]:
    """Every problem the dispatcher built a kernel for: its eager and graph kernels' backends."""
    rows = []
    for key, kernel in DISPATCHER.kernels.items():
        pair = (kernel.eager, kernel.graph) if isinstance(kernel, ByMode) else (kernel, kernel)
        rows.append({"problem": key.problem.describe(), "eager": backend_of(pair[0]),
                     "eager_kernel": repr(getattr(pair[0], "_config", None)), "graph": backend_of(pair[1]),
                     "graph_kernel": repr(getattr(pair[1], "_config", None))})
    return rows


def layers(tuned, run) -> list[dict]:
    """Per served layer (its first call's input): served and torch's forward, queued and graphed."""
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, a: inputs.setdefault(m, a[0]))
             for m in tuned.modules() if isinstance(m, TakenOver)]
    run()
    for hook in hooks:
        hook.remove()
    rows = []
    for layer, x in inputs.items():
        if not hasattr(layer, "torch_forward"):  # attention: no single product to hold torch's against
            continue
        served, plain = (lambda: layer(x)), (lambda: layer.torch_forward(x))  # noqa: E731
        (served_gpu, served_host), (plain_gpu, plain_host) = queued(served), queued(plain)
        rows.append({"layer": type(layer).__name__, "input": list(x.shape), "contiguous": x.is_contiguous(),
                     "activation": getattr(layer, "activation", "none"),
                     "served_gpu_us": served_gpu, "torch_gpu_us": plain_gpu,
                     "served_host_us": served_host, "torch_host_us": plain_host,
                     "served_graph_us": graphed_us(served), "torch_graph_us": graphed_us(plain)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--model", default="bert-base", help="a name of benchmarks/models.py's zoo")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    case = next((c for c in entry_of(args.model).cases(args.model, False)
                 if c.phase == "inference" and c.dtype == BF16 and c.positional), None)
    if case is None:
        parser.error(f"--model {args.model}: no bf16 inference case whose inputs are the model's arguments")
    base = entry_of(args.model).build(False).cuda().to(case.dtype).eval()
    shared = case.inputs("cuda", case.dtype)
    tuned = copy.deepcopy(base)
    base_kwargs, tuned_kwargs = case.kwargs(base, shared), case.kwargs(tuned, shared)
    with torch.no_grad():
        gemmtune.optimize(tuned, tuple(tuned_kwargs.values()), check=False)
        run_base, run_tuned = (lambda: base(**base_kwargs)), (lambda: tuned(**tuned_kwargs))  # noqa: E731
        for fn in (run_base, run_tuned):
            queued(fn, 3)
        forwards = {name: queued(fn, 10) for name, fn in (("base", run_base), ("tuned", run_tuned))}
        out = {"model": args.model, "case": case.label(), "device": torch.cuda.get_device_name(),
               "forward_gpu_ms": {k: v[0] / 1e3 for k, v in forwards.items()},
               "forward_host_ms": {k: v[1] / 1e3 for k, v in forwards.items()},
               "kernels": kernels(), "layers": layers(tuned, run_tuned)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    log.info("forward GPU ms %s, host ms %s", out["forward_gpu_ms"], out["forward_host_ms"])
    for row in out["layers"]:
        log.info("%s", row)


if __name__ == "__main__":
    main()
