"""Probe: the code the compiler generates for BERT-base under gemmtune.compile, and under a
default ``torch.compile`` beside it, to read which kernel takes each product and whether the
activation after a layer reaches a GEMM template's epilogue (docs/compile.md, the open question
on the GELU after fc1).

BERT-base (transformers, random weights, bf16, 32 x 128 tokens; ``--layers`` of them). Each
side's generated Python source is written under OUT_DIR whole, with a summary as JSON: per side,
the kernels its ``call`` launches in order (a Triton kernel's name, or an extern call), the
ones whose names hold an activation, and the GEMM templates whose bodies compute one. Nothing
timed.

    PYTHONPATH=src python3 benchmarks/probes/compiled_code.py OUT_DIR [--layers 1] [--mode MODE]
"""
import argparse
import json
import re
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code
from transformers import BertConfig, BertModel

import gemmtune

LAUNCH = re.compile(r"^\s+(\w+)\.run\(|^\s+(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.M)
TEMPLATE = re.compile(r"def (triton_tem_\w+)\(.*?(?=\n''')", re.S)
ACTIVATIONS = ("gelu", "relu", "silu", "tanh")
# what a kernel body calls where it computes an activation (exact GELU, tanh and tanh-GELU, SiLU)
ACTIVATION_CALLS = ("erf(", "tanh(", "sigmoid(")


def launches(code: str) -> list[str]:
    """The kernels a generated module launches, in the order its source names them."""
    return [triton or extern for triton, extern in LAUNCH.findall(code)]


def templates_computing(code: str, calls=ACTIVATION_CALLS) -> list[str]:
    """The GEMM templates of a generated module whose body makes one of ``calls``. A template's
    name lists its inputs' origins too (fc2's names the GELU whose output it reads), so a name
    proves nothing."""
    return [body.group(1) for body in TEMPLATE.finditer(code) if any(call in body.group(0) for call in calls)]


def side(compiled, ids) -> tuple[list[str], list[str]]:
    with torch.no_grad():
        _, sources = run_and_get_code(compiled, ids)
    return sources, [name for code in sources for name in launches(code)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder written")
    parser.add_argument("--layers", type=int, default=1, help="encoder layers (default 1)")
    parser.add_argument("--mode", default=None, help="torch.compile's mode for both sides (default: default)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = BertModel(BertConfig(num_hidden_layers=args.layers)).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 30522, (32, 128), device="cuda")
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "mode": args.mode}
    for name, compile_ in (("compile", torch.compile), ("gemmtune", gemmtune.compile)):
        torch._dynamo.reset()
        sources, kernels = side(compile_(model, mode=args.mode), ids)
        for i, code in enumerate(sources):
            (args.out / f"{name}-{i}.py").write_text(code)
        summary[name] = {"kernels": kernels,
                         "with_an_activation": [k for k in kernels if any(a in k for a in ACTIVATIONS)],
                         "templates_computing_an_activation": [t for code in sources for t in templates_computing(code)]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
