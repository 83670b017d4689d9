"""How much a shape bucket costs: the config tuned for a bucket's representative, measured on
shapes sampled from the bucket beside the config tuned for each shape exactly (the seeds ask
that power-of-two buckets be validated, not assumed)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from gemmtune.device import Device
from gemmtune.problem import Problem, bucket, pooled
from gemmtune.results import Status, Trial
from gemmtune.tuning.runner import LocalRunner, Runner, matmul_precision
from gemmtune.tuning.tuner import MIN_ROUNDS_FINAL, TuneOptions, tune_problem


@dataclass(frozen=True)
class BucketCheck:
    sample: Problem
    representative: Problem
    bucket_choice: str
    exact_choice: str
    loss: float | None  # cost of the bucket's config / cost of the exact config - 1; None: cannot run

    def as_dict(self, shape: str) -> dict:
        """A report row for the shape named ``shape`` that this sample was drawn for."""
        return {"shape": shape, "sample": self.sample.key(), "bucket": self.representative.key(),
                "bucket_choice": self.bucket_choice, "exact_choice": self.exact_choice, "loss": self.loss}


BUCKETED_DIMS = {"exact": (False, False, False), "pow2": (True, True, True), "log2m": (True, False, False)}


def samples(problem: Problem, policy: str, count: int, seed: int = 0) -> list[Problem]:
    """``count`` shapes drawn from the bucket of ``problem``: each bucketed size uniform in
    (rep/2, rep], the others as they are. N and K are drawn as multiples of 16 elements, as the
    bucket holds them (any other shape is a bucket of its own: none is drawn for it); M, the
    batch, is any size."""
    if not pooled(problem, policy):
        return []
    rep = bucket(problem, policy)
    rng = random.Random(seed)
    in_m, in_n, in_k = BUCKETED_DIMS[policy]
    step = 16

    def draw(size: int, bucketed: bool, unit: int = 1) -> int:
        if not bucketed or size <= unit:
            return size
        return unit * rng.randint(size // 2 // unit + 1, size // unit)

    return [replace(problem, m=draw(rep.m, in_m), n=draw(rep.n, in_n, step), k=draw(rep.k, in_k, step))
            for _ in range(count)]


def validate(problem: Problem, policy: str, count: int, device: Device, *, options: TuneOptions = TuneOptions(),
             runner: Runner | None = None, seed: int = 0) -> list[BucketCheck]:
    drawn = samples(problem, policy, count, seed)
    if not drawn:  # a bucket of one shape: nothing to lose
        return []
    runner = runner or LocalRunner(device)
    rep = bucket(problem, policy)
    chosen = tune_problem(rep, device, options=options, runner=runner)
    checks = []
    for sample in drawn:
        exact = tune_problem(sample, device, options=options, runner=runner)
        with matmul_precision(sample):
            runner.start(sample, seed)
            final = runner.final([(chosen.backend, chosen.config), (exact.backend, exact.config)],
                                 options.final_budget_ms, MIN_ROUNDS_FINAL)
        ours, best = _label(chosen), _label(exact)
        loss = final[ours][1].ratio_to(final[best][1]) - 1.0 if ours in final and best in final else None
        checks.append(BucketCheck(sample, rep, ours, best, loss))
    return checks


def _label(result) -> str:
    return Trial(result.backend, result.config, Status.OK).label()
