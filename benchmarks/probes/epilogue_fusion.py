"""Probe: does the compiler fuse an activation into a GEMM template's epilogue when a view stands
between them (docs/compile.md, the open question on the GELU after fc1)?

``Linear(768, 3072)`` then GELU, bf16, on a 2-D input (4096 x 768: the activation reads the
template's output as written) and on the same rows as 3-D (32 x 128 x 768: the linear's
decomposition puts a view between the addmm and the activation). Each is compiled with the
compiler's Triton template as the only GEMM choice (``max_autotune`` with backends ``TRITON``,
no CUDA graphs), once as the compiler ships and once with a choices class whose ``can_fuse`` lets a
template take a pointwise consumer of its output whatever the two nodes' memory score. Per case:
whether the template's kernel computes the activation (a call of ``erf`` in its body), the kernels
launched, the compiler's fusion log lines that name a template, the largest error against
float64, and the forward's time in interleaved rounds. Written as JSON, nothing printed.

    PYTHONPATH=src python3 benchmarks/probes/epilogue_fusion.py OUT.json [--rounds 15]
"""
import argparse
import copy
import json
import logging
import statistics

import torch
from compiled_code import launches, templates_computing  # this folder's: how generated code is read
from torch._inductor.choices import InductorChoices
from torch._inductor.utils import run_and_get_code


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class AnyScore(InductorChoices):
    """The compiler's choices, but a template and a pointwise consumer of its output may fuse
    at a memory score of 0 (the score reads 0 when a view changes the consumer's indexing)."""

    @staticmethod
    def can_fuse(scheduler, node1, node2, shared_data_score):
        if shared_data_score == 0 and node1.is_template() and not node2.is_reduction() \
                and node1.get_buffer_names() & node2.read_writes.buffer_names():
            return True
        return InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)


def compiled_case(model, reference, x, choices_class, records):
    torch._dynamo.reset()
    options = {"max_autotune": True, "triton.cudagraphs": False, "max_autotune_gemm_backends": "TRITON"}
    if choices_class is not None:
        options["inductor_choices_class"] = choices_class
    fn = torch.compile(model, options=options)
    records.lines.clear()
    with torch.no_grad():
        out, sources = run_and_get_code(fn, x)
    code = "\n".join(sources)
    with torch.no_grad():
        ref = reference(x.double())
    return fn, {
        "kernels": launches(code),
        "templates_computing_erf": templates_computing(code, ("erf(",)),
        "fusion_log_naming_a_template": sorted({line for line in records.lines if "template" in line.lower()})[:20],
        "max_abs_error": (out.double() - ref).abs().max().item(),
        "ref_max_abs": ref.abs().max().item(),
    }


def forward_ms(fn, x, reps=50):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        start.record()
        for _ in range(reps):
            fn(x)
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON file written")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (default 15)")
    args = parser.parse_args()
    records = Records()
    torch._logging.set_logs(fusion=True)
    logging.getLogger("torch._inductor.scheduler.__fusion").addHandler(records)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU()).to("cuda", torch.bfloat16).eval()
    reference = copy.deepcopy(model).double()
    inputs = {"2d": torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16),
              "3d": torch.randn(32, 128, 768, device="cuda", dtype=torch.bfloat16)}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    fns = {}
    for shape, x in inputs.items():
        for variant, choices_class in (("shipped", None), ("any-score", AnyScore)):
            name = f"{shape}-{variant}"
            logging.getLogger(__name__).info("compiling %s", name)
            fns[name], result["cases"][name] = compiled_case(model, reference, x, choices_class, records)
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(forward_ms(fn, inputs[name.split("-")[0]]))
    for name in fns:
        result["cases"][name]["forward_ms_median"] = statistics.median(times[name])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
