"""Which configs of a space to measure, within a budget of trials and seconds.

The tuner passes ``evaluate`` (one measurement, None when the candidate fails) and reads back
what was measured. This package imports neither torch, triton nor numpy, so every strategy is
tested with a fake evaluate and a fake clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gemmtune.search import descent, orders
from gemmtune.search.budget import Budget, C, Session
from gemmtune.search.neighbours import neighbours_by_fields

__all__ = ["Budget", "STRATEGIES", "DEFAULT_TOPK", "run", "plan", "neighbours_by_fields"]

STRATEGIES = ("exhaustive", "topk", "random", "descent")
# How many of a backend's configs topk measures, best predicted first. On every recorded H200
# problem (tests/data) the measured best is among the model's first 6 (within 5% on qkv decode,
# as with 8): 6 keeps that and screens a quarter fewer candidates.
DEFAULT_TOPK = 6
_RANDOM_TRIALS = 16  # random's default when no budget is given: a sample, not the whole space


def run(strategy: str, space: Sequence[C], evaluate: Callable[[C], float | None],
        budget: Budget = Budget(), *,
        predict: Callable[[C], float] | None = None,
        neighbours: Callable[[C], Sequence[C]] | None = None,
        seed: int = 0, clock: Callable[[], float] = time.monotonic) -> dict[C, float | None]:
    """Evaluate configs of ``space`` (hashable items) as the strategy chooses, within the budget.

    evaluate returns the measured time (lower is better) or None for a failed candidate.
    ``predict`` ranks configs for topk (required) and picks descent's start; ``neighbours``
    is required by descent; ``seed`` fixes random's order. The seconds budget is checked with
    ``clock`` before each evaluation. Returns {config: measured or None} for every config
    evaluated, in evaluation order (dict order). Never evaluates a config twice.
    """
    _check(strategy, predict, neighbours)
    unique = list(dict.fromkeys(space))  # a repeated config would otherwise cost a second trial
    session = Session(evaluate, _trial_cap(strategy, budget, len(unique)), budget.seconds, clock)
    order = _fixed_order(strategy, unique, predict, budget, seed)
    if order is None:
        descent.search(unique, session, neighbours, predict)
    else:
        session.walk(order)
    return session.results


def plan(strategy: str, space: Sequence[C], budget: Budget = Budget(), *,
         predict: Callable[[C], float] | None = None, seed: int = 0) -> list[C]:
    """The configs ``run`` will evaluate if none fails and the seconds last, known before any is
    measured (so they can be compiled ahead): the strategies with a fixed order, up to the trial
    cap. Descent's path depends on its measurements: nothing is planned for it."""
    _check(strategy, predict, neighbours=(lambda config: ()) if strategy == "descent" else None)
    unique = list(dict.fromkeys(space))
    order = _fixed_order(strategy, unique, predict, budget, seed)
    if order is None:
        return []
    cap = _trial_cap(strategy, budget, len(unique))
    return order[:cap] if cap is not None else order


def _fixed_order(strategy: str, unique: list[C], predict, budget: Budget, seed: int) -> list[C] | None:
    """The order a strategy walks, or None for descent, whose path follows its measurements."""
    if strategy == "exhaustive":
        return orders.exhaustive(unique)
    if strategy == "topk":
        return orders.topk(unique, predict, budget.trials or DEFAULT_TOPK)
    if strategy == "random":
        return orders.random_order(unique, seed)
    return None


def _check(strategy: str, predict: object, neighbours: object) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if strategy == "topk" and predict is None:
        raise ValueError("predict is required by strategy 'topk' (it ranks the configs)")
    if strategy == "descent" and neighbours is None:
        raise ValueError("neighbours is required by strategy 'descent' (see neighbours_by_fields)")


def _trial_cap(strategy: str, budget: Budget, size: int) -> int | None:
    if budget.trials is not None:
        return budget.trials
    if strategy == "topk":
        return DEFAULT_TOPK
    if strategy == "random" and budget.seconds is None:
        return min(size, _RANDOM_TRIALS)
    return None
