"""``triton_splitk``: a split-K Triton GEMM for decode and other small-M shapes (M <= 64).

At M <= 64 a GEMM streams its weights once and does little arithmetic on them: it is bound by
memory bandwidth, and only a grid that keeps every SM loading saturates it. Tiles along N alone
are too few (qkv decode, N=6144, in 64-wide tiles: 96 programs on 132 SMs), so K is split as
well and the partial sums are reduced in the same launch (see kernels/splitk.py). Tiny M uses
an FMA inner product instead of tensor cores, which would waste most of a 16-row instruction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gemmtune.backends import costmodel
from gemmtune.backends.base import BoundCall, FieldConfig, KernelBase, check_bounds, config_from_mapping, triton_runs
from gemmtune.backends.launch import Launcher, bind_gemm, gemm_call, gemm_hints
from gemmtune.device import Device
from gemmtune.problem import Problem

MAX_M = 64  # larger M is compute-bound enough for triton_tiled and cuBLAS
FMA_BLOCK_M = (1, 2, 4, 8, 16)
DOT_BLOCK_M = (16, 32, 64)
BLOCK_N = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BLOCK_K = (32, 64, 128, 256, 512, 1024, 2048, 4096)
SPLIT_K = (1, 2, 4, 8, 16, 32)
WARPS = (1, 2, 4, 8, 16)
STAGES = (1, 2, 3, 4, 5, 6)
MAX_ELEMENTS = 2**31 - 1  # the kernel indexes in int32
# fp32 products per thread per K step in the FMA form, above which ptxas spills
MAX_FMA_REGS = 128
# Partials written and read back (8 bytes per fp32 element) may cost at most this fraction of
# the weight bytes: more splits than that trade weight bandwidth for workspace bandwidth.
MAX_WORKSPACE_TRAFFIC = 0.25

# (BLOCK_N, BLOCK_K, num_warps, num_stages) per inner-product form. FMA tiles are wide along K
# (the weights' contiguous dimension) for 16-byte loads; the 16-wide ones serve M up to 16.
# Stage 1 FMA tiles load straight into registers, as hand-written GEMVs do; the others go
# through the software pipeline's shared memory. The narrowest (4 or 8 weight rows, K in 1024
# or 2048 steps) are GEMV shapes: thousands of programs, many resident per SM, each keeping
# 8-16 KB of weights in flight without a pipeline.
FMA_TILES = ((16, 512, 4, 1), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 1), (64, 256, 4, 3),
             (128, 128, 8, 3), (16, 128, 4, 3), (16, 64, 2, 4),
             (4, 1024, 4, 1), (8, 1024, 4, 1), (4, 2048, 8, 1), (8, 2048, 8, 1), (16, 1024, 8, 1))
# M = 1 alone: the GEMV tiles (one row of A, no tensor cores), six so that top-k measures all of
# them. At 132 SMs the register-direct tiles (stage 1) win: one weight row per program, each
# thread loading one 16-byte vector per K step, led all four m=1 rows of the Llama when every
# tile was timed side by side on the H200 (docs/performance.md, decode); at 38 SMs, where each SM must keep
# about three times the bytes in flight, the pipelined ones (4 stages in shared memory) win by
# 15-40% over them (docs/small-gpus.md, decode on few SMs).
GEMV_TILES = ((1, 2048, 8, 1), (1, 1024, 4, 1), (2, 2048, 2, 1), (8, 256, 2, 4), (16, 256, 2, 4), (8, 512, 4, 4))
# Tensor-core tiles; the 16- and 32-wide ones on 2 warps won the m=16 rows of the same sweep.
DOT_TILES = ((32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 64, 4, 4),
             (256, 64, 8, 3), (16, 512, 2, 3), (16, 256, 2, 5), (32, 128, 2, 3))
# Under the interpreter: (USE_DOT, BLOCK_N, BLOCK_K, SPLIT_K), one warp, no pipeline.
INTERPRETER_TILES = ((False, 16, 32, 1), (False, 32, 64, 2), (True, 16, 32, 2), (True, 32, 64, 1))


@dataclass(frozen=True)
class SplitKConfig(FieldConfig):
    FIELDS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_K": "block_k", "SPLIT_K": "split_k",
              "USE_DOT": "use_dot", "num_warps": "num_warps", "num_stages": "num_stages"}  # persisted name -> attribute

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.use_dot, bool):
            raise ValueError(f"triton_splitk USE_DOT={self.use_dot!r} is out of bounds; accepted: (False, True)")
        block_m = DOT_BLOCK_M if self.use_dot else FMA_BLOCK_M
        check_bounds("triton_splitk", (
            ("BLOCK_M", self.block_m, block_m, f" with USE_DOT={self.use_dot}"), ("BLOCK_N", self.block_n, BLOCK_N),
            ("BLOCK_K", self.block_k, BLOCK_K), ("SPLIT_K", self.split_k, SPLIT_K),
            ("num_warps", self.num_warps, WARPS), ("num_stages", self.num_stages, STAGES)))

    def smem_bytes(self, element_size: int) -> int:
        """Shared memory the software pipeline holds: one A and one B tile per stage."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * element_size

    def fma_regs_per_thread(self) -> int:
        """fp32 products each thread holds per K step in the FMA form (0 for the dot form)."""
        return 0 if self.use_dot else self.block_m * self.block_n * self.block_k // (32 * self.num_warps)

    def programs(self, problem: Problem) -> int:
        return -(-problem.n // self.block_n) * self.split_k * -(-problem.m // self.block_m)




def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _fits(problem: Problem, device: Device, c: SplitKConfig) -> bool:
    """Whether ``c`` is worth compiling for ``problem``: shape, shared memory, registers."""
    if c.block_n > max(16, _next_pow2(problem.n)) or c.block_k > max(32, _next_pow2(problem.k)):
        return False
    if c.split_k > 1:
        if problem.k < c.split_k * c.block_k:  # every slice at least one full K step
            return False
        traffic = 8 * c.split_k * problem.m * problem.n
        if traffic > MAX_WORKSPACE_TRAFFIC * problem.element_size * problem.n * problem.k:
            return False
    return (c.smem_bytes(problem.element_size) <= device.smem_per_block
            and c.fma_regs_per_thread() <= MAX_FMA_REGS)


def _block_m(problem: Problem, use_dot: bool) -> int | None:
    """The one BLOCK_M that covers M in this form, or None when the form cannot."""
    fit = _next_pow2(problem.m)
    if use_dot:
        return max(16, fit)
    return fit if fit <= FMA_BLOCK_M[-1] else None


def space(problem: Problem, device: Device) -> list[SplitKConfig]:
    """The configs worth compiling for a small-M problem on this device; [] for M > 64.

    One BLOCK_M covers M; M = 1 takes the GEMV tiles alone. Pipelines are made no deeper than a
    slice has K steps, and shallower where shared memory is short. Dropped before compiling:
    tiles larger than N or K, splits that leave a slice shorter than one K step or move more
    partial sums than a quarter of the weight bytes, shared memory past the device's limit, FMA
    tiles that would spill. Of the rest, a split is kept only while half of it would not already
    give two waves, then grids that fill the SMs are kept (those with the most programs where
    none does). Never empty.
    """
    if problem.m > MAX_M:
        return []
    if device.interpreter:
        raw = [(dot, bn, bk, s, 1, 1) for dot, bn, bk, s in INTERPRETER_TILES]
    elif problem.m == 1:
        raw = [(False, bn, bk, s, warps, stages) for bn, bk, warps, stages in GEMV_TILES for s in SPLIT_K]
    else:
        raw = [(dot, bn, bk, s, warps, stages)
               for dot, tiles in ((False, FMA_TILES), (True, DOT_TILES))
               for bn, bk, warps, stages in tiles for s in SPLIT_K]
    configs = []
    for dot, bn, bk, s, warps, stages in raw:
        bm = _block_m(problem, dot)
        if bm is None:
            continue
        # No deeper pipeline than a slice has K steps, and shallower where shared memory is short
        stages = max(1, min(stages, -(-problem.k // (s * bk))))
        while stages > 1 and stages * (bm + bn) * bk * problem.element_size > device.smem_per_block:
            stages -= 1
        config = SplitKConfig(bm, bn, bk, s, dot, warps, stages)
        if _fits(problem, device, config):
            configs.append(config)
    configs = list(dict.fromkeys(configs))
    if not configs:  # a tiny device or problem: one row-block, the smallest tile, no split
        dot = _block_m(problem, False) is None
        configs = [SplitKConfig(_block_m(problem, dot), 16, 32, 1, dot, 2, 1)]
    if not device.interpreter:
        configs = [c for c in configs if c.split_k == 1
                   or c.programs(problem) // 2 < 2 * device.sm_count]
    filling = [c for c in configs if c.programs(problem) >= device.sm_count]
    if filling:
        return filling
    most = max(c.programs(problem) for c in configs)
    return [c for c in configs if c.programs(problem) == most]


class SplitKKernel(KernelBase):
    """A compiled-on-first-call launcher for one (problem, config).

    Owns the split-K workspace (fp32 partials) and the per-tile arrival counters, allocated on
    the first call on a device and reused by every later call: the kernel leaves each counter
    at zero when it finishes a tile, so they are zeroed once, here, and never again. Calls on
    one kernel object must therefore not run concurrently on two streams.
    """

    serves_any_rank = True  # x (..., K) in layout linear: launch.gemm_call takes its rows in place

    def __init__(self, problem: Problem, config: SplitKConfig) -> None:
        from gemmtune.backends.kernels.splitk import splitk_matmul  # imports triton: only once a kernel is built

        self._launch = Launcher(splitk_matmul, gemm_hints)
        self._linear = problem.layout == "linear"
        self._config = config
        self._scratch: dict[tuple, tuple] = {}  # (device, m, n) -> workspace, counters and their addresses
        base = dict(
            ACTIVATION=problem.activation, PRECISION="tf32" if problem.tf32 else "ieee",
            USE_DOT=config.use_dot, SPLIT_K=config.split_k, STAGES=config.num_stages,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        # (HAS_BIAS, EVEN_K, EVEN_N) -> every constexpr of a launch
        self._constexprs = {(bias, even_k, even_n): dict(base, HAS_BIAS=bias, EVEN_K=even_k, EVEN_N=even_n)
                            for bias in (False, True) for even_k in (False, True) for even_n in (False, True)}

    def _workspace(self, device: torch.device, m: int, n: int, tiles: int) -> tuple:
        """The partial sums and tile counters for (m, n) on ``device``, with their addresses."""
        key = (device, m, n)
        if key not in self._scratch:
            workspace = torch.empty((self._config.split_k, m, n), dtype=torch.float32, device=device)
            counters = torch.zeros(tiles, dtype=torch.int32, device=device)
            self._scratch[key] = (workspace, counters, workspace.data_ptr(), counters.data_ptr())
        return self._scratch[key]

    def __call__(self, a, b, bias, out=None):
        cfg = self._config
        m, n, k, out, guard, tensors, pointers, strides = gemm_call(a, b, bias, out, self._linear)
        grid, scalars = self._grid_and_scalars(m, n, k, strides)
        if cfg.split_k > 1:
            workspace, counters, pw, pcount = self._workspace(a.device, m, n, grid[0] * grid[2])
        else:  # never touched: the SPLIT_K == 1 path is compiled out
            workspace, counters, pw, pcount = out, out, pointers[2], pointers[2]
        self._launch(grid, guard, (*tensors, workspace, counters), (*pointers, pw, pcount), scalars,
                     self._constexprs[bias is not None, k % (cfg.block_k * cfg.split_k) == 0, n % cfg.block_n == 0])
        return out

    def _grid_and_scalars(self, m: int, n: int, k: int, strides: tuple) -> tuple[tuple[int, int, int], tuple]:
        """The grid (N tiles, K slices, M tiles) and the scalar arguments (K per slice among them)."""
        cfg = self._config
        k_per_split = -(-k // (cfg.block_k * cfg.split_k)) * cfg.block_k
        return (-(-n // cfg.block_n), cfg.split_k, -(-m // cfg.block_m)), (m, n, k, k_per_split, *strides)

    def launch_args(self, a, m: int, n: int, k: int, strides: tuple) -> tuple:
        """For ``launch.bind_gemm``: the grid, the scalars, and the addresses of the partials and
        the tile counters; with one split the kernel never reads them (that path is compiled
        out), so none are passed."""
        grid, scalars = self._grid_and_scalars(m, n, k, strides)
        scratch = self._workspace(a.device, m, n, grid[0] * grid[2])[2:] if self._config.split_k > 1 else (0, 0)
        return grid, scalars, scratch

    def bind(self, a, b, bias) -> BoundCall | None:
        return bind_gemm(self, self._launch, a, b, bias, self._linear)


class TritonSplitKBackend:
    name = "triton_splitk"
    space_size = (len(GEMV_TILES) + len(FMA_TILES) + len(DOT_TILES)) * len(SPLIT_K)  # GEMV_TILES serve M = 1 alone

    def is_available(self, device: Device) -> bool:
        return triton_runs(device) and (device.interpreter or device.capability >= (7, 0))

    def supports(self, problem: Problem) -> bool:
        return problem.m <= MAX_M and problem.k * problem.n <= MAX_ELEMENTS

    def candidates(self, problem: Problem, device: Device) -> list[SplitKConfig]:
        return space(problem, device) if self.supports(problem) else []

    def predict_ms(self, problem: Problem, device: Device, config) -> float | None:
        return costmodel.splitk_ms(problem, device, config.block_m, config.block_n, config.split_k, config.block_k,
                                   config.num_stages, use_dot=config.use_dot, num_warps=config.num_warps)

    def parse_config(self, data: Mapping) -> SplitKConfig:
        return config_from_mapping(self.name, data, SplitKConfig)

    def build(self, problem: Problem, config: SplitKConfig, device: Device) -> SplitKKernel:
        return SplitKKernel(problem, config)


BACKEND = TritonSplitKBackend()
