"""Probe: where gemmtune.compile's setup goes, against a default ``torch.compile``'s.

BERT-base (transformers, random weights, bf16, 32 x 128 tokens), each side's first call timed
from cold in one process: a default ``torch.compile``; gemmtune.compile with an empty store; and
gemmtune.compile again with the store filled but the compiler's caches empty (so what remains
over the default compile is the compiler's work for gemmtune's choices, not tuning). In the
gemmtune runs the parts of planning a graph are timed where they are called (tuning, the warm
library times, the host's measure, the rest's estimate, the plan), and the ``gemmtune`` logger's
lines kept with their times since the call began. Written as JSON, nothing printed.

    PYTHONPATH=src python3 benchmarks/probes/compile_setup.py OUT.json
"""
import argparse
import functools
import json
import logging
import os
import tempfile
import time

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-")
os.environ["GEMMTUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="gemmtune-")

import torch  # noqa: E402 - after the caches are pointed at empty folders
from transformers import BertConfig, BertModel  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.inductor import choices  # noqa: E402

TIMED = ("tune_ahead", "warm_library_ms", "host_library_ms", "graph_rest")


def first_call_s(compiled, ids) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(ids)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def fresh_compiler_caches() -> None:
    torch._dynamo.reset()
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ[name] = tempfile.mkdtemp(prefix=name.lower())


def timed_parts() -> dict[str, float]:
    """Wraps the planning steps of ``choices`` to add up their seconds in the returned dict."""
    spent = {name: 0.0 for name in TIMED}
    for name in TIMED:
        real = getattr(choices, name)
        real = getattr(real, "__wrapped__", real) if name == "host_library_ms" else real

        def wrapper(*args, _real=real, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - t0

        setattr(choices, name, functools.wraps(real)(wrapper))
    return spent


def gemmtune_side(model, ids) -> dict:
    said = []
    began = [time.perf_counter()]
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: said.append(f"{time.perf_counter() - began[0]:7.2f} s  {record.getMessage()}")
    logger = logging.getLogger("gemmtune")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        compiled = gemmtune.compile(model)
        began[0] = time.perf_counter()
        total = first_call_s(compiled, ids)
    finally:
        logger.removeHandler(handler)
    return {"first_call_s": total, "said": said[:400]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON file written")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = BertModel(BertConfig()).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 30522, (32, 128), device="cuda")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["compile_first_call_s"] = first_call_s(torch.compile(model), ids)
    fresh_compiler_caches()
    spent = timed_parts()
    report["gemmtune_cold"] = gemmtune_side(model, ids) | {"parts_s": dict(spent)}
    for name in spent:
        spent[name] = 0.0
    fresh_compiler_caches()
    report["gemmtune_store_filled"] = gemmtune_side(model, ids) | {"parts_s": dict(spent)}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
