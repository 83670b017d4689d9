"""Probe: whether optimize's eager check and the models benchmark read one optimized model alike
in one process, and if not, which difference between them moves the reading.

In the zoo run `models-h200-room-zoo-20261129.json` torchvision's ViT-B read 0.892 +-0.008 in the
benchmark's eager rounds (A/A 1.013) where optimize's check had read its layers 1.02x +-0.00 and
kept them. The two differ in three ways: the check swaps one model's layers between their forms
(``keep.Form``) where the benchmark times two models (the optimized copy and the model without
gemmtune); the check's loops fill 20 ms (``measure.loops``), the benchmark's 100 ms; and they run
at different moments of the process. Here, per model (zoo names; each optimized as the zoo does
it, ``models.tune_side``), four readings of gemmtune's eager speed over torch's, in this order,
the whole sequence twice: the check itself (``keep.speedup`` on the optimized model's layers);
``measure.loops`` over the two models at 20 ms loops, then at 100 ms loops; and the benchmark's
``models.paired_rounds`` (100 ms rounds, with its A/A control). Written to OUT.json after each case.

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/check_loops.py OUT.json \
        [--models vit_b_16-torchvision,bert-base,vit_base_patch16_224,mixer_b16_224]
"""
import copy
import json
import logging

import torch

import models
from gemmtune.device import current
from gemmtune.nn import keep
from gemmtune.tuning import measure

log = logging.getLogger("check_loops")


def forms_of(model: torch.nn.Module) -> list:
    """The check's forms of the layers optimize left gemmtune's (those in their gemmtune class)."""
    return [keep.Form(module) for module in model.modules() if isinstance(module, keep.TakenOver)]


def readings(base_run, tuned_run, control_run, forms: list) -> dict:
    """The four readings, each a speedup (above 1: gemmtune's side faster) and its spread."""
    found = {}
    check = keep.speedup(tuned_run, forms)
    found["check"] = {"speedup": check.ratio, "spread": check.noise, "retimed": check.retimed}
    for loop_ms in (20.0, 100.0):
        timings = measure.loops({"gemmtune": tuned_run, "torch": base_run}, current(),
                                budget_ms=2000.0 * loop_ms / 20.0, loop_ms=loop_ms)
        two = keep.Speedup.of(timings)
        found[f"loops_{loop_ms:.0f}ms"] = {"speedup": two.ratio, "spread": two.noise}
    bench = models.paired_rounds(base_run, tuned_run, rounds=15, round_ms=100.0, device="cuda", control=control_run)
    found["benchmark"] = {key: bench[key] for key in ("speedup", "spread", "control", "control_spread",
                                                      "calls_per_round")}
    return found


def probe_case(case, base, shared) -> dict:
    control = copy.deepcopy(base)
    with torch.no_grad():
        tuned, kwargs, setup_s, said = models.tune_side(case, base, shared)
        base_run = models.step_of(case, base, base, case.kwargs(base, shared))
        control_run = models.step_of(case, control, control, case.kwargs(control, shared))
        tuned_run = models.step_of(case, tuned, tuned, kwargs)
        forms = forms_of(tuned)
        sequences = [readings(base_run, tuned_run, control_run, forms) for _ in range(2)]
    row = {"case": case.label(), "setup_s": setup_s, "optimize_said": said, "layers_timed": len(forms),
           "sequences": sequences}
    log.info("%s", json.dumps(row))
    models.release("cuda")
    return row


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    default = "vit_b_16-torchvision,bert-base,vit_base_patch16_224,mixer_b16_224"
    args = models.probe_parser(__doc__, default).parse_args()
    models.probe_rows(args.out, args.models, probe_case)


if __name__ == "__main__":
    main()
