"""Probe: where a model's eager forward through ``gemmtune.optimize`` spends its host time.

A timm model (bf16, random weights) optimized on its example as the models benchmark does, then:
paired eager rounds of queued forwards (gemmtune's copy against the untouched model, each round's
ratio kept, to see whether a slow reading is every round or a few); the host time to queue one
forward and its GPU time replayed from a CUDA graph; each side's costliest operators on the host
(torch.profiler, CPU time per forward); the garbage collections in each side's rounds, and the
rounds again with the collector off (each round's wall and host ms per side kept); the threads
and child processes alive after tuning; and per layer gemmtune kept, its call's host time against
``F.linear`` on the same input (queued loops, no sync inside).

    PYTHONPATH=src python3 benchmarks/probes/eager_model.py OUT.json [--model NAME] [--batch N] [--no-check]
"""
import argparse
import copy
import gc
import json
import os
import statistics
import threading
import time

import timm
import torch
import torch.nn.functional as F

import gemmtune
from gemmtune.nn.keep import TakenOver


def queued_ms(fn, calls: int) -> tuple[float, float]:
    """(wall ms per call of ``calls`` queued calls, host ms per call to queue them)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / calls, (t1 - t0) * 1e3 / calls


def paired(base, tuned, rounds: int, calls: int) -> tuple[list[float], dict, dict]:
    """Per round, base's wall time over tuned's (above 1: gemmtune faster), sides alternated; per
    side the garbage collections that ran in its rounds (generation: count, ms); and per side each
    round's wall and host ms per call (a round slow on the wall but not on the host waited on the
    GPU)."""
    ratios, side = [], [None]
    collections = {"base": {}, "tuned": {}}
    times = {"base": [], "tuned": []}
    started = {}

    def on_gc(phase, info):
        if side[0] is None:
            return
        if phase == "start":
            started["t"] = time.perf_counter()
            return
        count, ms = collections[side[0]].get(info["generation"], (0, 0.0))
        collections[side[0]][info["generation"]] = (count + 1, ms + (time.perf_counter() - started["t"]) * 1e3)

    gc.callbacks.append(on_gc)
    try:
        for i in range(rounds):
            order = (("base", base), ("tuned", tuned)) if i % 2 == 0 else (("tuned", tuned), ("base", base))
            got = {}
            for name, fn in order:
                side[0] = name
                wall, host = queued_ms(fn, calls)
                got[name] = wall
                times[name].append((round(wall, 3), round(host, 3)))
                side[0] = None
            ratios.append(got["base"] / got["tuned"])
    finally:
        gc.callbacks.remove(on_gc)
    return ratios, collections, times


def children() -> list[str]:
    """The command lines of this process's child processes (a compile pool's workers, say)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid():
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found.append(f.read().replace(b"\0", b" ").decode(errors="replace")[:120])
        except (OSError, ValueError, IndexError):
            continue
    return found


def graph_ms(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    return statistics.median(queued_ms(graph.replay, 20)[0] for _ in range(5))


def host_ops(fn, top: int = 15) -> list:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [(e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in rows[:top]]


def layer_calls(tuned, x) -> list[dict]:
    """Per layer gemmtune kept: its input shape, its served call's host us and F.linear's."""
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, a: inputs.setdefault(m, a[0]))
             for m in tuned.modules() if isinstance(m, TakenOver)]
    tuned(x)
    for h in hooks:
        h.remove()
    rows = []
    for layer, a in inputs.items():
        plain = lambda: F.linear(a, layer.weight, layer.bias)  # noqa: E731
        served = lambda: layer(a)  # noqa: E731
        hosts = {name: statistics.median(queued_ms(fn, 200)[1] for _ in range(5)) * 1e3
                 for name, fn in (("served", served), ("plain", plain))}
        rows.append({"layer": type(layer).__name__, "input": list(a.shape), "strides": list(a.stride()),
                     "contiguous": a.is_contiguous(), "activation": getattr(layer, "activation", "none"),
                     "torch_when_capturing": layer.torch_when_capturing,
                     "served_us": round(hosts["served"], 2), "plain_us": round(hosts["plain"], 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--model", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="optimize(check=False): every layer gemmtune tunes serves its eager calls too")
    args = parser.parse_args()
    torch.manual_seed(0)
    base = timm.create_model(args.model, pretrained=False).cuda().to(torch.bfloat16).eval()
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        t0 = time.perf_counter()
        gemmtune.optimize(tuned, (x,), check=args.check)
        setup = time.perf_counter() - t0
        run_base, run_tuned = (lambda: base(x)), (lambda: tuned(x))
        for fn in (run_base, run_tuned):
            queued_ms(fn, 3)
        ratios, collections, times = paired(run_base, run_tuned, args.rounds, 10)
        gc.disable()
        quiet, _, quiet_times = paired(run_base, run_tuned, args.rounds, 10)
        gc.enable()
        out = {"model": args.model, "batch": args.batch, "check": args.check, "device": torch.cuda.get_device_name(),
               "setup_s": setup, "eager_ratios": ratios, "eager_ratio": statistics.median(ratios),
               "collections": collections, "eager_ratios_gc_off": quiet,
               "round_ms": {"wall and host, per side": times, "gc off": quiet_times},
               "threads": [t.name for t in threading.enumerate()], "child_processes": children(),
               "host_ms": {"base": statistics.median(queued_ms(run_base, 10)[1] for _ in range(5)),
                           "tuned": statistics.median(queued_ms(run_tuned, 10)[1] for _ in range(5))},
               "graph_ms": {"base": graph_ms(run_base), "tuned": graph_ms(run_tuned)},
               "host_ops": {"base": host_ops(run_base), "tuned": host_ops(run_tuned)},
               "layers": layer_calls(tuned, x)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("eager_ratio", "host_ms", "graph_ms")}))
    print("ratios", [round(r, 3) for r in ratios])
    print("collections (generation: count, ms)", collections)
    print("ratios with the collector off", [round(r, 3) for r in quiet])
    for side in ("base", "tuned"):
        print(side, out["host_ops"][side][:8])
    for row in out["layers"]:
        print(row)


if __name__ == "__main__":
    main()
