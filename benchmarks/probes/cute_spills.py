"""Probe: which CuTe DSL configs spill registers to local memory, read from their compiled code.

QuACK's sm_90 GEMM accumulates an fp8 product precisely by adding each K tile's wgmma sums into
a second float32 accumulator: each thread of the MMA warps holds both. This compiles configs of
the ``cute`` backend for sm_90a (no GPU needed: CuTe DSL compiles for the named target, as
QuACK's GPU-blind compile workers do) with the fp8 row-scaled epilogue, keeps each cubin, and
reads from its ``.nv.info`` section the registers per thread and the stack frame a thread keeps
in local memory (a frame above 0: registers spilled). A 16-bit config of each tile is compiled
beside it for comparison.

    CUDA_VISIBLE_DEVICES= PYTHONPATH=src:<cute site> python3 benchmarks/probes/cute_spills.py --out spills.json

QuACK asks CUDA's driver for the device's capability and its cluster occupancy while it plans a
kernel; with no GPU, this answers for an sm_90 of 132 SMs. Written as JSON, one line per config
printed as it is compiled.
"""
import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

EIATTR = {0x2F: "registers", 0x11: "frame_bytes"}  # the .nv.info attributes read (format 0x04)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gemmtune-cute-spills-"))
    dump = work / "cubins"  # CuTe DSL reads where to keep them once, when it is imported
    dump.mkdir()
    os.environ.update(QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", QUACK_CACHE_DIR=str(work / "cache"),
                      CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(dump))
    answer_as_sm90()
    from gemmtune.backends import cute

    rows = []
    tiles = [(c, True) for c in cute.space_of(9, scaled=True)]
    tiles += [(c, True) for c in cute.space_of(9) if not c.swap_ab and c.cluster_m == 2]  # 16-bit tiles in fp8
    tiles += [(c, False) for c in cute.space_of(9) if not c.swap_ab and c.cluster_m == 2]
    for config, scaled in tiles:
        started = time.perf_counter()
        row = {"config": config.key(), "fp8": scaled, **compile_one(cute, config, scaled, dump)}
        row["compile_s"] = round(time.perf_counter() - started, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"target": "sm_90a", "quack": version("quack-kernels"),
                                    "cutlass_dsl": version("nvidia-cutlass-dsl"), "rows": rows}, indent=1))
    shutil.rmtree(work)
    return 0


def answer_as_sm90() -> None:
    """QuACK's two device queries answered for an sm_90 of 132 SMs, and its check that a scale
    given by pointer lies on a GPU skipped: the operands here are meta tensors."""
    import quack.epilogue.frontend as frontend
    import quack.epilogue.ops as ops
    import quack.gemm_runtime.host as host

    frontend.get_device_capacity = lambda device: (9, 0)
    host.get_max_active_clusters = lambda cluster_size: 132 // cluster_size
    ops.Scalar._validate_pointer_value = lambda self, value: None


def compile_one(cute, config, scaled: bool, dump: Path) -> dict:
    """Plan (and so compile) ``config`` on meta operands of 2048 x 4096 x 4096 with the row-scaled
    fp8 epilogue, or as a 16-bit product; what the cubin it leaves in ``dump`` says (named after
    the epilogue and the operands, not the config: read, then moved aside)."""
    import torch

    dtype = torch.float8_e4m3fn if scaled else torch.bfloat16
    m, n, k = 2048, 4096, 4096
    a, w = (torch.empty(rows, k, dtype=dtype, device="meta") for rows in (m, n))
    out = torch.empty(m, n, dtype=torch.bfloat16, device="meta")
    scales = {"scale_a": torch.empty(m, device="meta"), "scale_b": torch.empty(n, device="meta")}
    kernel_config = cute._quack().GemmConfig(
        tile_m=config.tile_m, tile_n=config.tile_n, pingpong=config.pingpong, is_dynamic_persistent=False,
        cluster_m=config.cluster_m, cluster_n=config.cluster_n, swap_ab=False, device_capacity=9)
    try:
        cute._quack().scaled_mods["row", False].plan(a, w.t(), out={"D": out}, config=kernel_config, **scales)
    except Exception as exc:  # noqa: BLE001 - a config that does not compile is a finding
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    cubins = list(dump.glob("*.cubin"))
    if len(cubins) != 1:
        return {"error": f"{len(cubins)} cubins kept"}
    found = attributes(cubins[0])
    cubins[0].rename(dump / f"{config.key()}.fp8-{scaled}.kept")
    return found


def attributes(cubin: Path) -> dict:
    """The registers per thread and the frame size from a cubin's ``.nv.info`` section: entries
    of a format byte and an attribute byte, then for format 0x04 a 2-byte size and that many
    bytes (here the function's index and the value, 4 bytes each), else a 2-byte value."""
    info = sections(cubin.read_bytes())[".nv.info"]
    found, offset = {}, 0
    while offset + 4 <= len(info):
        fmt, attr = info[offset], info[offset + 1]
        size = struct.unpack_from("<H", info, offset + 2)[0] if fmt == 0x04 else 0
        if fmt == 0x04 and attr in EIATTR and size == 8:
            found[EIATTR[attr]] = struct.unpack_from("<I", info, offset + 8)[0]
        offset += 4 + size
    return found


def sections(elf: bytes) -> dict:
    """An ELF64 file's sections by name."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entry_size) for i in range(count)]
    names = headers[names_index][4]

    def name(offset: int) -> str:
        return elf[names + offset:elf.index(b"\0", names + offset)].decode()

    return {name(h[0]): elf[h[4]:h[4] + h[5]] for h in headers}


def version(package: str) -> str:
    from importlib.metadata import version as installed

    return installed(package)


if __name__ == "__main__":
    sys.exit(main())
