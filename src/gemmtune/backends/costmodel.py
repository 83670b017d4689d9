"""A cost model that ranks configs before anything is compiled.

It only has to order the candidates of one problem on one device well enough that the measured
best sits among the first few (``search`` then measures just those). So it is a roofline with
the effects that separate configs: wave quantization (a partly filled last wave costs a whole
one), the arithmetic intensity of a tile (small tiles reread operands from L2 and run matrix
units below rate), the bytes a split-K grid streams and how many SMs it keeps loading, and the
lost vector loads of rows that are not 16-byte aligned. Absolute times are rough by design.
"""

from __future__ import annotations

from gemmtune.device import Device
from gemmtune.problem import SCALED_DTYPES, Problem

# Dense 16-bit matrix flops per SM per clock, by compute capability major (Hopper's wgmma,
# Ampere's mma.sync, older tensor cores); CUDA-core fp32 is 256 (128 FMA).
MATRIX_FLOPS_PER_SM_CLOCK = {9: 4096, 8: 2048, 7: 1024}
FP32_FLOPS_PER_SM_CLOCK = 256
FP8_OVER_16_BIT = 2  # fp8 tensor cores (Ada, Hopper: capability 8.9 on) run twice the 16-bit rate
CLOCK_HZ = 1.7e9
# DRAM bytes/s by compute capability major: a rough default; only the compute/memory balance
# of one problem depends on it, not the order of tile shapes.
DRAM_BYTES_PER_S = {9: 3.5e12, 8: 1.8e12}
L2_OVER_DRAM = 2.5
LAUNCH_MS = 0.003
REFERENCE_INTENSITY = 128 * 256 / (128 + 256)  # a 128x256 tile's flops per byte loaded, relative
MISALIGNED_PENALTY = 2.0  # measured: tiled on 4095x4097x4095 ran 2.1x below cuBLAS (docs/performance.md, misaligned shapes)
# A grid streams no faster than the bytes its pipelines keep in flight over the memory latency:
# fitted to the tiled trials of qkv decode on the H200, where 4.7 and 6.3 MB in flight read the
# weights at 1.6 and 1.9 TB/s (docs/performance.md, the cost model). Large grids keep far more in flight than needed.
LATENCY_S = 3.3e-6
# The last program of a split-K tile sums every split's partial after the weights are read: a
# dependent tail per split (fitted with LATENCY_S on the H200's decode trials, docs/performance.md, the cost model).
SPLIT_TAIL_S = 2e-6
MAX_WARPS_PER_SM = 64  # sm_70 to sm_90
REGISTERS_PER_SM = 65536
# An SM holds 1 KB of shared memory more than a block may opt in to (Ampere, Ada, Hopper), and
# the driver reserves 1 KB of it per resident block.
SMEM_RESERVED_PER_BLOCK = 1024
# A tile alone on its SM (its pipeline's shared memory leaves no room for a second block) leaves
# its prologue and epilogue exposed where a grid of more tiles than SMs would put a second block
# there to overlap them.
# Measured on an H200 (triton_tiled, K a constant, tiled-space-h200-20261128.json): the same
# tile with a fourth stage that left room for one block, against three stages leaving room for
# two, ran 1.005-1.39x the time (median 1.14) on five compute-bound products.
ALONE_PENALTY = 1.12


def matrix_flops(problem: Problem, device: Device) -> float:
    return peak_flops(problem.dtype, problem.tf32, device)


def peak_flops(dtype: str, tf32: bool, device: Device) -> float:
    """The device's dense matrix flops per second in ``dtype`` (gemmtune's name for it)."""
    per_clock = MATRIX_FLOPS_PER_SM_CLOCK.get(device.capability[0], 512)
    if dtype == "float32":
        per_clock = per_clock // 2 if tf32 else FP32_FLOPS_PER_SM_CLOCK
    elif dtype in SCALED_DTYPES and device.capability >= (8, 9):
        per_clock *= FP8_OVER_16_BIT
    return per_clock * device.sm_count * CLOCK_HZ


def dram_bytes_per_s(device: Device) -> float:
    return DRAM_BYTES_PER_S.get(device.capability[0], 0.8e12)


def blocks_per_sm(device: Device, smem_bytes: int) -> int:
    """How many blocks of ``smem_bytes`` of shared memory an SM holds at once."""
    return (device.smem_per_block + SMEM_RESERVED_PER_BLOCK) // (smem_bytes + SMEM_RESERVED_PER_BLOCK)


def tile_gemm_ms(problem: Problem, device: Device, block_m: int, block_n: int, block_k: int,
                 num_stages: int, *, alone: bool = False) -> float:
    """A tiled or persistent GEMM's predicted time in ms: each SM works through its share of
    the output tiles of every product of the batch (a last, partly filled wave costs a whole one).
    ``alone``: one block a time on an SM (ALONE_PENALTY where the grid has more tiles than SMs)."""
    tiles_m, tiles_n = -(-problem.m // block_m), -(-problem.n // block_n)
    tiles = tiles_m * tiles_n * problem.batch
    waves = -(-tiles // device.sm_count)
    intensity = block_m * block_n / (block_m + block_n)
    efficiency = min(1.0, intensity / REFERENCE_INTENSITY) ** 0.5
    if num_stages < 3:
        efficiency *= 0.7  # too shallow a pipeline to hide load latency
    k_padded = -(-problem.k // block_k) * block_k
    per_sm_flops = matrix_flops(problem, device) / device.sm_count
    compute_s = waves * 2 * block_m * block_n * k_padded / (per_sm_flops * efficiency)
    es = problem.element_size
    reread = (problem.m * problem.k * tiles_n + problem.n * problem.k * tiles_m) * es * problem.batch
    in_flight = min(tiles, device.sm_count) * num_stages * (block_m + block_n) * block_k * es
    streaming = min(dram_bytes_per_s(device), in_flight / LATENCY_S)
    memory_s = reread / (dram_bytes_per_s(device) * L2_OVER_DRAM) + problem.min_bytes / streaming
    total = max(compute_s, memory_s) * 1e3
    if alone and tiles > device.sm_count:  # a second block would have been there to overlap
        total *= ALONE_PENALTY
    if not problem.rows_aligned:
        total *= MISALIGNED_PENALTY
    return total + LAUNCH_MS


def splitk_ms(problem: Problem, device: Device, block_m: int, block_n: int, split_k: int, block_k: int,
              num_stages: int, *, use_dot: bool = True, num_warps: int = 4) -> float:
    """A split-K decode GEMM: the weights streamed once, at a rate set by how many SMs load and
    by the bytes kept in flight, plus the serial reduction tail of each extra split.

    In flight per SM: a pipelined or tensor-core program keeps (stages - 1) tiles in flight and
    one is resident (fitted on the H200's decode trials, docs/performance.md, the cost model); a register-direct FMA
    program (stage 1) keeps its whole tile in flight, and as many of them are resident as the
    SM's warps and registers allow, which is how the GEMV tiles stream fastest.
    """
    es = problem.element_size
    programs = -(-problem.n // block_n) * split_k * -(-problem.m // block_m)
    threads = 32 * num_warps
    if use_dot or num_stages > 1:
        resident, tile = 1, max(1, num_stages - 1) * (block_m + block_n) * block_k * es
    else:
        regs = block_m * block_n * block_k // threads + es * block_n * block_k // (4 * threads) + 32
        resident = max(1, min(MAX_WARPS_PER_SM // num_warps, REGISTERS_PER_SM // (threads * regs)))
        tile = (block_m + block_n) * block_k * es
    fill = min(1.0, programs / device.sm_count)
    in_flight = min(programs, resident * device.sm_count) * tile
    streaming = min(dram_bytes_per_s(device) * fill, in_flight / LATENCY_S)
    return _weight_stream_ms(problem, device, split_k, streaming, -(-problem.n // block_n))


def gemv_ms(problem: Problem, device: Device, block_n: int, split_k: int) -> float:
    """A GEMV grid (one row of A a program, BLOCK_N weight rows, no tensor cores): the weights
    streamed at the DRAM rate of the SMs its programs fill, with no cap on the bytes in flight,
    and A's row read from L2 once per SM (later programs there find it in L1).

    ``splitk_ms``'s cap, fitted on pipelined and tensor-core tiles, is pessimistic for GEMV
    programs: bf16 GEMV tiles it predicts at 37-40 us on qkv.m1 ran 19-20 (docs/performance.md,
    decode), while it predicts fp8 tiled decode (qkv.m1 at 20 us on the H100, 1.3 TB/s) at
    14 us. So where both forms serve a problem (triton_scaled at M = 1) the GEMV, ranked by
    bandwidth alone, comes first; its tiles that fill the SMs tie, and keep their table's order.
    """
    programs = -(-problem.n // block_n) * split_k * problem.m
    streaming = dram_bytes_per_s(device) * min(1.0, programs / device.sm_count)
    return _weight_stream_ms(problem, device, split_k, streaming, min(programs, device.sm_count))


def _weight_stream_ms(problem: Problem, device: Device, split_k: int, streaming: float, a_reads: int) -> float:
    """A decode GEMM's time in ms with the weights (and split-K partials) read at ``streaming``
    bytes/s, A read ``a_reads`` times from L2, and the serial reduction tail of each extra split."""
    es = problem.element_size
    weights = problem.n * problem.k * es
    workspace = 8 * split_k * problem.m * problem.n if split_k > 1 else 0
    activations = problem.m * problem.k * es * a_reads
    memory_s = (weights + workspace) / streaming + activations / (dram_bytes_per_s(device) * L2_OVER_DRAM)
    tail_s = SPLIT_TAIL_S * split_k if split_k > 1 else 0.0
    return (memory_s + tail_s) * 1e3 + LAUNCH_MS
