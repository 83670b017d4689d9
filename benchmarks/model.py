"""A real model end to end: a transformers Llama built from a config with random weights (nothing
downloaded), run in eager mode, through gemmtune, with the decode step as a CUDA graph
(static KV cache + torch.compile "reduce-overhead") with and without gemmtune, and under
max-autotune. Prefill latency (1 x prompt tokens) and decode tokens/s (batch 1 and 16), each
mode's 32 teacher-forced decode logits checked against eager's. Writes the ``model`` file of
RESULTS.md.

Each gemmtune mode runs on its own copy of the model (same weights) and is timed in alternating
rounds with the mode it is judged against (gemmtune with eager, gemmtune + reduce-overhead with
reduce-overhead; max-autotune with eager): the GPU machine's host speed drifts by tens of percent
within a run, so each row gives the median of the per-round ratios beside the medians.

    PYTHONPATH=src python3 benchmarks/model.py --out model.json [--layers 8] [--modes ...]
    PYTHONPATH=src python3 benchmarks/model.py --tiny --out /tmp/m.json   # a 2-layer smoke run, CPU too
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LOOPS = ("queued", "host-synced")  # how a decode loop feeds each step its position (Runner.decode)
MODES = ("eager", "reduce-overhead", "max-autotune", "gemmtune", "gemmtune+reduce-overhead")
COMPILED = {"reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune",
            "gemmtune+reduce-overhead": "reduce-overhead"}


def build(layers: int, tiny: bool, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    else:  # Llama-3-8B's width, fewer layers
        config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                             max_position_embeddings=8192, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return model.to(dtype).eval(), config


class Runner:
    """One mode's prefill and decode calls on one model."""

    def __init__(self, model, config, mode: str, max_len: int) -> None:
        self.model, self.config, self.mode, self.max_len = model, config, mode, max_len
        forward = model.forward
        if mode in COMPILED:
            forward = torch.compile(model.forward, mode=COMPILED[mode], fullgraph=mode != "max-autotune")
        self.forward = forward
        self.caches = {}  # batch -> its static cache: allocated once, as a server does

    def cache(self, batch: int):
        """The static KV cache for ``batch``, emptied. One cache per batch for the whole run: a
        new one per decode would move the cache's tensors, and the CUDA graph of the step (whose
        static inputs they are) would be recorded again inside the timed steps."""
        from transformers import StaticCache

        cache = self.caches.get(batch)
        if cache is None:
            cache = self.caches[batch] = StaticCache(config=self.config, max_cache_len=self.max_len)
        else:
            cache.reset()
        return cache

    def prefill(self, ids):
        return self.forward(input_ids=ids, use_cache=False).logits

    def decode(self, prompt, steps, loop: str = "queued"):
        """Teacher-forced decode: the prompt into a static cache, then ``steps`` given tokens one
        at a time; the logits of each step (B, steps, vocab) and the seconds the steps took.

        ``loop`` (LOOPS): "queued" takes each step's position from a tensor already on the
        device, so the host queues step after step as a serving loop does; "host-synced" builds
        it from a Python int per step, a copy from pageable memory that waits for the GPU to
        finish the step before, so the next step's host work (guards, graph replay) runs while
        the GPU idles, in every mode alike (the loop of the model files up to 20261123)."""
        batch, length = prompt.shape
        cache = self.cache(batch)
        positions = torch.arange(length, device=prompt.device)
        self.model(input_ids=prompt, past_key_values=cache, cache_position=positions, use_cache=True)
        forced = torch.randint(0, self.config.vocab_size, (batch, steps), device=prompt.device,
                               generator=torch.Generator(prompt.device).manual_seed(1))
        later = torch.arange(length, length + steps, device=prompt.device)
        logits = []
        _sync(prompt)
        t0 = time.perf_counter()
        for i in range(steps):
            position = torch.tensor([length + i], device=prompt.device) if loop == "host-synced" else later[i:i + 1]
            # Nothing of the step's output outlives the step: a graph's outputs live in its memory
            # pool, and one still held when cudagraph trees record a new graph (a new batch size)
            # stops the run ("tensors in the cudagraph pool not tracked as outputs").
            logits.append(self.forward(input_ids=forced[:, i:i + 1], past_key_values=cache, cache_position=position,
                                       use_cache=True).logits[:, -1].float().clone())
        _sync(prompt)
        return torch.stack(logits, 1), time.perf_counter() - t0


def _sync(t):
    if t.device.type == "cuda":
        torch.cuda.synchronize()


def tune_with_gemmtune(model, runner_inputs, runner, siblings: bool = False,
                       backends: tuple[str, ...] | None = None) -> float:
    """gemmtune.optimize, then one prefill and a few decode steps per batch recorded and every
    GEMM seen tuned (``gemmtune.nn.tune_calls``; ``siblings``: q, k and v, and gate and up,
    joined first; ``backends``: only these); the seconds it took."""
    import gemmtune
    from gemmtune.nn import tune_calls
    from gemmtune.tuning.tuner import TuneOptions

    def steps():
        runner.prefill(runner_inputs["prefill"])
        for prompt in runner_inputs["decode"]:
            runner.decode(prompt, 2)

    t0 = time.perf_counter()
    gemmtune.optimize(model)
    tune_calls(steps, siblings=siblings, options=None if backends is None else TuneOptions(backends=backends))
    return time.perf_counter() - t0


PAIRS = (("eager", "gemmtune"), ("reduce-overhead", "gemmtune+reduce-overhead"), ("eager", "max-autotune"))


def prefill_ms(runner, ids) -> float:
    _sync(ids)
    t0 = time.perf_counter()
    runner.prefill(ids)
    _sync(ids)
    return (time.perf_counter() - t0) * 1e3


def timed_pair(base, other, inputs, steps: int, rounds: int, reference: dict) -> list[dict]:
    """``base`` and ``other`` alternated ``rounds`` times on each phase: one row per mode and
    phase, with the median of other/base per round on ``other``'s rows."""
    rows = []
    ids = inputs["prefill"]
    first_calls = {base.mode: 0.0, other.mode: 0.0}  # seconds of the warm-up calls: compiles included
    for runner in (base, other):
        t0 = time.perf_counter()
        for _ in range(2):
            runner.prefill(ids)
        first_calls[runner.mode] += time.perf_counter() - t0
    times = {base.mode: [], other.mode: []}
    for _ in range(rounds):
        for runner in (base, other):
            times[runner.mode].append(prefill_ms(runner, ids))
    ratio = statistics.median(b / o for b, o in zip(times[base.mode], times[other.mode]))
    for runner in (base, other):
        rows.append({"phase": "prefill", "batch": ids.shape[0], "tokens": ids.shape[1], "mode": runner.mode,
                     "latency_ms": statistics.median(times[runner.mode]),
                     "speedup_vs": base.mode if runner is other else None, "speedup": ratio if runner is other else None})
    for prompt in inputs["decode"]:
        batch = prompt.shape[0]
        for runner in (base, other):
            t0 = time.perf_counter()
            for loop in LOOPS:  # compiles and captures the step's graph (for either kind of position)
                runner.decode(prompt, 3, loop)
            first_calls[runner.mode] += time.perf_counter() - t0
        for loop in LOOPS:
            rates, errors = {base.mode: [], other.mode: []}, {}
            for _ in range(rounds):
                for runner in (base, other):
                    logits, seconds = runner.decode(prompt, steps, loop)
                    rates[runner.mode].append(batch * steps / seconds)
                    ref = reference.setdefault(batch, logits)
                    errors[runner.mode] = max(errors.get(runner.mode, 0.0), float((logits - ref).norm() / ref.norm()))
            ratio = statistics.median(o / b for b, o in zip(rates[base.mode], rates[other.mode]))
            for runner in (base, other):
                rows.append({"phase": "decode", "batch": batch, "loop": loop, "mode": runner.mode,
                             "tokens_per_s": statistics.median(rates[runner.mode]),
                             "max_rel_err": errors[runner.mode], "speedup_vs": base.mode if runner is other else None,
                             "speedup": ratio if runner is other else None})
    for row in rows:
        row["first_calls_s"] = first_calls[row["mode"]]
        if row["speedup"] is not None:
            what = f"{row['latency_ms']:.2f} ms" if row["phase"] == "prefill" else f"{row['tokens_per_s']:.1f} tokens/s"
            print(f"{row['mode']:26s} {row['phase']} b={row['batch']:3d} {row.get('loop', ''):11s}: {what}  "
                  f"x{row['speedup']:.3f} vs "
                  f"{row['speedup_vs']} (paired rounds)", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=2048, help="prefill tokens (batch 1)")
    parser.add_argument("--decode-prompt", type=int, default=128, help="prompt length before decoding")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=32, help="teacher-forced decode steps timed and checked")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per pair of modes")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model: a smoke run")
    parser.add_argument("--backends", nargs="+", default=None, help="gemmtune tunes among these backends only")
    parser.add_argument("--siblings", action="store_true",
                        help="gemmtune joins the layers called on one input (q, k, v; gate, up): optimize(siblings=True)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("no CUDA GPU: eager and gemmtune only, CPU timings (NOT GPU timings)", file=sys.stderr)
        args.modes = [m for m in args.modes if m in ("eager", "gemmtune")]
    os.environ.setdefault("GEMMTUNE_CACHE_DIR", tempfile.mkdtemp(prefix="gemmtune-model-"))
    # three models' forwards share one code object: room for every shape of each under dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    model, config = build(args.layers, args.tiny, device)
    tuned = copy.deepcopy(model)  # the same weights, run through gemmtune
    gen = torch.Generator(device).manual_seed(0)
    inputs = {"prefill": torch.randint(0, config.vocab_size, (1, args.prompt), device=device, generator=gen),
              "decode": [torch.randint(0, config.vocab_size, (b, args.decode_prompt), device=device, generator=gen)
                         for b in args.batches]}
    max_len = args.decode_prompt + args.steps + 8
    doc = {"kind": "model", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "date": datetime.date.today().isoformat(),
           "model": f"llama (random weights, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                    f"intermediate {config.intermediate_size}, vocab {config.vocab_size})",
           "gpu_timings": device == "cuda", "rounds": args.rounds, "siblings": args.siblings, "rows": []}
    setup_s = tune_with_gemmtune(tuned, inputs, Runner(tuned, config, "eager", max_len), args.siblings,
                                 None if args.backends is None else tuple(args.backends))
    from gemmtune.serving.dispatch import DISPATCHER

    doc["backends"] = args.backends
    doc["choices"] = {r.problem_key: r.label() for r in DISPATCHER.store.choices()}
    reference: dict = {}
    with torch.no_grad():
        eager_logits = Runner(model, config, "eager", max_len)
        for prompt in inputs["decode"]:  # eager's logits are the reference of every mode
            reference[prompt.shape[0]] = eager_logits.decode(prompt, args.steps)[0]
        for base_mode, other_mode in PAIRS:
            if other_mode not in args.modes or base_mode not in args.modes:
                continue
            base = Runner(model, config, base_mode, max_len)
            other = Runner(tuned if other_mode.startswith("gemmtune") else model, config, other_mode, max_len)
            rows = timed_pair(base, other, inputs, args.steps, args.rounds, reference)
            for row in rows:  # gemmtune's tuning, then the first calls (torch.compile's work)
                row["setup_s"] = (setup_s if row["mode"].startswith("gemmtune") else 0.0) + row["first_calls_s"]
            doc["rows"] += rows
            args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
