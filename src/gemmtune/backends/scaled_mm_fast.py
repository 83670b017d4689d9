"""``scaled_mm_fast``: ``torch._scaled_mm`` with fast accumulation, for fp8 products: cuBLASLt's
(or torch's own CUTLASS kernel's) fp8 partial sums kept in the tensor cores' narrower
accumulator instead of promoted to float32, as serving stacks call it for speed. The reference
(``cublas``: ``torch._scaled_mm`` as torch calls it by default) accumulates exactly; this is the
other half of the pair, checked against float64 with the fp8 tolerance like every candidate
(docs/verification.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gemmtune.backends.base import FieldConfig, Kernel
from gemmtune.backends.cublas import scaled_mm, scaled_mm_takes
from gemmtune.device import Device
from gemmtune.problem import Problem


@dataclass(frozen=True)
class FastConfig(FieldConfig):
    FIELDS = {}  # no parameters: the library picks its kernel


class ScaledMmFastBackend:
    name = "scaled_mm_fast"
    space_size = 1

    def is_available(self, device: Device) -> bool:
        """fp8 tensor cores (Ada, Hopper and later); on the CPU, torch's CPU kernel, for tests."""
        return device.interpreter or device.capability >= (8, 9)

    def candidates(self, problem: Problem, device: Device) -> list[FastConfig]:
        """One, where torch has a fast-accumulating kernel for the product (``scaled_mm_takes``)."""
        return [FastConfig()] if problem.scaled and scaled_mm_takes(problem, fast_accum=True) else []

    def predict_ms(self, problem: Problem, device: Device, config) -> float | None:
        return None

    def parse_config(self, data: Mapping) -> FastConfig:
        if not isinstance(data, Mapping) or data:
            raise ValueError(f"scaled_mm_fast takes no config parameters, got {data!r}")
        return FastConfig()

    def build(self, problem: Problem, config: FastConfig, device: Device) -> Kernel:
        if not problem.scaled:
            raise ValueError(f"scaled_mm_fast serves fp8 (scaled) problems only, got {problem.describe()}")
        return scaled_mm(problem, fast_accum=True)


BACKEND = ScaledMmFastBackend()
