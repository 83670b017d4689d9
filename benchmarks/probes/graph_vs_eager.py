"""Probe: why a model replayed as a CUDA graph can run slower than its eager forward.

A model of the zoo (``benchmarks/models.py``; BERT-base by default, without gemmtune) at its first
inference case: its eager forward (calls queued) and its CUDA graph's replays timed in alternated
rounds, then each profiled (``models.profiled``: GPU ms per call of each kernel), and the kernels
whose time per call differs most between the two ways, written to OUT.json.

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/graph_vs_eager.py OUT.json [--model bert-base]
"""
import argparse
import json
import statistics

import torch

import models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    entry = models.entry_of(args.model)
    case = next(c for c in entry.cases(args.model, False) if c.phase == "inference")
    torch.manual_seed(0)
    model = entry.build(False).to("cuda", case.dtype).eval()
    kwargs = case.kwargs(model, case.inputs("cuda", case.dtype))
    with torch.no_grad():
        eager = models.step_of(case, model, model, kwargs)
        replay, _ = models.captured(eager)
        rounds = {"eager": [], "graph": []}
        for i in range(args.rounds):
            for way in (("eager", "graph") if i % 2 else ("graph", "eager")):
                rounds[way].append(models.loop_ms(eager if way == "eager" else replay, 20, "cuda"))
        kernels = {"eager": models.profiled(eager)[0], "graph": models.profiled(replay)[0]}
    names = set(kernels["eager"]) | set(kernels["graph"])
    moved = sorted(names, key=lambda n: -abs(kernels["graph"][n] - kernels["eager"][n]))[:15]
    doc = {"model": case.label(), "device": torch.cuda.get_device_name(),
           "eager_ms": statistics.median(rounds["eager"]), "graph_ms": statistics.median(rounds["graph"]),
           "rounds": rounds,
           "gpu_ms": {way: sum(k.values()) for way, k in kernels.items()},
           "kernels": {way: len(k) for way, k in kernels.items()},
           "moved": [{"kernel": n[:140], "eager_ms": kernels["eager"][n], "graph_ms": kernels["graph"][n]}
                     for n in moved]}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
