"""``triton_tiled``: gemmtune's own tiled Triton GEMM, its config, and a search space scaled
to the device (shared memory, registers, SM count) and pruned before anything is compiled."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gemmtune.backends import costmodel
from gemmtune.backends.base import BoundCall, FieldConfig, KernelBase, check_bounds, config_from_mapping, triton_runs
from gemmtune.backends.launch import Launcher, bind_gemm, gemm_call, gemm_hints
from gemmtune.device import Device
from gemmtune.problem import Problem

BLOCK_SIZES = (16, 32, 64, 128, 256)
GROUP_SIZES = (1, 2, 4, 8, 16)
WARPS = (1, 2, 4, 8)
STAGES = (1, 2, 3, 4, 5, 6)
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread above which ptxas spills
MAX_ELEMENTS = 2**31 - 1  # the kernel indexes one product's operands in int32
MAX_BATCH = 65535  # a grid's second axis, the batch: CUDA's limit on it

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps): tile shapes worth trying, from large compute-bound
# tiles down to the thin ones decode shapes need. Stages are added per device below.
TILES = (
    (128, 256, 64, 8), (256, 128, 64, 8), (128, 128, 64, 8), (128, 128, 64, 4), (128, 128, 32, 4),
    (64, 256, 64, 8), (256, 64, 64, 8), (64, 128, 64, 4), (128, 64, 64, 4), (64, 64, 64, 4),
    (64, 64, 32, 4), (64, 32, 64, 4), (32, 128, 64, 4), (32, 64, 64, 4), (32, 32, 64, 2), (16, 256, 64, 4),
    (16, 128, 128, 4), (16, 64, 128, 4), (16, 64, 256, 4), (16, 32, 128, 2), (16, 16, 64, 2),
)
STAGE_CHOICES = (3, 4)
# The thin tiles stream weights (decode): on the H200 a fourth stage beat a third by 7-16% on
# qkv decode (tests/data/h200-tiled-trials.json), so they also get a fifth; so do tiles of at
# most 64x32, whose short K loops on small problems (blog-mlp in float32: 64x32x64 on five
# stages 10.6 us against 11.2 on four, small-h200-20261122-sweep.json) want loads in flight.
STREAMING_STAGES = (5,)
SMALL_TILE = 64 * 32
# float32 without TF32 (tl.dot's "ieee") multiplies with FMAs on the CUDA cores, where the tiles
# that run fastest are not the tensor cores' that the cost model ranks: on an H100 its first six
# for BERT-base's attention scores (384 x 128x128x64) ran 1.31x the fastest of 168 configs
# probed. So these are measured whole, unranked: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
# num_stages), chosen over seven float32 products on an H100 so that each one's fastest probed
# config is within 2% among them (within 7% for the product left out of the choosing, in turn:
# docs/performance.md, float32 on the CUDA cores).
FFMA_CONFIGS = ((128, 64, 16, 4, 4), (64, 64, 16, 4, 4), (128, 64, 32, 4, 2), (32, 64, 16, 4, 3),
                (128, 128, 32, 4, 2), (128, 64, 32, 8, 3), (128, 64, 16, 4, 3), (64, 64, 32, 4, 3))
FFMA_MIN = 32  # a product of at most this many rows or columns keeps the ranked space's thin tiles
INTERPRETER_TILES = ((16, 16, 16, 1), (32, 32, 32, 1), (16, 32, 64, 1))


@dataclass(frozen=True)
class TiledConfig(FieldConfig):
    FIELDS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_K": "block_k", "GROUP_M": "group_m",
              "num_warps": "num_warps", "num_stages": "num_stages"}  # persisted name -> attribute

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        checks = (("BLOCK_M", self.block_m, BLOCK_SIZES), ("BLOCK_N", self.block_n, BLOCK_SIZES),
                  ("BLOCK_K", self.block_k, BLOCK_SIZES), ("GROUP_M", self.group_m, GROUP_SIZES),
                  ("num_warps", self.num_warps, WARPS), ("num_stages", self.num_stages, STAGES))
        check_bounds("triton_tiled", checks)

    def smem_bytes(self, element_size: int) -> int:
        """Shared memory the software pipeline holds: one A and one B tile per stage."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * element_size

    def acc_regs_per_thread(self) -> int:
        return self.block_m * self.block_n // (32 * self.num_warps)




def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def deep_tile(block_m: int, block_n: int) -> bool:
    """Whether a tile also gets STREAMING_STAGES: the thin ones and the small ones."""
    return block_m == 16 or block_m * block_n <= SMALL_TILE


def _tiles(problem: Problem, config: TiledConfig) -> int:
    """Output tiles over the whole batch: the programs a launch runs."""
    return -(-problem.m // config.block_m) * -(-problem.n // config.block_n) * problem.batch


def space(problem: Problem, device: Device) -> list[TiledConfig]:
    """Every config this device can run on this problem, before measuring anything.

    Dropped before compiling: configs whose pipeline needs more shared memory than a block may
    have (inductor compiles those and fails), accumulators that would spill registers, tiles
    larger than the problem, and tiles so large that the grid leaves most SMs idle while a
    smaller tile would fill them. A product on the CUDA cores (``takes_ffma``) gets
    FFMA_CONFIGS where any of them is left, the tensor cores' tiles otherwise. Never empty: the
    smallest tiles always fit.
    """
    configs = _fitting(problem, device, FFMA_CONFIGS) if takes_ffma(problem, device) else []
    if not configs:
        configs = _fitting(problem, device, _tensor_core_configs(device.interpreter))
    if not configs:  # a tiny device: fall back to the smallest tile with the shallowest pipeline
        configs = [TiledConfig(16, 16, 16, 8, 2, 2)]
    occupancy = {c: min(1.0, _tiles(problem, c) / device.sm_count) for c in configs}
    best = max(occupancy.values())
    return [c for c in configs if occupancy[c] >= best / 4]


def takes_ffma(problem: Problem, device: Device) -> bool:
    """Whether ``problem``'s space is FFMA_CONFIGS, measured whole: a float32 product without TF32
    (FMAs on the CUDA cores) on a GPU, of more than FFMA_MIN rows and columns (those the configs
    were chosen on)."""
    return problem.dtype == "float32" and not problem.tf32 and not device.interpreter \
        and min(problem.m, problem.n) > FFMA_MIN


def _tensor_core_configs(interpreter: bool) -> list[tuple[int, int, int, int, int]]:
    """TILES with their stages (INTERPRETER_TILES under Triton's interpreter), as (BLOCK_M,
    BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    if interpreter:
        return [(*tile, 1) for tile in INTERPRETER_TILES]
    return [(bm, bn, bk, warps, s) for bm, bn, bk, warps in TILES
            for s in STAGE_CHOICES + (STREAMING_STAGES if deep_tile(bm, bn) else ())]


def _fitting(problem: Problem, device: Device, configs) -> list[TiledConfig]:
    """Those of ``configs`` (as FFMA_CONFIGS) that fit the problem, the shared memory and the registers."""
    fit_m, fit_n, fit_k = (max(16, next_pow2(v)) for v in (problem.m, problem.n, problem.k))
    fitting = []
    for bm, bn, bk, warps, stages in configs:
        config = TiledConfig(bm, bn, bk, 8, warps, stages)
        if bm <= fit_m and bn <= fit_n and bk <= fit_k \
                and config.smem_bytes(problem.element_size) <= device.smem_per_block \
                and config.acc_regs_per_thread() <= MAX_ACC_REGS:
            fitting.append(config)
    return fitting


def _constexprs(problem: Problem, config: TiledConfig) -> dict:
    """The kernel's constexprs for ``problem`` and ``config``, but for whether a bias is added."""
    return dict(
        K=problem.k, ACTIVATION=problem.activation, PRECISION="tf32" if problem.tf32 else "ieee",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _check_k(k: int, built: int) -> None:
    """The kernel's K loop is compiled for ``built`` rows of B: a call with another K is refused,
    never run with the wrong trip count."""
    if k != built:
        raise ValueError(f"triton_tiled: this kernel was built for K={built}, called with K={k}")


class TiledKernel(KernelBase):
    """A compiled-on-first-call launcher for one (problem, config); later calls with operands
    of the same dtypes, strides and alignment launch the binary directly (gemmtune.backends.launch).
    Its binary is compiled for the problem's K; M, N and the strides may vary."""

    serves_any_rank = True  # x (..., K) in layout linear: launch.gemm_call takes its rows in place

    def __init__(self, problem: Problem, config: TiledConfig) -> None:
        from gemmtune.backends.kernels.tiled import tiled_matmul  # imports triton: only once a kernel is built

        self._launch = Launcher(tiled_matmul, gemm_hints)
        self._linear = problem.layout == "linear"
        self._config = config
        self._k = problem.k
        base = _constexprs(problem, config)
        self._constexprs = {False: dict(base, HAS_BIAS=False), True: dict(base, HAS_BIAS=True)}

    def __call__(self, a, b, bias, out=None):
        m, n, k, out, guard, tensors, pointers, strides = gemm_call(a, b, bias, out, self._linear)
        grid, scalars, _ = self.launch_args(a, m, n, k, strides)
        self._launch(grid, guard, tensors, pointers, scalars, self._constexprs[bias is not None])
        return out

    def launch_args(self, a, m: int, n: int, k: int, strides: tuple) -> tuple:
        """For ``launch.bind_gemm``: the grid, the scalars and the kernel's own buffers' addresses
        (none)."""
        _check_k(k, self._k)
        return (-(-m // self._config.block_m) * -(-n // self._config.block_n), 1, 1), (m, n, *strides, 0, 0, 0), ()

    def bind(self, a, b, bias) -> BoundCall | None:
        return bind_gemm(self, self._launch, a, b, bias, self._linear)


class BatchedTiledKernel(KernelBase):
    """The tiled kernel over a batch of products (``torch.bmm``): a (B, M, K), b (B, K, N), or
    (B, N, K) in layout linear, each of any strides; writes ``out`` (B, M, N) when given, else a
    new contiguous tensor. Launched by guard, as ``TiledKernel``, one product per grid row."""

    def __init__(self, problem: Problem, config: TiledConfig) -> None:
        from gemmtune.backends.kernels.tiled import tiled_matmul  # imports triton: only once a kernel is built

        self._launch = Launcher(tiled_matmul, gemm_hints)
        self._linear = problem.layout == "linear"
        self._config = config
        self._k = problem.k
        self._constexprs = dict(_constexprs(problem, config), HAS_BIAS=False)

    def __call__(self, a, b, bias, out=None):
        if bias is not None:
            raise ValueError("a batched product takes no bias")
        batch, m, k = a.shape
        _check_k(k, self._k)
        n = b.shape[1] if self._linear else b.shape[2]
        if out is None:
            out = a.new_empty((batch, m, n))
        (saq, sam, sak), (sbq, sb1, sb2), (scq, scm, scn) = a.stride(), b.stride(), out.stride()
        sbk, sbn = (sb2, sb1) if self._linear else (sb1, sb2)
        if not within_int32((m, sam, k, sak), (k, sbk, n, sbn), (m, scm, n, scn)):
            raise ValueError(f"triton_tiled: a batched operand's matrix spans 2^31 elements or more (strides "
                             f"{a.stride()}, {b.stride()}, {out.stride()}): the kernel indexes one in int32")
        pa, pb, po = a.data_ptr(), b.data_ptr(), out.data_ptr()
        guard = (a.get_device(), b.get_device(), out.get_device(), a.dtype, b.dtype, out.dtype, a.shape, b.shape,
                 a.stride(), b.stride(), out.stride(), pa & 15, pb & 15, po & 15)
        grid = (-(-m // self._config.block_m) * -(-n // self._config.block_n), batch, 1)
        scalars = (m, n, sam, sak, sbk, sbn, scm, scn, saq, sbq, scq)
        self._launch(grid, guard, (a, b, out, out), (pa, pb, po, po), scalars, self._constexprs)
        return out


def within_int32(*matrices: tuple[int, int, int, int]) -> bool:
    """Whether each matrix given as (rows, row stride, columns, column stride) is indexed within
    int32 from its first element, as the kernel indexes one product's operands."""
    return all((rows - 1) * abs(rs) + (cols - 1) * abs(cs) <= MAX_ELEMENTS for rows, rs, cols, cs in matrices)


class TritonTiledBackend:
    name = "triton_tiled"
    space_size = len(_tensor_core_configs(interpreter=False))

    def is_available(self, device: Device) -> bool:
        return triton_runs(device) and (device.interpreter or device.capability >= (7, 0))

    def supports(self, problem: Problem) -> bool:
        return max(problem.m * problem.k, problem.k * problem.n, problem.m * problem.n) <= MAX_ELEMENTS \
            and problem.batch <= MAX_BATCH

    def candidates(self, problem: Problem, device: Device) -> list[TiledConfig]:
        return space(problem, device) if self.supports(problem) else []

    def predict_ms(self, problem: Problem, device: Device, config) -> float | None:
        """The roofline's time, a tile alone on its SM behind one that shares it; None on the CUDA
        cores (``takes_ffma``), where every config is measured."""
        if takes_ffma(problem, device):
            return None
        alone = costmodel.blocks_per_sm(device, config.smem_bytes(problem.element_size)) < 2
        return costmodel.tile_gemm_ms(problem, device, config.block_m, config.block_n, config.block_k,
                                      config.num_stages, alone=alone)

    def parse_config(self, data: Mapping) -> TiledConfig:
        return config_from_mapping(self.name, data, TiledConfig)

    def build(self, problem: Problem, config: TiledConfig, device: Device) -> TiledKernel | BatchedTiledKernel:
        return BatchedTiledKernel(problem, config) if problem.batch > 1 else TiledKernel(problem, config)


BACKEND = TritonTiledBackend()
