"""Compiling in forked children: a child fills Triton's on-disk cache and the parent's compile of
the same kernel then loads it without running the front end; a failing child says why; the
options survive the JSON trip from the JIT's hook; outside a capture the hook defers to the one
it replaced. Compiled for sm_90 on this machine, outside Triton's interpreter (``ptx``); the
parent side (capture, launch) is a GPU test."""

import json
import os
from types import SimpleNamespace

import pytest
from ptx import outside_interpreter

from gemmtune import settings
from gemmtune.tuning import compiler, fork_compile

TILE = dict(K=1024, HAS_BIAS=True, ACTIVATION="relu", PRECISION="ieee", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
            GROUP_M=8, HINTS=(1,) * 10, num_warps=4, num_stages=3)
SCALARS = (256, 1024, 1024, 1, 1, 1024, 1024, 1, 0, 0, 0)  # m, n, the strides, no batch

CHILD = """
import json, sys
import triton
import ptx
from triton.compiler import ASTSource
from gemmtune.tuning import fork_compile

target_tile, broken_tile, scalars = json.loads(sys.argv[1])
source = fork_compile.Source(*ptx.sm90_source("tiled", scalars, target_tile))
before = fork_compile.on_disk(source)
child = fork_compile.Child([source])
outcome = child.wait()
after = fork_compile.on_disk(source)
broken = fork_compile.Source(*ptx.sm90_source("tiled", scalars, broken_tile))
other = fork_compile.Source(*ptx.sm90_source("tiled", scalars, dict(target_tile, BLOCK_N=32)))
failed = fork_compile.Child([broken, other]).wait()

def no_front_end(*args, **kwargs):
    raise AssertionError("the front end ran in the parent")

ASTSource.make_ir = no_front_end
kernel = triton.compile(source.src, target=source.target, options=source.options)
print(json.dumps({"before": before, "outcome": outcome, "after": after, "wait_again": child.wait(),
                  "ptx": "ld.global" in kernel.asm["ptx"] or "cp.async" in kernel.asm["ptx"], "failed": failed,
                  "other": fork_compile.on_disk(other)}))
"""


def test_a_child_fills_the_cache_the_parent_then_loads_from(tmp_path):
    broken = dict(TILE, num_warps=3)  # not a power of two: Triton refuses the options
    out = outside_interpreter(CHILD, json.dumps([TILE, broken, SCALARS]), env={"TRITON_CACHE_DIR": str(tmp_path)})
    report = json.loads(out.splitlines()[-1])
    assert report["before"] is False and report["outcome"] == "ok" and report["after"] is True
    assert report["wait_again"] == "ok" and report["ptx"] is True
    assert report["failed"] != "ok" and "num_warps" in report["failed"]
    assert report["other"] is True  # the kernel after the broken one was compiled all the same


ROUND_TRIP = """
import json
import os
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import serialize_specialization_data

backend = make_backend(GPUTarget("cuda", 90, 32))
options = backend.parse_options({"num_warps": 8, "num_stages": 4})
data = serialize_specialization_data("k", {"a": "*bf16"}, {}, {}, options, "key")
back = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(data)["options"].items()}
print(json.dumps(backend.parse_options(back).hash() == options.hash()))
"""


def test_options_keep_their_cache_key_through_the_hooks_json():
    """The hook gets the JIT's options as JSON only; read back they must key the same binary."""
    assert outside_interpreter(ROUND_TRIP).split() == ["true"]


KEYS = """
import json, sys
import ptx
from gemmtune.tuning import fork_compile

tiles, scalars = json.loads(sys.argv[1])
keys = [fork_compile.launcher_key(fork_compile.Source(*ptx.sm90_source("tiled", scalars, t))) for t in tiles]
print(json.dumps([keys[0] is not None, len(set(keys))]))
"""


def test_candidates_of_one_kernel_share_a_launcher_built_once():
    """A launcher's C build (0.3 s) depends on the signature alone: one per kernel, not per tile."""
    other = dict(TILE, BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=4)
    assert json.loads(outside_interpreter(KEYS, json.dumps([[TILE, other], SCALARS])).splitlines()[-1]) == [True, 1]
    described = fork_compile.Source(SimpleNamespace(signature={"a_desc": "tensordesc<bf16[64, 64]>", "M": "i32"}),
                                    None, {})
    assert fork_compile.launcher_key(described) is None  # its launcher waits for the compiled kernel


def test_outside_a_capture_the_hook_defers_to_the_one_it_replaced():
    seen = []
    hook = fork_compile._Hook(lambda **kwargs: seen.append(kwargs) or "theirs")
    assert hook(key=1, fn=None, compile={}) == "theirs" and seen == [{"key": 1, "fn": None, "compile": {}}]
    assert fork_compile._Hook(None)(key=1, fn=None, compile={}) is None


def test_forking_follows_the_setting(monkeypatch):
    monkeypatch.setenv("GEMMTUNE_COMPILE_FORK", "0")
    assert not fork_compile.usable()
    monkeypatch.setenv("GEMMTUNE_COMPILE_FORK", "1")
    assert fork_compile.usable() == hasattr(os, "fork")
    monkeypatch.setenv("GEMMTUNE_COMPILE_FORK", "yes")
    with pytest.raises(ValueError, match="GEMMTUNE_COMPILE_FORK"):
        settings.compile_fork()


def test_no_child_for_operands_off_the_gpu():
    cpu_operands = (__import__("torch").ones(2, 2),)
    assert compiler._fork_children([(None, "triton_tiled", {}, cpu_operands)], None, 4) == [[]]


@pytest.mark.gpu
def test_compiling_ahead_loads_what_children_compiled(monkeypatch, tmp_path):
    """On a fresh Triton cache, every candidate compiled ahead is compiled by a child and loaded
    from the cache by its thread, and each launches."""
    from triton import knobs

    from gemmtune.device import current
    from gemmtune.problem import Problem
    from gemmtune.results import Status
    from gemmtune.tuning import verify

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    _forget_compiled_kernels(monkeypatch)
    problem = Problem(300, 520, 264, "bfloat16", "linear", bias=True, activation="gelu_tanh")
    operands = verify.make_operands(problem, "cuda", seed=0)
    configs = [{"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
               {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": 4}]
    jobs = [(problem, "triton_tiled", c, operands) for c in configs]
    jobs.append((problem, "triton_splitk", {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4, "USE_DOT": True,
                                            "num_warps": 4, "num_stages": 3}, operands))
    jobs.append((problem, "triton_persistent", {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                                                "num_warps": 8, "num_stages": 3, "WARP_SPECIALIZE": False}, operands))
    forked, hits = [], []
    real_child = fork_compile.Child
    monkeypatch.setattr(fork_compile, "Child", lambda *a, **kw: forked.append(real_child(*a, **kw)) or forked[-1])
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    done = compiler.compile_ahead(jobs, current())
    assert [d.status for d in done] == [Status.OK] * len(jobs), [d.reason for d in done]
    assert len(forked) == len(jobs) and all(child.outcome == "ok" for child in forked)
    assert hits and all(hits)  # every compile in this process found its binary on disk
    assert compiler._fork_children(jobs, current(), 4) == [[]] * len(jobs)  # all on disk now: no child


def test_jobs_share_at_most_workers_children_and_wait_for_their_launchers_builder(monkeypatch):
    def source(name, kind="*bf16"):
        return fork_compile.Source(SimpleNamespace(signature={"a_ptr": kind}, name=name), None, {})

    tiled, other, described = source("t"), source("o", "*fp32"), source("d", "tensordesc<bf16[64, 64]>")
    captured = {0: [tiled], 1: [], 2: [tiled, other], 3: [described], 4: [tiled]}
    made = []

    class Child:
        def __init__(self, sources, early=()):
            self.sources, self.early = sources, list(early)
            made.append(self)

    monkeypatch.setattr(fork_compile, "usable", lambda: True)
    monkeypatch.setattr(fork_compile, "Child", Child)
    monkeypatch.setattr(compiler, "_capture", lambda job, device: captured[job[0]])
    waits = compiler._fork_children([(i, "x", {}, ()) for i in range(5)], None, 2)
    first, second = made  # two workers: two children, the jobs with kernels dealt out in turn
    assert first.sources == [tiled, described] and second.sources == [tiled, other, tiled]
    assert first.early == [tiled] and second.early == [other]  # one launcher build per signature
    assert waits[1] == [] and waits[0] == [first] and waits[3] == [first]
    assert waits[2] == [first, second] and waits[4] == [first, second]
    # no second child to be had (no memory, no processes left): its jobs compile in their threads
    made.clear()

    def fork_once(sources, early=()):
        if made:
            raise OSError(11, "Resource temporarily unavailable")
        return Child(sources, early)

    monkeypatch.setattr(fork_compile, "Child", fork_once)
    waits = compiler._fork_children([(i, "x", {}, ()) for i in range(5)], None, 2)
    (first,) = made
    assert waits == [[first], [], [first], [first], [first]]


def test_a_failed_fork_raises_and_leaves_no_pipe_open(monkeypatch):
    def no_fork():
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(fork_compile.os, "fork", no_fork)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="memory"):
        fork_compile.Child([])
    assert len(os.listdir("/proc/self/fd")) == before


def _forget_compiled_kernels(monkeypatch) -> None:
    """A fresh start for a test run after others in one process: the kernels the backends' modules
    hold compiled in memory are dropped (so they are compiled again, here from a fresh on-disk
    cache), and forking is on even where an earlier test's child missed its deadline."""
    import sys

    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(fork_compile, "_gave_up", False)
    for name, module in list(sys.modules.items()):
        if name.startswith("gemmtune.backends.kernels."):
            for value in vars(module).values():
                if isinstance(value, JITFunction):
                    value.device_caches.clear()
