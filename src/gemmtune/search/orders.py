"""The strategies that fix an order up front: the budget decides how far along it a run gets."""

from __future__ import annotations

import random
from collections.abc import Callable

from gemmtune.search.budget import C


def exhaustive(space: list[C]) -> list[C]:
    return list(space)


def topk(space: list[C], predict: Callable[[C], float], k: int) -> list[C]:
    # sorted() is stable: configs predicted equal keep the space's order
    return sorted(space, key=predict)[:k]


def random_order(space: list[C], seed: int) -> list[C]:
    order = list(space)
    random.Random(seed).shuffle(order)
    return order
