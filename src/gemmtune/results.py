"""What tuning produces: one Trial per candidate, one TuneResult per problem."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gemmtune import kernel_config


class Status(str, enum.Enum):
    OK = "ok"
    OUT_OF_RESOURCES = "out_of_resources"  # the GPU cannot run the config (shared memory, registers)
    COMPILE_ERROR = "compile_error"
    LAUNCH_ERROR = "launch_error"
    WRONG_RESULT = "wrong_result"  # failed verification against the reference: never chosen
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class Timing:
    """Raw per-call samples in milliseconds, with the statistics selection uses."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        ordered = sorted(self.samples)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])

    def quantile(self, q: float) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    @property
    def spread(self) -> float:
        """Half the inter-quartile range relative to the median: the noise a win must beat."""
        median = self.median
        return 0.5 * (self.quantile(0.75) - self.quantile(0.25)) / median if median > 0 else 0.0

    def per_round(self, other: "Timing") -> "Timing | None":
        """This timing's samples over ``other``'s, round by round, where they were taken in the
        same interleaved rounds (as many of each): drift common to both (clocks, power,
        temperature) cancels in them. None where they cannot be paired."""
        if len(self.samples) != len(other.samples) or min(other.samples, default=0) <= 0:
            return None
        return Timing(tuple(x / y for x, y in zip(self.samples, other.samples)))

    def ratio_to(self, other: "Timing") -> float:
        """This timing over ``other``: the median of the per-round ratios where they pair, else
        the ratio of the medians."""
        paired = self.per_round(other)
        return self.median / other.median if paired is None else paired.median

    def spread_against(self, other: "Timing") -> float:
        """The noise of this timing's median relative to ``other``'s: the spread of the per-round
        ratios where at least four rounds pair, else the two spreads added."""
        paired = self.per_round(other)
        if paired is None or len(paired.samples) < 4:
            return self.spread + other.spread
        return paired.spread


@dataclass(frozen=True)
class Trial:
    """One candidate tried on one problem: its timing if it ran, its typed reason if not.
    ``final``: the timing is from the final round, beside cuBLAS's in the same rounds (else it is
    the candidate's screening measurement, not comparable to a finalist's); ``vs_reference``:
    the median of its per-round ratios to cuBLAS in its screening rounds (below 1: faster),
    where cuBLAS was timed beside it. Both known only to the tuning run that made it, not stored."""

    backend: str
    config: dict
    status: Status
    timing: Timing | None = None
    rel_err: float | None = None
    reason: str = ""
    final: bool = False
    vs_reference: float | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def median_ms(self) -> float | None:
        return self.timing.median if self.timing else None

    def label(self) -> str:
        if not self.config:
            return self.backend
        if self.backend == kernel_config.BACKEND:
            try:
                return f"{self.backend}({kernel_config.KernelConfig.from_dict(self.config).label()})"
            except (TypeError, ValueError):
                pass  # as any other config
        inner = ",".join(f"{k}={v}" for k, v in self.config.items())
        return f"{self.backend}({inner})"

    def to_dict(self) -> dict:
        """Plain JSON types, for a worker process's reply."""
        return {"backend": self.backend, "config": self.config, "status": self.status.value,
                "samples": list(self.timing.samples) if self.timing else None, "rel_err": self.rel_err,
                "reason": self.reason, "vs_reference": self.vs_reference}

    @classmethod
    def from_dict(cls, data: dict) -> "Trial":
        samples = data["samples"]
        return cls(data["backend"], dict(data["config"]), Status(data["status"]),
                   Timing(tuple(samples)) if samples else None, data["rel_err"], data["reason"],
                   vs_reference=data.get("vs_reference"))


@dataclass(frozen=True)
class TuneResult:
    """The choice for one problem and the evidence behind it."""

    problem_key: str
    device: str  # fingerprint
    backend: str
    config: dict
    time_ms: float
    cublas_ms: float | None
    tune_s: float
    rel_err: float | None = None
    trials: tuple[Trial, ...] = field(default=(), repr=False)
    from_store: bool = False
    gpu_timings: bool = True

    @property
    def speedup(self) -> float | None:
        return self.cublas_ms / self.time_ms if self.cublas_ms and self.time_ms else None

    def label(self) -> str:
        return Trial(self.backend, self.config, Status.OK).label()
