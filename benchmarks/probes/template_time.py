"""Probe: how well a tuning's stored trials predict the compiler's GEMM template as a compiled
graph runs it (docs/compile.md, ALBERT's compiled loss).

``gemmtune.compile``'s plan weighs a product on the compiler's Triton template at the kernel time
of the fastest Triton config its tuning stored (``plan.ways``), beside cuBLAS's stored time. For
each product given, this tunes it ``--repeats`` times, each from an empty store, and records what
the plan would read (the template's and the library call's times), the tuner's choice, and each
Triton trial's screening reading against cuBLAS in its own rounds (``vs_reference``). Then, in one
set of interleaved rounds, it times every config the plan would have taken as three kernels,
each replayed in a CUDA graph over enough weight copies to pass the L2 as a model's layers do
(the template's generated module is kept in the output, to read beside gemmtune's kernel):
cuBLAS (``torch.addmm`` / ``torch.bmm``), gemmtune's own Triton kernel with that config, and the
compiler's template with that config (``gemmtune.compile`` of the one product, its handler made to
take the template). Ratios are to cuBLAS in the same rounds (below 1: faster than cuBLAS).

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 PYTHONPATH=src python3 benchmarks/probes/template_time.py \
        OUT.json [--repeats 3] [--problems KEY,KEY...] [--rounds 30]

The compiler's caches must be off: its cache key holds gemmtune's version, not the plan, so a
second config's compile of the same product would load the first one's code.
"""
import argparse
import json
import logging
import random
import re
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

import gemmtune
from gemmtune import backends
from gemmtune.device import current
from gemmtune.inductor import plan as planning
from gemmtune.problem import Problem
from gemmtune.serving.dispatch import Choice
from gemmtune.store import open_store
from gemmtune.tuning.verify import make_operands

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the compiled-host benchmark's helpers
from compiled_host import forced, own_code  # noqa: E402

log = logging.getLogger("template_time")

# ALBERT's (transformers' default configuration, 8 x 128 tokens) products whose template reading
# moved between tunings, and one BERT-base product as a control
DEFAULT = (Problem(1024, 4096, 4096, bias=True), Problem(1024, 4096, 16384, bias=True),
           Problem(128, 128, 64, "float32", "nn", batch=512), Problem(4096, 3072, 768, bias=True))
L2_PASSES = 2  # the weight copies replayed pass the L2 this many times over
REPLAYS = 20  # products per graph replay
LAUNCH = re.compile(r"(\w+)\.run\(|(extern_kernels\.\w+)\(")  # a generated module's kernel launches


def tuned_once(problem: Problem) -> dict:
    """One tuning from an empty store: the choice, what the plan reads from the stored trials,
    and the Triton trials' readings."""
    store = open_store(tempfile.mkdtemp(prefix="gemmtune-probe-"))
    result = gemmtune.tune(problem, store=store, retune=True)[0]
    stored = {t.label(): t for t in store.trials(current().fingerprint(), problem.key())
              if t.ok and t.median_ms is not None}
    choice = Choice(result.backend, result.config, result.time_ms, result.cublas_ms)
    ways = planning.ways(choice, stored, graphs=False)
    template = next((w for w in ways if w.kind == planning.TEMPLATE), None)
    library = next((w for w in ways if w.kind == planning.LIBRARY), None)
    tiled = sorted((t for t in result.trials if t.backend == planning.TEMPLATE_BACKEND and t.median_ms),
                   key=lambda t: t.median_ms)
    references = [t.median_ms for t in result.trials if t.backend == backends.REFERENCE and t.median_ms]
    return {"choice": result.label(), "time_ms": result.time_ms, "cublas_ms": result.cublas_ms,
            "tune_s": result.tune_s,
            "plan_library_ms": library.kernel_ms if library else None,
            "plan_template_ms": template.kernel_ms if template else None,
            "plan_template_config": template.choice.config if template else None,
            "cublas_readings_ms": references,
            "tiled": [{"config": t.config, "median_ms": t.median_ms, "vs_reference": t.vs_reference,
                       "final": t.final} for t in tiled[:6]]}


def operands(problem: Problem, copies: int):
    a, b, bias = make_operands(problem, "cuda")
    return a, [b] + [b.clone() for _ in range(copies - 1)], bias


def library_call(problem: Problem):
    if problem.batch > 1:
        return lambda a, b, _: torch.bmm(a, b)
    if problem.layout == "linear":
        return (lambda a, b, bias: torch.addmm(bias, a, b.t())) if problem.bias else (lambda a, b, _: a @ b.t())
    return (lambda a, b, bias: torch.addmm(bias, a, b)) if problem.bias else (lambda a, b, _: a @ b)


def template_call(problem: Problem, config: dict):
    """The compiler's template with ``config`` for ``problem``: gemmtune.compile of the product,
    its handler made to run the template with that config (``compiled_host.forced``)."""
    torch._dynamo.reset()  # the compiler's automatic dynamic shapes would make a second product's sizes symbols
    call = library_call(problem)
    compiled = gemmtune.compile(own_code(lambda a, b, bias: call(a, b, bias)))
    a, weights, bias = operands(problem, 1)
    with ExitStack() as stack:
        for patch in forced(planning.TEMPLATE, templates=True, config=config):
            stack.enter_context(patch)
        _, code = run_and_get_code(compiled, a, weights[0], bias)  # compiled now, under the patches
    text = "\n".join(code)
    return compiled, {"launches": sorted(set(LAUNCH.findall(text))), "code": text}


def graphed(call, a, weights, bias):
    for _ in range(3):
        call(a, weights[0], bias)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPLAYS):
            call(a, weights[i % len(weights)], bias)
    return graph


def rounds(graphs: dict, count: int) -> dict:
    """Each graph's ms per product in ``count`` interleaved rounds, the graphs in a new random
    order each round (a place in the round must not favour one); per-round ratios to the first
    graph given."""
    times = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    order = random.Random(0)
    for _ in range(count):
        for name in order.sample(list(graphs), len(graphs)):
            graph = graphs[name]
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / REPLAYS)
    first = next(iter(times))
    out = {}
    for name, values in times.items():
        ratios = [v / r for v, r in zip(values, times[first])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        out[name] = {"median_ms": statistics.median(values), "vs_cublas": statistics.median(ratios),
                     "spread": (q3 - q1) / 2}
    return out


def write_result(path: str, kind: str, rows: list, **fields) -> None:
    """A probe's result file: its kind, the device and versions, the date, ``fields``, the rows."""
    import triton

    with open(path, "w") as f:
        json.dump({"kind": kind, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, **fields, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f,
                  indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--problems", default=",".join(p.key() for p in DEFAULT),
                        help="gemmtune problem keys, comma-separated")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("gemmtune").setLevel(logging.DEBUG)  # each compiled product's kind, on stderr
    log.setLevel(logging.INFO)
    rows = []
    for text in args.problems.split(","):
        problem = Problem.from_key(text)
        started = time.perf_counter()
        tunings = [tuned_once(problem) for _ in range(args.repeats)]
        configs = list({json.dumps(t["plan_template_config"], sort_keys=True): t["plan_template_config"]
                        for t in tunings if t["plan_template_config"]}.values())
        weight_bytes = problem.k * problem.n * problem.batch * torch.empty((), dtype=getattr(torch, problem.dtype)).element_size()
        copies = 1 if problem.batch > 1 else max(1, -(-L2_PASSES * current().l2_bytes // weight_bytes))
        a, weights, bias = operands(problem, copies)
        graphs = {"cublas": graphed(library_call(problem), a, weights, bias)}
        launches = {}
        for config in configs:
            label = ",".join(f"{k}={v}" for k, v in sorted(config.items()))
            kernel = backends.build(problem, planning.TEMPLATE_BACKEND, config, current())
            graphs[f"gemmtune {label}"] = graphed(lambda x, w, b, kernel=kernel: kernel(x, w, b), a, weights, bias)
            compiled, launches[label] = template_call(problem, config)
            graphs[f"template {label}"] = graphed(compiled, a, weights, bias)
        row = {"problem": problem.key(), "tunings": tunings, "copies": copies, "template_launches": launches,
               "timed": rounds(graphs, args.rounds), "seconds": time.perf_counter() - started}
        rows.append(row)
        log.info("%s: %s; templates launched: %s", problem.key(), json.dumps(row["timed"], indent=1),
                 {k: v["launches"] for k, v in launches.items()})
        for t in tunings:
            log.info("  the plan reads the template at %s ms, the library call at %s ms; the choice: %s",
                     t["plan_template_ms"], t["plan_library_ms"], t["choice"])
    write_result(args.out, "template-time", rows)


if __name__ == "__main__":
    main()
