"""Host time per call of each way compiled code can run a GEMM, the figures behind
``gemmtune.inductor.plan.HOST_MS``: one linear layer (a GEMM of a few microseconds on the GPU,
so that the host sets the pace) compiled

    library     torch.compile's own: the library call (extern_kernels.addmm)
    wrapped     gemmtune.compile on cuBLAS in a graph compiled with the GEMM templates on (under
                torch 2.11 the library call then goes through bias_addmm)
    template    gemmtune.compile on the compiler's Triton template, with a config of gemmtune's
    called      gemmtune.compile calling gemmtune's kernel from the generated code (gemmtune_linear)
    pointwise   a compiled graph of one Triton kernel and no GEMM (x * 2 + 1): a launch's floor
    eager       F.linear, uncompiled

Each way's calls are queued in loops (no sync between calls) in shuffled order over rounds, in
one process (``measure.loops``, as a model's forward is timed); each figure is the median of its
rounds' microseconds per call, and ``vs_library`` the median of the per-round ratios to the
library call's. Every output is checked against float64.

    PYTHONPATH=src python3 benchmarks/compiled_host.py --out $OUT/compiled-host.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
import torch._inductor.config
import torch.nn.functional as F

import gemmtune
from gemmtune.device import current
from gemmtune.inductor import choices, plan
from gemmtune.serving.dispatch import Choice
from gemmtune.tuning import measure

WAYS = ("library", "wrapped", "template", "called", "pointwise", "eager")
TILES = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def forced(kind: str, templates: bool, config: dict = TILES):
    """gemmtune.compile's handler running every GEMM ``kind`` (the template with the Triton
    ``config``, cuBLAS otherwise; a called kernel is the one gemmtune's dispatch chose), the
    templates switched on or not."""
    choice = Choice("cublas", {}) if kind == plan.LIBRARY else Choice("triton_tiled", config, 0.001, None)
    return [mock.patch.object(choices.GemmtuneChoices, "decision", lambda self, problem, index: (choice, kind)),
            mock.patch.object(choices.GemmtuneChoices, "choose_ahead", lambda self, graph: templates)]


def own_code(fn):
    """``fn`` with a code object of its own: Dynamo keeps compiled code per code object, and each
    way must be compiled its own way."""
    fn.__code__ = fn.__code__.replace()
    return fn


def build(way: str, layer: torch.nn.Linear, x: torch.Tensor):
    """The call timed for ``way``, compiled and run once."""
    if way == "eager":
        return lambda: F.linear(x, layer.weight, layer.bias)
    if way == "pointwise":
        fn = torch.compile(own_code(lambda t: t * 2 + 1))
        return lambda: fn(x)
    if way == "library":
        fn = torch.compile(own_code(lambda t: layer(t)))
    else:
        kind = {"wrapped": plan.LIBRARY, "template": plan.TEMPLATE, "called": plan.CALLED}[way]
        with ExitStack() as stack:
            for patch in forced(kind, templates=way != "called"):
                stack.enter_context(patch)
            fn = gemmtune.compile(own_code(lambda t: layer(t)))
            fn(x)  # compiled here, with the patches on
    fn(x)
    return lambda: fn(x)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--shape", default="64x256x256",
                        help="MxNxK of the linear layer, with a bias (default 64x256x256)")
    parser.add_argument("--rounds", type=int, default=11, help="rounds of shuffled loops (default 11)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("compiled_host.py: needs a CUDA GPU (it times host time per call of compiled code)", file=sys.stderr)
        return 2
    m, n, k = (int(v) for v in args.shape.lower().split("x"))
    torch._inductor.config.fx_graph_cache = False  # each way compiles its own graph, none from another's
    torch.manual_seed(0)
    layer = torch.nn.Linear(k, n).to("cuda", torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    reference = x.double() @ layer.weight.double().t() + layer.bias.double()
    calls, errors = {}, {}
    with torch.no_grad():
        for way in WAYS:
            calls[way] = build(way, layer, x)
            out = calls[way]()
            expected = x.double() * 2 + 1 if way == "pointwise" else reference
            errors[way] = ((out.double() - expected).abs().max() / expected.abs().max()).item()
            if errors[way] > 2e-2:
                raise SystemExit(f"compiled_host.py: {way} computed a wrong result (rel_err {errors[way]:.3g})")
        timings = measure.loops(calls, current(), budget_ms=60_000.0, rounds=args.rounds)
    times = {way: [ms * 1e3 for ms in timing.samples] for way, timing in timings.items()}
    rows = [{"way": way, "host_us": statistics.median(times[way]),
             "vs_library": statistics.median(t / lib for t, lib in zip(times[way], times["library"])),
             "rel_err": errors[way]} for way in WAYS]
    doc = {"kind": "compiled-host", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "gemmtune": gemmtune.__version__, "date": datetime.date.today().isoformat(), "shape": [m, n, k],
           "rounds": args.rounds, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for row in rows:
        print(f"{row['way']:10s} {row['host_us']:7.2f} us per call  x{row['vs_library']:.3f} of the library call  "
              f"rel_err {row['rel_err']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
