"""The Llama's decode step as a CUDA graph, with o_proj's weights fetched into L2 during attention.

A probe for ``l2_prefetch.py``'s finding in the model itself: after each layer's q/k/v GEMM, a
second stream loads o_proj's weights (33.5 MB, evict_last) while rope, the cache update and
attention run, and a later GEMM waits for it (a join, not a kernel). Copies of one model (same
weights): torch alone, gemmtune, gemmtune with each way of fetching (VARIANTS); all under
torch.compile(mode="reduce-overhead") with siblings joined, timed in alternating rounds at batch 1
and 16, logits checked against eager. Then one step of the fetching copy under the profiler: the
kernels between a layer's fetch and its o_proj, with their durations.

    PYTHONPATH=src:benchmarks python3 benchmarks/prefetch_model.py OUT.json [--layers 8]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

import model as llama
from l2_prefetch import load


VARIANTS = {  # label: (programs of the load kernel (0: one per 16 KB), the GEMM that joins it, gate/up bytes)
    "fetch": (0, "o", 0),
    "fetch32": (32, "o", 0),
    "fetch16": (16, "o", 0),
    "fetch32 join down": (32, "down", 0),
    "fetch32 +gate_up 16MB": (32, "down", 16 << 20),
}


def install(tuned, side: torch.cuda.Stream, programs: int, join: str, gate_up_bytes: int) -> None:
    """After each q/k/v GEMM of ``tuned``, o_proj's weights (and the first ``gate_up_bytes`` of
    gate/up's) loaded on ``side``; the GEMM named by ``join`` (o or down) waits for it."""
    from gemmtune.serving import calls

    fetches, joins = {}, {}
    for layer in tuned.model.layers:
        qkv, o = layer.self_attn.q_proj.siblings.weight, layer.self_attn.o_proj.weight
        gate_up = layer.mlp.gate_proj.siblings.weight
        fetches[qkv.data_ptr()] = [(o, None)] + ([(gate_up, gate_up_bytes)] if gate_up_bytes else [])
        joins[qkv.data_ptr()] = (o if join == "o" else layer.mlp.down_proj.weight).data_ptr()
    pending = set()
    run = calls.run
    load(o, programs)  # its sink allocated now, not inside a graph's memory pool
    torch.cuda.synchronize()

    def fetching_run(layout, a, b, bias, m, n, k, act, front=None):
        ptr = b.data_ptr()
        if ptr in pending:
            pending.discard(ptr)
            torch.cuda.current_stream().wait_stream(side)
        out = run(layout, a, b, bias, m, n, k, act, front)
        if ptr in fetches:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for w, nbytes in fetches[ptr]:
                    load(w, programs, nbytes)
            pending.add(joins[ptr])
        return out

    calls.run = fetching_run


def profile_step(runner, prompt) -> list[dict]:
    """The kernels of one decode step (after the prompt's eager prefill), in order."""
    from torch.profiler import ProfilerActivity, profile

    runner.decode(prompt, 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode(prompt, 1)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and e.device_resource_id is not None), key=lambda e: e.time_range.start)
    kernels = [{"name": e.name, "start_us": e.time_range.start, "us": e.time_range.elapsed_us(),
                "stream": e.device_resource_id} for e in events]
    return kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    os.environ.setdefault("GEMMTUNE_CACHE_DIR", tempfile.mkdtemp(prefix="gemmtune-prefetch-"))
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    model, config = llama.build(args.layers, False, "cuda")
    plain = copy.deepcopy(model)
    fetching = {label: copy.deepcopy(model) for label in VARIANTS}
    gen = torch.Generator("cuda").manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (b, 128), device="cuda", generator=gen) for b in args.batches]
    inputs = {"prefill": prompts[0][:1], "decode": prompts}
    max_len = 128 + args.steps + 8
    for tuned in (plain, *fetching.values()):
        llama.tune_with_gemmtune(tuned, inputs, llama.Runner(tuned, config, "eager", max_len), siblings=True)
    side = torch.cuda.Stream()
    for label, tuned in fetching.items():
        install(tuned, side, *VARIANTS[label])
    with torch.no_grad():
        reference = {p.shape[0]: llama.Runner(model, config, "eager", max_len).decode(p, args.steps)[0] for p in prompts}
        runners = {"reduce-overhead": llama.Runner(model, config, "reduce-overhead", max_len),
                   "gemmtune": llama.Runner(plain, config, "reduce-overhead", max_len),
                   **{label: llama.Runner(tuned, config, "reduce-overhead", max_len)
                      for label, tuned in fetching.items()}}
        doc = {"device": torch.cuda.get_device_name(), "layers": args.layers, "rounds": args.rounds, "rows": []}
        for prompt in prompts:
            batch = prompt.shape[0]
            for runner in runners.values():
                runner.decode(prompt, 3)
            rates = {name: [] for name in runners}
            errors = {}
            for _ in range(args.rounds):
                for name, runner in runners.items():
                    logits, seconds = runner.decode(prompt, args.steps)
                    rates[name].append(batch * args.steps / seconds)
                    ref = reference[batch]
                    errors[name] = max(errors.get(name, 0.0), float((logits - ref).norm() / ref.norm()))
            for name in runners:
                row = {"batch": batch, "mode": name, "tokens_per_s": statistics.median(rates[name]),
                       "max_rel_err": errors[name],
                       "vs_reduce_overhead": statistics.median(o / b for o, b in zip(rates[name], rates["reduce-overhead"])),
                       "vs_gemmtune": statistics.median(o / b for o, b in zip(rates[name], rates["gemmtune"]))}
                doc["rows"].append(row)
                print(f"b={batch:2d} {name:22s} {row['tokens_per_s']:8.1f} tokens/s  x{row['vs_reduce_overhead']:.3f} "
                      f"of reduce-overhead, x{row['vs_gemmtune']:.3f} of gemmtune  err {row['max_rel_err']:.1e}", flush=True)
            args.out.write_text(json.dumps(doc, indent=1))
        kernels = profile_step(runners["fetch32"], prompts[-1])
        doc["profile_b%d" % prompts[-1].shape[0]] = kernels
        args.out.write_text(json.dumps(doc, indent=1))
        fetches = [i for i, kern in enumerate(kernels) if "load_l2" in kern["name"]]
        if len(fetches) >= 2:
            i = fetches[1]
            t0 = kernels[i]["start_us"]
            for kern in kernels[i - 2:i + 16]:
                print(f"  {kern['start_us'] - t0:8.1f} us  {kern['us']:7.2f} us  s{kern['stream']}  {kern['name'][:70]}")
        else:
            print(f"profile: {len(kernels)} kernels, {len(fetches)} fetches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
