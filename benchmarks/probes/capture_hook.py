"""Probe: the host time of a resting layer's capture hook (``gemmtune.nn.capture``) on its model's
call, against the mode checks a layer in gemmtune's form makes on each of its calls.

A stack of ``L`` ``nn.Linear`` layers (8 x 8, queued on the GPU, or on the CPU of a host without one) called as one
``nn.Sequential``: plain; with the capture hooks on the Sequential (a pre-hook alone, and the
pre-hook with its always-called forward hook); and with every layer in gemmtune's form, its eager
calls running torch's forward after the mode checks (``torch_when_capturing`` False). The variants
alternate in rounds; per variant the median microseconds of one call (host time: the GPU's work,
a few microseconds per layer, keeps up). Written to OUT.json.

    PYTHONPATH=src python3 benchmarks/probes/capture_hook.py OUT.json [--layers 2,8,32]
"""
import argparse
import copy
import gc
import json
import statistics
import time

import torch
from torch import nn

import gemmtune
from gemmtune.nn import capture


def variants(layers: int, device: str) -> dict:
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]).to(device)
    pre, both = copy.deepcopy(plain), copy.deepcopy(plain)
    hooks = capture.Capture([])
    pre.register_forward_pre_hook(hooks.enter)
    both.register_forward_pre_hook(hooks.enter)
    both.register_forward_hook(hooks.leave, always_call=True)
    checking = gemmtune.optimize(copy.deepcopy(plain), fuse=False, align=False)
    for layer in checking:
        layer.torch_when_capturing = False
    return {"plain": plain, "pre_hook": pre, "pre_and_forward_hook": both, "checking": checking}


def timed(models: dict, x: torch.Tensor, rounds: int, calls: int) -> dict:
    times = {name: [] for name in models}
    names = list(models)
    gc.disable()
    try:
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                model = models[name]
                t0 = time.perf_counter()
                for _ in range(calls):
                    model(x)
                times[name].append((time.perf_counter() - t0) * 1e6 / calls)
                if x.is_cuda:
                    torch.cuda.synchronize()
    finally:
        gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--layers", default="2,8,32")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    rows = []
    devices = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # optimize leaves a CPU model alone on a GPU host
    with torch.no_grad():
        for device in devices:
            for layers in map(int, args.layers.split(",")):
                us = timed(variants(layers, device), torch.randn(2, 8, device=device), args.rounds, args.calls)
                rows.append({"device": device, "layers": layers, "us_per_call": us,
                             "hook_us": {k: us[k] - us["plain"] for k in ("pre_hook", "pre_and_forward_hook")},
                             "check_us_per_layer": (us["checking"] - us["plain"]) / layers})
    with open(args.out, "w") as f:
        json.dump({"host": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
