"""Probe: whether ``optimize``'s eager check reads what the model's own rounds read.

A zoo model (``benchmarks/models.py``) optimized as the zoo does it, with the check's verdict
overridden to keep every layer for both modes, so that the optimized model is left as the check's
gemmtune side had it in eager (served layers gemmtune's, layers kept for graphs alone in torch's
form), and the check's arguments kept (the run and the layers, by wrapping ``keep.speedup``).
Then the same comparison, gemmtune's side over torch's (above 1: gemmtune faster), timed four
ways in one process:

    check       ``keep.speedup`` as optimize calls it: one model, its layers swapped between the
                two forms before each loop, loops of about 20 ms
    long_loops  ``measure.loops`` on the same swaps, loops of about 100 ms, 21 rounds
    two_models  the optimized model against the model without gemmtune, nothing swapped, the zoo's
                rounds (``models.paired_rounds``) of about 100 ms, with an A/A control
    two_models_short  the same with rounds of about 20 ms

plus the verdict the check gave inside optimize. Written to OUT.json.

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/eager_check.py OUT.json [--models bert-base]
"""
import copy

import torch

import models
from gemmtune.device import current
from gemmtune.nn import keep
from gemmtune.tuning import measure


def as_dict(speedup: keep.Speedup) -> dict:
    return {"ratio": speedup.ratio, "noise": speedup.noise}


def probe_case(case, base, shared) -> dict:
    checked = {}
    speedup, decide = keep.speedup, keep.decide

    def spy(run, forms, **kwargs):
        measured = speedup(run, forms, **kwargs)
        checked.setdefault("args", (run, forms))
        checked.setdefault("verdicts", []).append(as_dict(measured))
        return measured

    def keep_all(eager, graph):
        checked["words"] = decide(eager, graph)[0]
        return checked["words"], True, None

    keep.speedup, keep.decide = spy, keep_all
    try:
        tuned, kwargs, setup_s, said = models.tune_side(case, base, shared)
    finally:
        keep.speedup, keep.decide = speedup, decide
    if "args" not in checked:
        return {"case": case.label(), "skipped": "no layer was left to time", "optimize_said": said}
    run, forms = checked["args"]

    def to_eager():
        for form in forms:
            form.to_eager()

    def to_torch():
        for form in forms:
            form.to_torch()

    control = copy.deepcopy(base)
    steps = {name: models.step_of(case, m, m, case.kwargs(m, shared)) for name, m in
             (("base", base), ("control", control))}
    tuned_step = models.step_of(case, tuned, tuned, kwargs)
    with torch.no_grad():
        reference = models.first_tensor(steps["base"]()).float()
        err = models.rel_err(models.first_tensor(tuned_step()).float(), reference)
        out = {"check": as_dict(keep.speedup(run, forms))}
        to_eager()
        long_loops = measure.loops({"gemmtune": run, "torch": run}, current(), budget_ms=60000.0, rounds=21,
                                   loop_ms=100.0, enter={"gemmtune": to_eager, "torch": to_torch})
        out["long_loops"] = as_dict(keep.Speedup.of(long_loops))
        to_eager()
        for name, round_ms in (("two_models", 100.0), ("two_models_short", 20.0)):
            paired = models.paired_rounds(steps["base"], tuned_step, 21, round_ms, "cuda", control=steps["control"])
            out[name] = {k: paired[k] for k in ("speedup", "spread", "control", "control_spread", "calls_per_round")}
    return {"case": case.label(), "setup_s": setup_s, "optimize_said": said, "check_words": checked.get("words"),
            "check_in_optimize": checked["verdicts"], "layers_timed": len(forms),
            "graph_only": sum(form.graph_only for form in forms), "rel_err": err,
            "served_by": dict(models.served_by(case, tuned, kwargs)), **out}


def main() -> None:
    args = models.probe_parser(__doc__, "bert-base,whisper-tiny-encoder").parse_args()
    models.probe_rows(args.out, args.models, probe_case)

if __name__ == "__main__":
    main()
