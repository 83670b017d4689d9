"""``triton_scaled``: gemmtune's Triton GEMM for fp8 (scaled) products, its config, and a search
space scaled to the device and pruned before anything is compiled.

It serves ``Problem.scaled`` problems alone (fp8 e4m3fn or e5m2 inputs, tensor, row or block
scales, an output of bfloat16, float16 or float32) and is called as
``kernel(a, b, bias, scale_a, scale_b, out=None)`` (``ScaledKernel``). How each scaling is
applied, and what FAST_ACC and SPLIT_K do, is in ``kernels/scaled.py``. In short:

- FAST_ACC=1: Triton's default fp8 ``tl.dot``. On sm_90 that accumulates the whole K loop in
  wgmma's reduced-precision accumulator (Triton 3.6 sets ``max_num_imprecise_acc_default`` to
  2**30 for capability 90: ``backends/nvidia/compiler.py``), as cuBLAS's fast accumulation does.
- FAST_ACC=0: precise: the partial sum is promoted to fp32 every min(BLOCK_K, 128) elements of K
  (``max_num_imprecise_acc``), paying a second accumulator's registers and fp32 adds.

The two differ only on Hopper's wgmma tiles (BLOCK_M a multiple of 64, four warps or more) with
tensor or row scaling: block scaling promotes every K tile anyway, and other GPUs and mma.sync
tiles accumulate in fp32. The space offers FAST_ACC=1 only where it differs. Fast accumulation
can exceed the fp8 tolerance at large K (measured: K = 14336 on an H100); verification
(``gemmtune.tuning.verify``) then rejects the config as a failed trial.

At M = 1 the space adds the GEMV form (BLOCK_M = 1, ``GEMV_TILES``): the product is memory
bound, the weights read once, and tensor-core tiles read them at about 1.3 TB/s on an H100
where triton_splitk's bf16 GEMV reads 2.2-2.8; the GEMV form reads fp8 weights the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gemmtune.backends import costmodel
from gemmtune.backends.base import FieldConfig, KernelBase, check_bounds, config_from_mapping, triton_runs
from gemmtune.backends.launch import Launcher
# the tiled kernel's tile vocabulary: the same tiles, warps, pipelines and limits, one byte a value
from gemmtune.backends.triton_tiled import (BLOCK_SIZES, GROUP_SIZES, MAX_ACC_REGS, MAX_ELEMENTS, STAGE_CHOICES,
                                            STAGES, STREAMING_STAGES, WARPS, deep_tile, next_pow2)
from gemmtune.device import Device
from gemmtune.problem import SCALE_BLOCK, Problem, torch_dtypes
from gemmtune.scaling import check_scales

K_BLOCK_SIZES = (32, 64, 128, 256)  # an fp8 tensor-core product takes K in steps of 32
SPLITS = (1, 2, 4, 8, 16)
FAST_ACC = (0, 1)
MAX_SPLIT_M = 32  # K is split for decode shapes only
# Partials written and read back (8 bytes per fp32 element) may cost at most this fraction of the
# weight bytes (triton_splitk's rule): more splits trade weight bandwidth for workspace bandwidth.
MAX_WORKSPACE_TRAFFIC = 0.25
REDUCE_BLOCK_N = 128  # columns per program of the split-K reduction
# How far behind its precise twin a FAST_ACC=1 config is ranked. Measured on an H100 (torch
# 2.11, triton 3.6): on every prefill shape of the fp8 suite (M >= 2048, K >= 4096) each fast
# config's result was beyond the fp8 tolerance (1.16-1.2x at its worst element), so a top-k that
# ranked the fast twins first screened six failures and no precise config at all.
FAST_ACC_RISK = 1.05

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps): triton_tiled's shapes with K twice as deep (a K tile
# of 1-byte inputs holds as many bytes as one of half the depth in 16 bits), from compute-bound
# tiles down to the thin ones decode needs. Stages are added per device below.
TILES = (
    (128, 256, 128, 8), (256, 128, 128, 8), (128, 128, 128, 8), (128, 128, 128, 4), (128, 128, 64, 4),
    (64, 256, 128, 8), (256, 64, 128, 8), (64, 128, 128, 4), (128, 64, 128, 4), (64, 64, 128, 4),
    (64, 64, 64, 4), (64, 32, 128, 4), (32, 128, 128, 4), (32, 64, 128, 4), (32, 32, 128, 2),
    (16, 256, 128, 4), (16, 128, 256, 4), (16, 64, 256, 4), (16, 64, 128, 4), (16, 32, 256, 2),
    (16, 32, 128, 2),
)
INTERPRETER_TILES = ((16, 16, 32, 1), (32, 32, 64, 1))
# M = 1 alone, BLOCK_M = 1: the GEMV form's (BLOCK_N, BLOCK_K, num_warps, num_stages), triton_splitk's
# GEMV_TILES with K twice as deep for 1-byte weights, so that each thread still loads one 16-byte
# vector per weight row per K step: register-direct tiles (stage 1) of one to four weight rows,
# which led the bf16 GEMV at 132 SMs, and two pipelined ones for GPUs with few SMs, where each
# SM must keep more bytes in flight. BLOCK_K is a multiple of the scale block (block scaling
# folds the tile into 128-wide chunks), BLOCK_N divides it (a tile lies in one block of B's rows).
GEMV_TILES = ((1, 4096, 8, 1), (1, 2048, 4, 1), (2, 4096, 4, 1), (4, 2048, 4, 1), (8, 1024, 4, 4), (16, 512, 4, 4))
INTERPRETER_GEMV_TILES = ((1, 256, 1, 1), (4, 128, 1, 1))
GEMV_BLOCK_N = (1, 2, 4, 8, 16)
GEMV_BLOCK_K = (128, 256, 512, 1024, 2048, 4096)
INTERPRETER_SPLITS = (1, 2)


@dataclass(frozen=True)
class ScaledConfig(FieldConfig):
    FIELDS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_K": "block_k", "GROUP_M": "group_m",
              "SPLIT_K": "split_k", "FAST_ACC": "fast_acc", "num_warps": "num_warps",
              "num_stages": "num_stages"}  # persisted name -> attribute

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split_k: int = 1
    fast_acc: int = 0
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        """BLOCK_M = 1 is the GEMV form: its own tile sizes, and FAST_ACC=0 alone (no tensor cores)."""
        check_bounds("triton_scaled", (("BLOCK_M", self.block_m, (1, *BLOCK_SIZES)),))
        if self.gemv:
            where = " with BLOCK_M=1"
            tile = (("BLOCK_N", self.block_n, GEMV_BLOCK_N, where), ("BLOCK_K", self.block_k, GEMV_BLOCK_K, where),
                    ("FAST_ACC", self.fast_acc, (0,), where))
        else:
            tile = (("BLOCK_N", self.block_n, BLOCK_SIZES), ("BLOCK_K", self.block_k, K_BLOCK_SIZES),
                    ("FAST_ACC", self.fast_acc, FAST_ACC))
        check_bounds("triton_scaled", tile + (
            ("GROUP_M", self.group_m, GROUP_SIZES), ("SPLIT_K", self.split_k, SPLITS),
            ("num_warps", self.num_warps, WARPS), ("num_stages", self.num_stages, STAGES)))

    @property
    def gemv(self) -> bool:
        """Whether this is the GEMV form (one row of A per program, no tensor cores)."""
        return self.block_m == 1

    def smem_bytes(self) -> int:
        """Shared memory the software pipeline holds: one A and one B tile of 1-byte inputs per
        stage."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k

    def acc_regs_per_thread(self, scaling: str) -> int:
        """fp32 accumulator registers per thread: two sets where each K tile's product (block
        scaling) or each promoted run (FAST_ACC=0) has its own beside the sum; the GEMV form's one
        per weight element of a K step."""
        if self.gemv:
            return self.block_n * self.block_k // (32 * self.num_warps)
        doubled = scaling == "block" or not self.fast_acc
        return self.block_m * self.block_n // (32 * self.num_warps) * (2 if doubled else 1)

    def programs(self, problem: Problem) -> int:
        return -(-problem.m // self.block_m) * -(-problem.n // self.block_n) * self.split_k


def _wgmma(block_m: int, num_warps: int) -> bool:
    """Whether Triton lowers this tile's product to Hopper's wgmma (M a multiple of 64 over
    warpgroups), the one instruction whose fp8 accumulation FAST_ACC changes."""
    return block_m % 64 == 0 and num_warps % 4 == 0


def _fast_accs(problem: Problem, device: Device, block_m: int, num_warps: int) -> tuple[int, ...]:
    """FAST_ACC values that compile to different kernels for this tile: both on Hopper's wgmma
    tiles with tensor or row scaling, the precise one alone elsewhere."""
    if device.is_hopper and problem.scaling != "block" and _wgmma(block_m, num_warps):
        return (1, 0)
    return (0,)


def splits(problem: Problem, device: Device, tiles: int, block_k: int) -> tuple[int, ...]:
    """SPLIT_K values worth trying for a grid of ``tiles`` output tiles: more than one for decode
    shapes (M <= MAX_SPLIT_M) whose tiles leave SMs idle, each slice at least two K tiles, no more
    programs than two waves, and workspace traffic within MAX_WORKSPACE_TRAFFIC."""
    if problem.m > MAX_SPLIT_M:
        return (1,)
    if device.interpreter:
        return INTERPRETER_SPLITS
    if tiles >= device.sm_count:
        return (1,)
    k_tiles = -(-problem.k // block_k)
    weights = problem.n * problem.k * problem.element_size
    return tuple(s for s in SPLITS if s == 1 or (
        k_tiles >= 2 * s and tiles * s <= 2 * device.sm_count
        and 8 * s * problem.m * problem.n <= MAX_WORKSPACE_TRAFFIC * weights))


def space(problem: Problem, device: Device) -> list[ScaledConfig]:
    """Every config this device can run on this scaled problem, before measuring anything: the
    tiled form's, and at M = 1 the GEMV form's too (the cost model ranks them, the tuner measures).

    Dropped before compiling: tiles larger than the problem, K tiles that do not divide 128 under
    block scaling (each must lie in one scale block), pipelines needing more shared memory than a
    block may have, accumulators that would spill, and grids that leave most SMs idle where
    another fills them. Never empty: a small tile is the fallback.
    """
    configs = _tiled(problem, device) + (_gemvs(problem, device) if problem.m == 1 else [])
    configs = [c for c in configs if c.smem_bytes() <= device.smem_per_block
               and c.acc_regs_per_thread(problem.scaling) <= MAX_ACC_REGS]
    if not configs:  # a tiny device: the smallest tile with the shallowest pipeline
        configs = [ScaledConfig(16, 16, 32, 8, 1, 0, 2, 2)]
    occupancy = {c: min(1.0, c.programs(problem) / device.sm_count) for c in configs}
    best = max(occupancy.values())
    return [c for c in configs if occupancy[c] >= best / 4]


def _fits(problem: Problem, block_n: int, block_k: int) -> bool:
    """Whether a tile is no larger than the problem's N and K (each rounded up to a power of two)."""
    return block_n <= max(16, next_pow2(problem.n)) and block_k <= max(32, next_pow2(problem.k))


def _gemvs(problem: Problem, device: Device) -> list[ScaledConfig]:
    """The GEMV form's configs: its tiles, each split that ``splits`` allows."""
    tiles = INTERPRETER_GEMV_TILES if device.interpreter else GEMV_TILES
    return [ScaledConfig(1, bn, bk, 8, split, 0, warps, stages)
            for bn, bk, warps, stages in tiles if _fits(problem, bn, bk)
            for split in splits(problem, device, -(-problem.n // bn), bk)]


def _tiled(problem: Problem, device: Device) -> list[ScaledConfig]:
    """The tiled form's configs: each tile that fits, its stages, FAST_ACC values and splits."""
    if device.interpreter:
        tiles, stages = INTERPRETER_TILES, (1,)
    else:
        tiles, stages = TILES, STAGE_CHOICES
    configs = []
    for bm, bn, bk, warps in tiles:
        if bm > max(16, next_pow2(problem.m)) or not _fits(problem, bn, bk):
            continue
        if problem.scaling == "block" and SCALE_BLOCK % bk:
            continue
        grid = -(-problem.m // bm) * -(-problem.n // bn)
        deep = STREAMING_STAGES if deep_tile(bm, bn) and not device.interpreter else ()
        for s in stages + deep:
            for fast in _fast_accs(problem, device, bm, warps):
                configs += [ScaledConfig(bm, bn, bk, 8, split, fast, warps, s)
                            for split in splits(problem, device, grid, bk)]
    return configs


def scale_strides(t) -> tuple[int, int]:
    """A scale tensor's first two strides, 0 for dimensions it lacks."""
    strides = t.stride()
    return (strides + (0, 0))[:2]


class ScaledKernel(KernelBase):
    """One (problem, config), launched through its compiled binary (``launch.Launcher``: the first
    call with a guard goes through Triton's JIT, which compiles or loads it):
    ``kernel(a, b, bias, scale_a, scale_b, out=None)`` with a (M, K) and b (N, K) fp8, bias (N,)
    in the output dtype or None, float32 scales as ``Problem.scaling`` lays them, and out (M, N)
    in the output dtype (allocated when None). Any strides. With SPLIT_K > 1 each call allocates
    its fp32 workspace from torch's caching allocator (stream-ordered, capturable)."""

    def __init__(self, problem: Problem, config: ScaledConfig) -> None:
        from gemmtune.backends.kernels.scaled import scaled_matmul  # imports triton

        self._matmul = Launcher(scaled_matmul)
        self._reduce = SplitReduce(problem, config.split_k, config.block_m) if config.split_k > 1 else None
        self._config = config
        self._scaling = problem.scaling
        self._out_dtype = torch_dtypes()[problem.out_dtype]
        base = dict(SCALING=problem.scaling, ACTIVATION=problem.activation, EVEN_K=problem.k % config.block_k == 0,
                    EVEN_N=problem.n % config.block_n == 0, FAST_ACC=config.fast_acc, SPLIT_K=config.split_k,
                    BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                    num_warps=config.num_warps, num_stages=config.num_stages)
        self._constexprs = {False: dict(base, HAS_BIAS=False), True: dict(base, HAS_BIAS=True)}

    def __call__(self, a, b, bias, scale_a, scale_b, out=None):
        cfg = self._config
        (m, k), n = a.shape, b.shape[0]
        check_scales(self._scaling, m, n, k, scale_a, scale_b)
        if out is None:
            out = a.new_empty((m, n), dtype=self._out_dtype)
        has_bias = bias is not None
        bias_arg, stride_bias = (bias, bias.stride(0)) if has_bias else (out, 0)
        (sam, sak), (sbn, sbk) = scale_strides(scale_a), scale_strides(scale_b)
        tiles_k = -(-k // cfg.block_k)
        k_tiles = -(-tiles_k // cfg.split_k)  # per slice
        ws = out if cfg.split_k == 1 else a.new_empty((cfg.split_k, m, n), dtype=torch.float32)
        tensors = (a, b, out, bias_arg, scale_a, scale_b, ws)
        pointers = tuple(t.data_ptr() for t in tensors)
        # everything Triton specializes on: the devices, dtypes, shapes and exact strides of every
        # tensor (the sizes and k_tiles follow) and each address's offset from 16 bytes
        guard = (a.get_device(), *((t.get_device(), t.dtype, t.shape, t.stride()) for t in tensors),
                 tuple(p & 15 for p in pointers), has_bias)
        grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n), cfg.split_k, 1)
        scalars = (m, n, k, k_tiles, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                   stride_bias, sam, sak, sbn, sbk)
        self._matmul(grid, guard, tensors, pointers, scalars, self._constexprs[has_bias])
        if self._reduce is not None:
            self._reduce(guard, ws, out, bias, scale_a, scale_b)
        return out


class SplitReduce:
    """``scaled_reduce`` for one problem and split: the sum of a [SPLIT_K, M, N] fp32 workspace of
    partials in slice order, through the epilogue (tensor or row scales, bias, activation, cast)."""

    def __init__(self, problem: Problem, split_k: int, block_m: int) -> None:
        from gemmtune.backends.kernels.scaled import scaled_reduce  # imports triton

        self._launch = Launcher(scaled_reduce)
        base = dict(SCALING=problem.scaling, ACTIVATION=problem.activation, SPLIT_K=split_k,
                    BLOCK_M=min(block_m, 32), BLOCK_N=REDUCE_BLOCK_N, num_warps=4)
        self._constexprs = {bias: dict(base, HAS_BIAS=bias) for bias in (False, True)}

    def __call__(self, guard: tuple, ws, out, bias, scale_a, scale_b) -> None:
        """``guard``: the product's (it covers the workspace's); ``bias`` None or (N,)."""
        (m, n), rc = out.shape, self._constexprs[bias is not None]
        bias_arg, stride_bias = (bias, bias.stride(0)) if bias is not None else (out, 0)
        tensors = (ws, out, bias_arg, scale_a, scale_b)
        grid = (-(-n // rc["BLOCK_N"]), -(-m // rc["BLOCK_M"]), 1)
        scalars = (m, n, out.stride(0), out.stride(1), stride_bias, scale_strides(scale_a)[0],
                   scale_strides(scale_b)[0])
        self._launch(grid, guard, tensors, tuple(t.data_ptr() for t in tensors), scalars, rc)


def _table_size() -> int:
    """Configs the full table makes before a device and problem prune it: each tile's stages, both
    FAST_ACC values on wgmma tiles, every split on decode tiles; each GEMV tile's splits."""
    tiled = sum((len(STAGE_CHOICES) + len(STREAMING_STAGES) * deep_tile(bm, bn)) * (2 if _wgmma(bm, warps) else 1)
                * (len(SPLITS) if bm <= MAX_SPLIT_M else 1) for bm, bn, _, warps in TILES)
    return tiled + len(GEMV_TILES) * len(SPLITS)


class TritonScaledBackend:
    name = "triton_scaled"
    space_size = _table_size()

    def is_available(self, device: Device) -> bool:
        """Triton runs there, with fp8 tensor cores (Ada, Hopper and later) on a GPU."""
        return triton_runs(device) and (device.interpreter or device.capability >= (8, 9))

    def supports(self, problem: Problem) -> bool:
        sizes = (problem.m * problem.k, problem.k * problem.n, problem.m * problem.n)
        return problem.scaled and max(sizes) <= MAX_ELEMENTS

    def candidates(self, problem: Problem, device: Device) -> list[ScaledConfig]:
        return space(problem, device) if self.supports(problem) else []

    def predict_ms(self, problem: Problem, device: Device, config: ScaledConfig) -> float | None:
        """Decode shapes as a split-K weight stream (the reduction a launch of its own): the GEMV
        form bound by bandwidth alone (``costmodel.gemv_ms``, which ranks it ahead of the tiles),
        the tiled one by the bytes its pipelines keep in flight; the others as a tiled roofline;
        a fast config just behind its precise twin (``FAST_ACC_RISK``)."""
        c = config
        if c.gemv:
            ms = costmodel.gemv_ms(problem, device, c.block_n, c.split_k)
        elif problem.m <= MAX_SPLIT_M:
            ms = costmodel.splitk_ms(problem, device, c.block_m, c.block_n, c.split_k, c.block_k, c.num_stages,
                                     num_warps=c.num_warps)
        else:
            ms = costmodel.tile_gemm_ms(problem, device, c.block_m, c.block_n, c.block_k, c.num_stages)
        ms += costmodel.LAUNCH_MS if c.split_k > 1 else 0.0
        if c.fast_acc:
            ms *= FAST_ACC_RISK
        return ms

    def parse_config(self, data: Mapping) -> ScaledConfig:
        return config_from_mapping(self.name, data, ScaledConfig)

    def build(self, problem: Problem, config: ScaledConfig, device: Device) -> ScaledKernel:
        if not problem.scaled:
            raise ValueError(f"triton_scaled serves fp8 (scaled) problems only, got {problem.describe()}")
        if problem.scaling == "block" and not config.gemv and SCALE_BLOCK % config.block_k:
            raise ValueError(f"triton_scaled BLOCK_K={config.block_k} does not divide the scale block "
                             f"({SCALE_BLOCK}) of block scaling; accepted: 32, 64, 128")
        if config.split_k * problem.m * problem.n > MAX_ELEMENTS:
            raise ValueError(f"triton_scaled SPLIT_K={config.split_k}: the workspace of {problem.describe()} would "
                             f"pass the kernel's int32 indexing; accepted: SPLIT_K * M * N <= {MAX_ELEMENTS}")
        return ScaledKernel(problem, config)


BACKEND = TritonScaledBackend()
