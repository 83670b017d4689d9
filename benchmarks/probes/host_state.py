"""Probe: whether a process that has run other models through gemmtune queues a model's plain
eager forward slower than a fresh process does.

In the zoo run of 2026-11-29 (``models-h200-lines-20261129.json``) T5-small's forward without
gemmtune took 23.0 ms a call, where a fresh process on the same machine minutes later took 13.0
(``host-lean-h200-t5-20261129.json``) and BERT-base's stayed at 4.1 ms in both. T5-small runs late
in the zoo, after ten models were optimized, timed and released in the same process.

Here the watched models (``--watch``, built first, never given to gemmtune) are timed without
gemmtune at stages of one process: fresh; after each model of ``--then`` went through
``optimize`` as the zoo does it (``models.tune_side``, eager forwards and a CUDA graph of the
optimized copy, then released as the zoo releases a case); and after a copy of the first watched
model is optimized and kept. At each stage: each watched model's ms per queued eager call,
rounds alternating with the garbage collector on and off; the objects it tracks; one full
collection's time; the caching allocator's segments. Written to OUT.json after every stage.

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/host_state.py OUT.json \
        [--watch t5-small,bert-base] [--then seed-mlp,vit_base_patch16_224,mixer_b16_224,bert-base,gpt2]
"""
import argparse
import gc
import json
import logging
import statistics
import time

import torch

import models

log = logging.getLogger("host_state")


def inference_case(name: str) -> tuple[models.Case, torch.nn.Module, dict]:
    """The first inference case of zoo model ``name``, its model and its inputs
    (``models.inference_models``)."""
    return next(models.inference_models(name))


def timed(steps: dict, rounds: int, calls: int) -> dict:
    """Per step and collector state ('gc on', 'gc off'), the median ms per call over ``rounds``
    rounds of ``calls`` queued calls, the order turning each round."""
    sides = [(name, on) for name in steps for on in (True, False)]
    times = {side: [] for side in sides}
    for i in range(rounds):
        for name, on in sides[i % len(sides):] + sides[:i % len(sides)]:
            (gc.enable if on else gc.disable)()
            try:
                times[(name, on)].append(models.loop_ms(steps[name], calls, "cuda"))
            finally:
                gc.enable()
    return {name: {"gc_on_ms": statistics.median(times[(name, True)]),
                   "gc_off_ms": statistics.median(times[(name, False)])} for name in steps}


def state() -> dict:
    """The process's collector and allocator state."""
    t0 = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - t0) * 1e3
    stats = torch.cuda.memory_stats()
    return {"gc_objects": len(gc.get_objects()), "gc_collect_ms": collect_ms,
            "segments": stats.get("segment.all.current", 0), "allocated_gb": torch.cuda.memory_allocated() / 1e9}


def through_gemmtune(name: str) -> float:
    """Zoo model ``name`` optimized as the zoo does it, run eager and as a CUDA graph, then
    released; the seconds it took."""
    t0 = time.perf_counter()
    case, base, shared = inference_case(name)
    with torch.no_grad():
        tuned, kwargs, _, _ = models.tune_side(case, base, shared)
        step = models.step_of(case, tuned, tuned, kwargs)
        for _ in range(3):
            step()
        graph, _ = models.captured(step)
        graph()
    torch.cuda.synchronize()
    del case, base, shared, tuned, kwargs, step, graph
    models.release("cuda")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--watch", default="t5-small,bert-base")
    parser.add_argument("--then", default="seed-mlp,vit_base_patch16_224,mixer_b16_224,bert-base,gpt2")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    watched = {name: inference_case(name) for name in args.watch.split(",")}
    steps = {name: models.step_of(case, model, model, shared) for name, (case, model, shared) in watched.items()}
    stages, kept = [], []

    def stage(label: str, seconds: float = 0.0) -> None:
        with torch.no_grad():
            for step in steps.values():
                step()
            row = {"stage": label, "stage_s": seconds, "watched": timed(steps, args.rounds, args.calls)} | state()
        stages.append(row)
        log.info("%s", json.dumps(row))
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "watch": args.watch, "then": args.then,
                       "rounds": args.rounds, "calls": args.calls, "stages": stages}, f, indent=1)

    stage("fresh")
    for name in args.then.split(","):
        stage(f"after {name}", through_gemmtune(name))
    first = next(iter(watched))
    case, model, shared = watched[first]
    with torch.no_grad():
        kept.append(models.tune_side(case, model, shared))
    stage(f"{first} optimized, its copy kept", kept[0][2])


if __name__ == "__main__":
    main()
