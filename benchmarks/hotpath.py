"""Where gemmtune's host time goes inside a model: a transformers Llama (model.py's, fewer layers,
decode steps at each batch) or the seeds' MLP (compare's, one forward), through gemmtune.optimize
and tuned, then

- per step: how many linear calls left the front path, and how many launches went through
  Triton's JIT instead of the compiled binary's launcher (both should be 0);
- per layer: the host time of the layer's call on the step's own input against torch's
  (F.linear, then the fused activation) on the same tensors, alternated in rounds (median
  per-round ratio), with the kernel serving it and how the front path calls it;
- for the MLP, the whole model's host time per call against eager's, alternated the same way.

    PYTHONPATH=src python3 benchmarks/hotpath.py --out hotpath.json [--layers 2] [--batches 1 16]
    PYTHONPATH=src python3 benchmarks/hotpath.py --model seed-mlp --dtype float32 --out hotpath-mlp.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dispatch import paired_us  # noqa: E402  (the store's directory is read when it opens, not here)
from model import Runner, build, tune_with_gemmtune  # noqa: E402


def count_calls(owner, name: str, counter: dict) -> None:
    """Counts the calls of ``owner.name`` in ``counter[name]`` (a wrapper, for this diagnosis)."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counter[name] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def layer_rows(linears, step, tag: str, args) -> list[dict]:
    """Each gemmtune layer's host time on the input ``step()`` gives it, against torch's."""
    from gemmtune import activation
    from gemmtune.serving import calls
    from gemmtune.serving.dispatch import DISPATCHER

    seen = {}
    # the last input each layer sees; the hook returns None, so the input is left as it is
    hooks = [m.register_forward_pre_hook(lambda mod, inp, name=name: seen.__setitem__(name, inp[0]))
             for name, m in linears]
    step()
    for hook in hooks:
        hook.remove()
    rows = []
    for name, module in linears:
        x, w, b, act = seen[name], module.weight, module.bias, module.activation
        ours_us, torch_us, ratio = paired_us(lambda: module(x), lambda: activation.apply(F.linear(x, w, b), act),
                                             args.calls, args.rounds)
        front = DISPATCHER.front.get(calls.front_key(x, w, b, None if act == "none" else act, x.data_ptr(),
                                                    w.data_ptr(), 0 if b is None else b.data_ptr()))
        kernel = DISPATCHER.kernels.get(calls.dispatch_key("linear", x, b, x.numel() // x.shape[-1], w.shape[0], w.shape[1],
                                                 act))
        how = ("NOT ON THE FRONT PATH" if front is None
               else "bound launch" if getattr(front, "__qualname__", "").startswith("bound_call")
               else "the kernel's own call")
        row = {"case": tag, "layer": name, "x_shape": list(x.shape), "x_stride": list(x.stride()),
               "activation": act, "gemmtune_us": ours_us, "torch_us": torch_us, "ratio": ratio,
               "kernel": f"{type(kernel).__name__}, {how}"}
        rows.append(row)
        print(f"{tag} {name:34s} {ours_us:6.2f} us vs torch {torch_us:6.2f} us x{ratio:.2f}  {row['kernel']}  "
              f"x {tuple(x.shape)} {act}", flush=True)
    return rows


def counted_steps(step, steps: int, counter: dict, tag: str, layers: int) -> dict:
    step()  # first calls: kernels built, front path filled
    counter.update(_linear=0, _jit=0)
    for _ in range(steps):
        step()
    row = {"case": tag, "off_front_per_step": counter["_linear"] / steps,
           "jit_launches_per_step": counter["_jit"] / steps, "layers": layers}
    print(f"{tag}: per step, {row['off_front_per_step']:.1f} linear calls off the front path, "
          f"{row['jit_launches_per_step']:.1f} launches through the JIT (of {layers} layers)", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=["llama", "seed-mlp"], default="llama")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                        help="the MLP's dtype (the Llama runs in bfloat16)")
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
    from gemmtune import api
    from gemmtune.cli import compare
    from gemmtune.backends import launch

    doc = {"kind": "hotpath", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "gemmtune": gemmtune.__version__, "date": datetime.date.today().isoformat(), "model": args.model,
           "rows": []}
    counter = {"_linear": 0, "_jit": 0}
    with torch.no_grad():
        if args.model == "seed-mlp":
            torch.set_float32_matmul_precision("high")  # as compare runs it
            x = torch.randn(256, 1024, device="cuda", dtype=getattr(torch, args.dtype))
            eager = compare.seed_mlp().to(device="cuda", dtype=x.dtype)
            model = gemmtune.optimize(copy.deepcopy(eager), (x,))
            count_calls(api, "serve_linear", counter)
            count_calls(launch.Launcher, "_jit", counter)
            linears = [(name, m) for name, m in model.named_modules() if isinstance(m, gemmtune.nn.Linear)]
            doc["rows"].append(counted_steps(lambda: model(x), 4, counter, args.dtype, len(linears)))
            doc["rows"] += layer_rows(linears, lambda: model(x), args.dtype, args)
            ours_us, eager_us, ratio = paired_us(lambda: model(x), lambda: eager(x), args.calls, args.rounds)
            doc["rows"].append({"case": args.dtype, "layer": "whole model", "gemmtune_us": ours_us,
                                "eager_us": eager_us, "ratio": ratio})
            print(f"{args.dtype} whole model: {ours_us:.2f} us vs eager {eager_us:.2f} us x{ratio:.2f}", flush=True)
        else:
            model, config = build(args.layers, False, "cuda")
            prompts = [torch.randint(0, config.vocab_size, (b, 64), device="cuda") for b in args.batches]
            runner = Runner(model, config, "gemmtune", 64 + 16)
            tune_with_gemmtune(model, {"prefill": prompts[0][:, :32], "decode": prompts}, runner)
            count_calls(api, "serve_linear", counter)
            count_calls(launch.Launcher, "_jit", counter)
            linears = [(name, m) for name, m in model.named_modules() if isinstance(m, gemmtune.nn.Linear)]
            for prompt in prompts:
                tag = f"b={prompt.shape[0]}"
                # a decode step's own inputs: the prompt goes into the cache first, then one step
                doc["rows"].append(counted_steps(lambda: runner.decode(prompt, 1), 4, counter, tag, len(linears)))
                doc["rows"] += layer_rows(linears, lambda: runner.decode(prompt, 1), tag, args)
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
