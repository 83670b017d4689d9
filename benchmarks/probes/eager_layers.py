"""Probe: why ``optimize``'s eager check sends a model's served layers back to torch where its
graph check keeps them (docs/models.md, shortfalls: BERT-base, the Whisper encoder, torchvision's
ViT-B). A model of the zoo (``benchmarks/models.py``'s names, its first bf16 inference case) goes
through ``optimize(check=False)``, so every layer gemmtune serves serves its eager calls too
(with ``--torch-eager``, every layer as ``optimize`` leaves one whose eager check lost: its eager
calls torch's forward behind the layer's mode checks, which the host ratio then times).
Then, per served layer, on the input the model gives it:

- the kernels the dispatcher built for its problem (the eager one and, where tuning found another
  for CUDA graphs, the graph one: ``ByMode``);
- GPU us per call of the served eager call and of its torch twin's (the ``nn.Linear`` it stands
  for, sharing its parameters, then its activation), each timed over calls queued behind a GPU
  sleep (all launched before the GPU reaches them: the kernels' time alone);
- the host us per call of each, and the median of their per-round ratios, over alternated rounds;
- the GPU us per call of both replayed as CUDA graphs (the served side then runs its graph kernel).
- for attention (``nn.MultiheadAttention``, whose inference calls torch runs as one fused op), torch's
  call with that fused path turned off too: its GPU time, and its host time against the fused call's.

Whole forwards are not timed here (``benchmarks/models.py`` does): queued behind a sleep, a
model's forwards fill the launch queue and the host waits for the GPU.

    PYTHONPATH=src python3 benchmarks/probes/eager_layers.py OUT.json [--model bert-base] [--torch-eager]
"""
import argparse
import copy
import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

import gemmtune
from gemmtune import activation as activations
from gemmtune.nn.keep import TakenOver
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.serving.modes import ByMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import BF16, backend_of, entry_of  # noqa: E402

from lt_call import host_us  # noqa: E402  (this folder, the script's own)

log = logging.getLogger("eager_layers")
CALLS = 40
ROUNDS = 15
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
        rows.append({"problem": key.problem().describe(), "eager": backend_of(pair[0]),
                     "eager_kernel": repr(getattr(pair[0], "_config", None)), "graph": backend_of(pair[1]),
                     "graph_kernel": repr(getattr(pair[1], "_config", None))})
    return rows


def host_ratio(served, plain, rounds: int = ROUNDS, calls: int = CALLS) -> tuple[float, float, float]:
    """(served host us, torch host us, median of the rounds' served/torch ratios): each round
    times ``calls`` launches of one side then the other (the order alternating), the GPU drained
    between sides, so that both queue on the same idle GPU and the same host state."""
    pairs = []
    for r in range(rounds):
        if r % 2:
            t, s = host_us(plain, calls), host_us(served, calls)
        else:
            s, t = host_us(served, calls), host_us(plain, calls)
        pairs.append((s, t))
    return (statistics.median(s for s, _ in pairs), statistics.median(t for _, t in pairs),
            statistics.median(s / t for s, t in pairs))


def torch_twin(layer):
    """``layer``'s call as the torch module it stands for, sharing its parameters, with its fused
    activation run after it: a model's call of the layer before ``optimize`` (the module call
    included, which ``torch_forward`` skips). It takes the layer's arguments."""
    twin = copy.copy(layer)  # the same parameter dict: nothing copied
    twin.__class__ = layer.torch_class
    act = getattr(layer, "activation", "none")
    if act == "none":
        return twin
    return lambda *args, **kwargs: activations.apply(twin(*args, **kwargs), act, inplace=False)


def without_fastpath(call):
    """``call`` with torch's fused inference path of ``nn.MultiheadAttention`` turned off: the
    projections, attention and reshapes it runs one by one from Python instead."""
    def slow(*args, **kwargs):
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            return call(*args, **kwargs)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    return slow


def layers(tuned, run) -> list[dict]:
    """Per served layer (its first call's arguments): the served call and its torch twin's, GPU
    time queued and graphed, host time in alternated rounds; for attention, torch's call without
    its fused inference path too (host and GPU time)."""
    inputs = {}

    def keep_input(module, args, kwargs) -> None:  # None: a pre-hook's return value would replace the args
        inputs.setdefault(module, (args, kwargs))

    hooks = [m.register_forward_pre_hook(keep_input, with_kwargs=True) for m in tuned.modules()
             if isinstance(m, TakenOver)]
    run()
    for hook in hooks:
        hook.remove()
    rows = []
    for layer, (args, kwargs) in inputs.items():
        twin_call = torch_twin(layer)
        served, plain = (lambda: layer(*args, **kwargs)), (lambda: twin_call(*args, **kwargs))  # noqa: E731
        served_host, plain_host, ratio = host_ratio(served, plain)
        x = args[0] if args else next(iter(kwargs.values()))
        row = {"layer": type(layer).__name__, "input": list(x.shape), "contiguous": x.is_contiguous(),
               "activation": getattr(layer, "activation", "none"),
               "served_gpu_us": queued(served)[0], "torch_gpu_us": queued(plain)[0],
               "served_host_us": served_host, "torch_host_us": plain_host, "host_ratio": ratio,
               "served_graph_us": graphed_us(served), "torch_graph_us": graphed_us(plain)}
        if isinstance(layer, torch.nn.MultiheadAttention):
            slow = without_fastpath(twin_call)
            slow_gpu, _ = queued(lambda: slow(*args, **kwargs))
            slow_host, fast_host, slow_ratio = host_ratio(lambda: slow(*args, **kwargs), plain)
            row.update({"torch_slowpath_gpu_us": slow_gpu, "torch_slowpath_host_us": slow_host,
                        "torch_fastpath_host_us": fast_host, "slowpath_host_ratio": slow_ratio})
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--model", default="bert-base", help="a name of benchmarks/models.py's zoo")
    parser.add_argument("--torch-eager", action="store_true",
                        help="every served layer's eager calls run torch's forward (torch_when_capturing False)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    case = next((c for c in entry_of(args.model).cases(args.model, False)
                 if c.phase == "inference" and c.dtype == BF16 and c.positional), None)
    if case is None:
        parser.error(f"--model {args.model}: no bf16 inference case whose inputs are the model's arguments")
    tuned = entry_of(args.model).build(False).cuda().to(case.dtype).eval()
    tuned_kwargs = case.kwargs(tuned, case.inputs("cuda", case.dtype))
    with torch.no_grad():
        gemmtune.optimize(tuned, tuple(tuned_kwargs.values()), check=False)
        if args.torch_eager:
            for layer in tuned.modules():
                if isinstance(layer, TakenOver):
                    layer.torch_when_capturing = False
        out = {"kind": "eager-layers", "date": datetime.date.today().isoformat(), "torch": torch.__version__,
               "gemmtune": gemmtune.__version__, "model": args.model, "case": case.label(),
               "device": torch.cuda.get_device_name(), "torch_eager": args.torch_eager}
        out["layers"] = layers(tuned, lambda: tuned(**tuned_kwargs))
        out["kernels"] = kernels()  # after the layers' calls: optimize drops the kernels it built
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for row in out["layers"]:
        log.info("%s", row)


if __name__ == "__main__":
    main()
