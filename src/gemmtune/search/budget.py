"""How much a search may spend, and the bookkeeping that enforces it during one run."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

C = TypeVar("C", bound=Hashable)


@dataclass(frozen=True)
class Budget:
    """At most ``trials`` evaluations, none started after ``seconds``; None leaves that limit off."""

    trials: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        # bool is an int: Budget(trials=True) is almost certainly a mistake, not one trial
        if self.trials is not None and (isinstance(self.trials, bool) or not isinstance(self.trials, int)
                                        or self.trials < 1):
            raise ValueError(f"trials must be None or an int >= 1, got {self.trials!r}")
        if self.seconds is not None and (isinstance(self.seconds, bool)
                                         or not isinstance(self.seconds, (int, float))
                                         or not self.seconds > 0):
            raise ValueError(f"seconds must be None or a number > 0, got {self.seconds!r}")


def usable(measured: float | None) -> bool:
    """A measurement a search may compare: failed candidates (None, NaN) never win."""
    return measured is not None and not math.isnan(measured)


class Session:
    """One run's results in evaluation order, and whether the budget allows one more evaluation."""

    def __init__(self, evaluate: Callable[[C], float | None], trials: int | None,
                 seconds: float | None, clock: Callable[[], float]) -> None:
        self._evaluate, self._trials, self._seconds, self._clock = evaluate, trials, seconds, clock
        self._start = clock()
        self.results: dict[C, float | None] = {}

    def spent(self) -> bool:
        if self._trials is not None and len(self.results) >= self._trials:
            return True
        return self._seconds is not None and self._clock() - self._start >= self._seconds

    def measure(self, config: C) -> bool:
        """Evaluate ``config`` unless already measured; False once the budget is spent."""
        if config in self.results:
            return True
        if self.spent():
            return False
        self.results[config] = self._evaluate(config)
        return True

    def walk(self, order: list[C]) -> None:
        for config in order:
            if not self.measure(config):
                return
