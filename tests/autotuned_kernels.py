"""Kernels under gemmtune.autotune(isolate=True) for tests/test_autotune.py, at a module's top
level so that the tuning process imports them by name. A config's pre-hook misbehaves only in
that process (multiprocessing's parent_process is None in the test's own): CRASH ends it as a
fault would, HANG stops it."""

import multiprocessing
import os
import time

import triton
import triton.language as tl

import gemmtune


def _in_the_tuning_process() -> bool:
    return multiprocessing.parent_process() is not None


def _crash(args) -> None:
    if _in_the_tuning_process():
        os._exit(9)


def _hang(args) -> None:
    if _in_the_tuning_process():
        time.sleep(3600)


@triton.jit
def _add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


add_with_a_crash = gemmtune.autotune(
    configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32}, pre_hook=_crash), triton.Config({"BLOCK": 64})],
    key=["n"], isolate=True)(_add)

add_with_a_hang = gemmtune.autotune(
    configs=[triton.Config({"BLOCK": 16}, pre_hook=_hang), triton.Config({"BLOCK": 32})],
    key=["n"], isolate=True)(_add)

add_isolated = gemmtune.autotune(configs=[triton.Config({"BLOCK": b}) for b in (16, 32)], key=["n"],
                                 isolate=True)(_add)

add_pruned = gemmtune.autotune(configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64)], key=["n"],
                               prune_configs_by={"early_config_prune": lambda configs, named, **kw: configs[1:]})(_add)
