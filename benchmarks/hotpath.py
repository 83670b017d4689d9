"""Where gemmtune's host time goes inside a model: a transformers Llama (model.py's, fewer layers)
through gemmtune.optimize, tuned as model.py tunes it, then

- per decode step: how many linear calls left the front path, and how many launches went
  through Triton's JIT instead of the compiled binary's launcher (both should be 0);
- per layer: the host time of the layer's call on the step's own input against F.linear's on
  the same tensors, alternated in rounds (median per-round ratio), with the kernel serving it.

    PYTHONPATH=src python3 benchmarks/hotpath.py --out hotpath.json [--layers 2] [--batches 1 16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import Runner, build, tune_with_gemmtune  # noqa: E402


def count_calls(owner, name: str, counter: dict) -> None:
    """Counts the calls of ``owner.name`` in ``counter[name]`` (a wrapper, for this diagnosis)."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counter[name] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def host_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("hotpath.py measures host time around GPU kernels; there is no GPU here", file=sys.stderr)
        return 2
    os.environ.setdefault("GEMMTUNE_CACHE_DIR", tempfile.mkdtemp(prefix="gemmtune-hotpath-"))
    import gemmtune
    from gemmtune import api, launch
    from gemmtune.dispatch import DISPATCHER

    model, config = build(args.layers, False, "cuda")
    prompts = [torch.randint(0, config.vocab_size, (b, 64), device="cuda") for b in args.batches]
    runner = Runner(model, config, "gemmtune", 64 + 16)
    tune_with_gemmtune(model, {"prefill": prompts[0][:, :32], "decode": prompts}, runner)
    counter = {"_linear": 0, "_jit": 0}
    count_calls(api, "_linear", counter)
    count_calls(launch.Launcher, "_jit", counter)
    doc = {"kind": "hotpath", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "gemmtune": gemmtune.__version__, "date": datetime.date.today().isoformat(), "layers": args.layers,
           "rows": []}
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, gemmtune.nn.Linear)]
    with torch.no_grad():
        for prompt in prompts:
            batch = prompt.shape[0]
            runner.decode(prompt, 2)  # first calls: kernels built, front path filled
            counter.update(_linear=0, _jit=0)
            steps = 4
            runner.decode(prompt, steps)
            print(f"b={batch}: per decode step, {counter['_linear'] / steps:.1f} linear calls off the front path, "
                  f"{counter['_jit'] / steps:.1f} launches through the JIT (of {len(linears)} layers)", flush=True)
            doc["rows"].append({"batch": batch, "off_front_per_step": counter["_linear"] / steps,
                                "jit_launches_per_step": counter["_jit"] / steps, "layers": len(linears)})
            seen = {}
            # the last input each layer sees (the decode step's, after the prompt's); returns None,
            # so the input is left as it is
            hooks = [m.register_forward_pre_hook(lambda mod, inp, name=name: seen.__setitem__(name, inp[0]))
                     for name, m in linears]
            runner.decode(prompt, 1)
            for hook in hooks:
                hook.remove()
            for name, module in linears:
                x = seen[name]
                ours = lambda: module(x)  # noqa: E731
                theirs = lambda: F.linear(x, module.weight, module.bias)  # noqa: E731
                ours(), theirs()
                pairs = [(host_us(ours, args.calls), host_us(theirs, args.calls)) for _ in range(args.rounds)]
                ratio = statistics.median(o / t for o, t in pairs)
                w, b = module.weight, module.bias
                front = DISPATCHER.front.get(api._front_key(x, w, b, None))
                kernel = DISPATCHER.kernels.get(api._key("linear", x, b, x.numel() // x.shape[-1], w.shape[0],
                                                         w.shape[1], "none"))
                how = ("NOT ON THE FRONT PATH" if front is None
                       else "bound launch" if getattr(front, "__qualname__", "").startswith("_front_call")
                       else "the kernel itself")
                row = {"batch": batch, "layer": name, "x_shape": list(x.shape), "x_stride": list(x.stride()),
                       "gemmtune_us": statistics.median(p[0] for p in pairs),
                       "f_linear_us": statistics.median(p[1] for p in pairs), "ratio": ratio,
                       "kernel": f"{type(kernel).__name__}, {how}"}
                doc["rows"].append(row)
                print(f"b={batch} {name:34s} {row['gemmtune_us']:6.2f} us vs F.linear {row['f_linear_us']:6.2f} us "
                      f"x{ratio:.2f}  {row['kernel']}  x {tuple(x.shape)} {tuple(x.stride())}", flush=True)
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
