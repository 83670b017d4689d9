"""Probe: a timm ViT-B/16 train step (bf16, batch 64) with every Linear through gemmtune (optimize
without its model check, the backward's GEMMs tuned too) against the same step in torch: step
time, host time to queue a step, and each side's costliest GPU kernels."""
import copy
import json
import sys
import time

import timm
import torch

import gemmtune
from gemmtune.serving import recording
from gemmtune.serving.dispatch import DISPATCHER


def step(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).float().sum().backward()


def timed(fn, n=10):
    fn(); torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); t1 = time.perf_counter(); torch.cuda.synchronize()
        hosts.append(t1 - t0); walls.append(time.perf_counter() - t0)
    return sorted(walls)[n // 2] * 1e3, sorted(hosts)[n // 2] * 1e3


def top(fn, k=12):
    from torch.profiler import ProfilerActivity, profile
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn(); torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [(e.key[:90], e.count, round(e.device_time_total / 1e3, 3), round(e.cpu_time_total / 1e3, 3)) for e in rows[:k]]


def main():
    torch.manual_seed(0)
    base = timm.create_model("vit_base_patch16_224", pretrained=False).cuda().to(torch.bfloat16)
    x = torch.randn(64, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    tuned = copy.deepcopy(base)
    t0 = time.perf_counter()
    gemmtune.optimize(tuned, (x,), check=False)
    with recording.record() as seen, DISPATCHER.deferring():
        step(tuned, x)
    gemmtune.tune([p for p, _ in seen.problems()])
    setup = time.perf_counter() - t0
    served = {}
    with recording.record() as seen:
        step(tuned, x)
    from gemmtune.device import current
    from gemmtune.tuning.tuner import graph_choice
    fp = current().fingerprint()
    for problem, calls in seen.problems():
        r = DISPATCHER.store.get(fp, problem.key())
        g = graph_choice(DISPATCHER.store.trials(fp, problem.key()), r.label()) if r else None
        served[problem.describe()] = (calls, r.label() if r else None, r.time_ms if r else None,
                                      r.cublas_ms if r else None, g.label() if g else None)
    out = {"device": torch.cuda.get_device_name(0), "setup_s": setup,
           "torch_ms": timed(lambda: step(base, x)), "gemmtune_ms": timed(lambda: step(tuned, x)),
           "torch_again_ms": timed(lambda: step(base, x)), "gemmtune_again_ms": timed(lambda: step(tuned, x)),
           "problems": served,
           "torch_top": top(lambda: step(base, x)), "gemmtune_top": top(lambda: step(tuned, x))}
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "problems"}, indent=1))


if __name__ == "__main__":
    main()
