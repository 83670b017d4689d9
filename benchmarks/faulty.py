"""Runners that misbehave on purpose, for the isolation proof (``isolation.py``). They live in
their own module so that the worker process, which never imports a script's ``__main__``, can
import them by name."""

from __future__ import annotations

import os
import time

from gemmtune.tuning.runner import LocalRunner


def _first_small_tile(backend_name: str, config: dict) -> bool:
    """True for the first 16-row tiled candidate a worker meets in this run: a flag file, named
    by the parent, marks that the fault has happened (a restarted worker must not fault again)."""
    if backend_name != "triton_tiled" or config.get("BLOCK_M") != 16:
        return False
    flag = os.environ["GEMMTUNE_ISOLATION_FLAG"]
    if os.path.exists(flag):
        return False
    open(flag, "w").close()
    return True


class Scribbles(LocalRunner):
    """Launches a kernel that stores a terabyte past its buffer: an illegal memory access that
    leaves the CUDA context unusable."""

    def evaluate(self, backend_name, config, screen_budget_ms):
        if _first_small_tile(backend_name, config):
            import torch
            import triton
            import triton.language as tl

            @triton.jit
            def scribble(ptr):
                tl.store(ptr + (1 << 40), 1.0)

            scribble[(1,)](torch.empty(1, device="cuda"))
            torch.cuda.synchronize()
        return super().evaluate(backend_name, config, screen_budget_ms)


class Dies(LocalRunner):
    """Ends the process the way a segfault in a driver would."""

    def evaluate(self, backend_name, config, screen_budget_ms):
        if _first_small_tile(backend_name, config):
            os._exit(11)
        return super().evaluate(backend_name, config, screen_budget_ms)


class Hangs(LocalRunner):
    """Never returns."""

    def evaluate(self, backend_name, config, screen_budget_ms):
        if _first_small_tile(backend_name, config):
            time.sleep(3600)
        return super().evaluate(backend_name, config, screen_budget_ms)
