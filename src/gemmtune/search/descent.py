"""Coordinate descent: move to the best neighbour while one improves on the current best."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gemmtune.search.budget import C, Session, usable


def search(space: list[C], session: Session, neighbours: Callable[[C], Sequence[C]],
           predict: Callable[[C], float] | None) -> None:
    members = set(space)
    current = _first_success(sorted(space, key=predict) if predict else space, session)
    while current is not None:
        fresh = [n for n in dict.fromkeys(neighbours(current)) if n in members and n not in session.results]
        for config in fresh:
            if not session.measure(config):
                return
        current = _improvement(current, fresh, session.results)


def _first_success(order: list[C], session: Session) -> C | None:
    """The first config along ``order`` that runs: a start that fails gives no direction."""
    for config in order:
        if not session.measure(config):
            return None
        if usable(session.results[config]):
            return config
    return None


def _improvement(current: C, candidates: list[C], results: dict[C, float | None]) -> C | None:
    ran = [c for c in candidates if usable(results[c])]
    best = min(ran, key=results.__getitem__, default=None)  # ties go to the earlier neighbour
    return best if best is not None and results[best] < results[current] else None
