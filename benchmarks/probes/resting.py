"""Probe: what a layer kept for CUDA graphs alone costs a model's eager calls, at rest in its torch
form (``gemmtune.nn.capture``) against in gemmtune's form checking the mode on every call.

Per model of the zoo (``benchmarks/models.py``), at its inference cases: the model optimized as the
zoo does it (``models.tune_side``), and a copy of it whose resting layers are put in gemmtune's
form with the model's capture hooks removed (each forward then checks the mode: how such layers
ran before they rested). Eager forwards queued, four sides in alternated rounds: the model
without gemmtune, an untouched copy of it (the control), the optimized model, and the checking
copy; then the three models' CUDA graphs replayed in alternated rounds. Each ratio is the median
of per-round ratios with its spread (above 1: faster than the model without gemmtune); the
outputs of both sides against the model without gemmtune, eager and replayed. Written to OUT.json.

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/resting.py OUT.json [--models bert-base,whisper-tiny-encoder]
"""
import copy
import gc

import torch

import models
from gemmtune.nn import capture


def captures(model: torch.nn.Module) -> dict:
    """The model's capture hooks: hook id -> its ``capture.Capture``, pre-hooks and hooks both."""
    found = {}
    for hooks in (model._forward_pre_hooks, model._forward_hooks):
        found.update({key: hook.__self__ for key, hook in hooks.items()
                      if isinstance(getattr(hook, "__self__", None), capture.Capture)})
    return found


def checking_copy(tuned: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``tuned`` whose resting layers are in gemmtune's form, its capture hooks gone."""
    twin = copy.deepcopy(tuned)
    hooks = captures(twin)
    for capture_hooks in set(hooks.values()):
        for form in capture_hooks.forms:
            form.to_gemmtune()
    for key in hooks:
        twin._forward_pre_hooks.pop(key, None)
        twin._forward_hooks.pop(key, None)
        twin._forward_hooks_always_called.pop(key, None)
    return twin


def rounds_of(sides: dict, rounds: int, calls: int) -> dict:
    """Each side's ms per call in ``rounds`` rounds of ``calls`` queued calls, the side that
    starts a round turning."""
    names = list(sides)
    times = {name: [] for name in names}
    gc.disable()
    try:
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                times[name].append(models.loop_ms(sides[name], calls, "cuda"))
    finally:
        gc.enable()
    return times


def against(times: dict, base: str = "base") -> dict:
    """Each side's ratio to ``base`` (median of per-round ratios, spread), and rest over check."""
    out = {name: dict(zip(("ratio", "spread"), models.ratio_of(times[base], t)))
           for name, t in times.items() if name != base}
    if "rest" in times and "check" in times:
        out["rest_over_check"] = dict(zip(("ratio", "spread"), models.ratio_of(times["check"], times["rest"])))
    return out


def probe_case(case, base, shared, rounds: int) -> dict:
    tuned, kwargs, setup_s, said = models.tune_side(case, base, shared)
    check = checking_copy(tuned)
    resting = sum(len(c.forms) for c in set(captures(tuned).values()))
    base_kwargs = case.kwargs(base, shared)
    control = copy.deepcopy(base)
    with torch.no_grad():
        steps = {"base": models.step_of(case, base, base, base_kwargs),
                 "control": models.step_of(case, control, control, case.kwargs(control, shared)),
                 "rest": models.step_of(case, tuned, tuned, kwargs),
                 "check": models.step_of(case, check, check, case.kwargs(check, shared))}
        reference = models.first_tensor(steps["base"]()).float()
        errors = {name: models.rel_err(models.first_tensor(steps[name]()).float(), reference)
                  for name in ("rest", "check")}
        per_call = min(models.loop_ms(steps["base"], 1, "cuda") for _ in range(3))
        calls = max(1, min(500, round(100.0 / per_call)))
        eager = rounds_of(steps, rounds, calls)
        graphs, classes = {}, []
        layers = [form.layer for c in set(captures(tuned).values()) for form in c.forms]
        seen = [layer.register_forward_pre_hook(lambda module, args: classes.append(
                    f"{type(module).__module__}.{type(module).__qualname__}"))
                for layer in layers]
        for name in ("base", "rest", "check"):
            graphs[name], out = models.captured(steps[name])
            if name == "rest":
                for hook in seen:
                    hook.remove()
            graphs[name]()
            torch.cuda.synchronize()
            if name != "base":
                errors[f"{name}_graph"] = models.rel_err(models.first_tensor(out).float(), reference)
        replayed = rounds_of(graphs, rounds, calls)
    calls_per_capture = len(classes) // (models.WARMUP_CALLS + 1)  # the resting layers' calls, warm-up then capture
    return {"case": case.label(), "setup_s": setup_s, "optimize_said": said, "resting_layers": resting,
            "classes_eager": sorted(set(classes[:-calls_per_capture])) if calls_per_capture else [],
            "classes_captured": sorted(set(classes[-calls_per_capture:])) if calls_per_capture else [],
            "calls_per_round": calls, "rel_err": errors,
            "eager": against(eager), "eager_ms": {n: sorted(t)[len(t) // 2] for n, t in eager.items()},
            "graph": against(replayed), "graph_ms": {n: sorted(t)[len(t) // 2] for n, t in replayed.items()}}


def main() -> None:
    parser = models.probe_parser(__doc__, "bert-base,whisper-tiny-encoder")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    models.probe_rows(args.out, args.models, lambda case, base, shared: probe_case(case, base, shared, args.rounds))

if __name__ == "__main__":
    main()
