"""A served problem's two kernels, where its tuning found them different: the one that makes an
eager call cheapest (a call's cost, host time included: what ``select`` judges) and the one a
CUDA graph should capture, which replays the kernel alone (``tuner.graph_choice``). Which one
runs is decided per call by whether the current stream is being captured, a check that only the
problems with two kernels pay."""

from __future__ import annotations

import torch

from gemmtune.backends.base import BoundCall, Kernel, KernelBase
from gemmtune.backends.launch import any_rank


def _never() -> bool:
    return False


# torch's own check, without its Python frame: a CPU-only torch has none (nothing is captured)
capturing = torch._C._cuda_isCurrentStreamCapturing if torch.cuda._is_compiled() else _never


class ByMode(KernelBase):
    """``eager`` for calls outside CUDA graph capture, ``graph`` for calls inside one."""

    def __init__(self, eager: Kernel, graph: Kernel) -> None:
        self.eager, self.graph = eager, graph
        # x (..., K) where the eager kernel takes it: a capture flattens it for a graph kernel that
        # takes 2-D operands only (a capture runs once, so the two views cost nothing there), and
        # the eager call needs no flattening wrapper (cuBLAS's F.linear under cuBLASLt for graphs)
        self.serves_any_rank = eager.serves_any_rank

    def __call__(self, a, b, bias, *scales, out=None):
        """``scales``: an fp8 product's (scale_a, scale_b), passed on (2-D ``a``, as every
        scaled call's)."""
        if not capturing():
            return self.eager(a, b, bias, *scales, out=out)
        if a.dim() == 2:
            return self.graph(a, b, bias, *scales, out=out)
        return any_rank(self.graph)(a, b, bias)  # linear's x (..., K): no out, no scales

    def bind(self, a, b, bias) -> BoundCall | None:
        """The eager kernel's bound launch, and the graph kernel called as it is while a graph is
        being captured (a capture runs once: its host time is not what a replay costs)."""
        eager = self.eager.bind(a, b, bias)
        if eager is None:
            return None
        graph = any_rank(self.graph)  # runs only while a graph is captured: a flattening costs nothing there

        def call(x, weight, bias, px: int, pw: int, pbias: int):
            return graph(x, weight, bias) if capturing() else eager(x, weight, bias, px, pw, pbias)

        return call

    @property
    def front(self):
        """The eager kernel's front (cuBLAS's ``F.linear``, say), the graph kernel while a graph is
        being captured."""
        eager, graph = self.eager.front, any_rank(self.graph)

        def call(a, b, bias):
            return graph(a, b, bias) if capturing() else eager(a, b, bias)

        return call

    def warm(self, a, b, bias, *scales) -> None:
        """Run the graph kernel once on a call's operands (an fp8 product's scales after them),
        outside any capture, so that its first launch (a compile, a module load) is not made while
        a graph is being captured. A 2-D ``a`` goes as it is, in either layout: flattening is for
        linear's (..., K) inputs alone."""
        (self.graph if a.dim() == 2 else any_rank(self.graph))(a, b, bias, *scales)
