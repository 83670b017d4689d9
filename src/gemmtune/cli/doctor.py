"""``gemmtune doctor``: what this machine gives the tuner, and what to change when it gives less.

Each line of the report is a :class:`Check`. :func:`collect` never raises: a doctor that crashes
on the broken setup it was asked to diagnose is no use, so a check that fails to gather becomes
an "info" line saying why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmtune import settings
from gemmtune.device import INDUCTOR_MIN_SMS, Device, driver_version
from gemmtune.errors import CublasLtError

if TYPE_CHECKING:
    from rich.console import Console

STATUSES = ("ok", "warn", "info")
# SQLite in WAL mode keeps recent writes beside the database; they are part of its size.
STORE_SIDECARS = ("", "-wal", "-shm")

# Measured on an H200, torch 2.11 (the project's baselines): fp32 4096^3 under "highest" vs "high" (TF32).
FP32_HIGHEST_MS = 2.746
FP32_HIGH_MS = 0.368
TF32_SPEEDUP = FP32_HIGHEST_MS / FP32_HIGH_MS  # 7.46, quoted as 7.5x

# NVML's clock event ("throttle") reason bits; fixed by the NVML API, so spelled out here rather
# than read from pynvml, whose constant names changed from *Throttle* to *Event* across versions.
CLOCK_EVENT_REASONS = (
    (0x1, "idle"),
    (0x2, "applications clocks"),
    (0x4, "sw power cap"),
    (0x8, "hw slowdown"),
    (0x10, "sync boost"),
    (0x20, "sw thermal"),
    (0x40, "hw thermal"),
    (0x80, "hw power brake"),
    (0x100, "display clocks"),
)
# Reasons that say nothing about how repeatable a timing taken now will be.
BENIGN_REASONS = frozenset({"idle", "applications clocks", "sync boost", "display clocks"})


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    name: str
    value: str
    status: str  # "ok" | "warn" | "info"
    advice: str = ""  # what to do about it; may span several lines

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Check.status={self.status!r}; accepted: {', '.join(STATUSES)}")


def collect(store_path: str | Path | None = None, device: Device | None = None) -> list[Check]:
    """Gather every check for ``device`` (default: the current GPU, or the CPU interpreter).

    Clocks and throttle reasons are read live from NVML only for the device this process runs
    on; a Device passed in that is not that one (a fake, in tests) gets "not queried" lines.
    """
    live = device is None
    if device is None:
        device = _guard("GPU", _current_device)
        if isinstance(device, Check):  # torch or CUDA failed before we learned anything
            return [device, *_software_checks(), _guard("store", lambda: store_check(store_path)),
                    _guard("compile cache", compile_cache_check)]
    else:
        live = _is_current(device)

    checks = [gpu_check(device)]
    if not device.interpreter:
        checks += [sm_check(device), smem_check(device), l2_check(device),
                   _guard("CuTe DSL", lambda: cute_check(device))]
        checks += _guard_many(("clocks", "throttle"), lambda: nvml_checks(live))
        if live:
            checks.append(_guard("cuBLAS products", cublas_check))
            checks.append(_guard("cuBLASLt", cublaslt_check))
    checks += _software_checks()
    checks.append(_guard("inductor max_autotune_gemm gate", lambda: gate_check(device)))
    checks.append(_guard("store", lambda: store_check(store_path)))
    checks.append(_guard("compile cache", compile_cache_check))
    return checks


def as_dict(checks: list[Check]) -> list[dict[str, str]]:
    """The checks as plain dicts, for ``gemmtune doctor --json``."""
    return [dataclasses.asdict(check) for check in checks]


def render(checks: list[Check], console: Console) -> None:
    """A table of the checks, then the advice of each check that has some."""
    from rich.table import Table
    from rich.text import Text

    colors = {"ok": "green", "warn": "bold yellow", "info": "cyan"}
    table = Table(title="gemmtune doctor", title_justify="left")
    table.add_column("check", style="bold", no_wrap=True)
    table.add_column("value")
    table.add_column("status", no_wrap=True)
    for check in checks:
        # Text(), not markup strings: values hold user paths and brackets rich would eat.
        table.add_row(Text(check.name), Text(check.value), Text(check.status, style=colors[check.status]))
    console.print(table)
    for check in checks:
        if check.advice:
            console.print()
            console.print(Text(f"{check.name}:", style=colors[check.status]))
            console.print(Text(check.advice))


# --- the device ------------------------------------------------------------------------------


def gpu_check(device: Device) -> Check:
    if device.interpreter:
        return Check(
            "GPU", "none: no CUDA GPU is visible", "warn",
            "gemmtune will run its Triton kernels through Triton's interpreter on the CPU "
            "(TRITON_INTERPRET=1).\n"
            "That is enough to test correctness, but timings taken there are not GPU timings: "
            "do not tune for a GPU on this machine.",
        )
    major, minor = device.capability
    return Check("GPU", f"{device.name} (sm_{major}{minor})", "ok")


def sm_check(device: Device) -> Check:
    return Check("SMs", str(device.sm_count), "ok")


def smem_check(device: Device) -> Check:
    return Check("shared memory / block", f"{_size(device.smem_per_block)} (opt-in maximum)", "info")


def l2_check(device: Device) -> Check:
    return Check("L2", _size(device.l2_bytes), "info")


def gate_check(device: Device) -> Check:
    name = "inductor max_autotune_gemm gate"
    if device.interpreter:
        return Check(name, "not applicable: no CUDA GPU", "info")
    if device.sm_count >= INDUCTOR_MIN_SMS:
        return Check(
            name, f"passes: {device.sm_count} SMs >= {INDUCTOR_MIN_SMS}; inductor's max-autotune "
            "keeps its Triton GEMM templates and epilogue fusion on this GPU", "ok",
        )
    return Check(name, f"fails: {device.sm_count} SMs < {INDUCTOR_MIN_SMS}", "warn", _gate_advice(device.sm_count))


def _gate_advice(sms: int) -> str:
    # The seeds show users reading this warning as a shape or padding problem and switching
    # compile modes to escape it; each line answers one of those misreadings.
    return "\n".join((
        f'torch.compile(mode="max-autotune") logs "Not enough SMs to use max_autotune_gemm mode" here '
        f"because this GPU has {sms} SMs and inductor wants at least {INDUCTOR_MIN_SMS}.",
        "- The cause is the GPU's size (its SM count), not your input shapes, batch size or padding: "
        "no change to the model removes the warning.",
        "- Below the gate inductor drops every Triton GEMM template and all GEMM epilogue fusion; "
        "what remains is cuBLAS, plus padding of misaligned shapes.",
        '- Another compile mode does not help: "max-autotune-no-cudagraphs" and the others check '
        "the same gate.",
        '- What does help: torch.set_float32_matmul_precision("high") for float32 models (TF32), '
        "and padding M, N and K to multiples of 8 or 16 so cuBLAS stays on its fast tensor-core path.",
        "- gemmtune does not use this gate: it scales its search space to the SM count, so its "
        "Triton kernels stay available on this GPU.",
        "- gemmtune.compile(model) compiles with gemmtune choosing each GEMM: a Triton config it "
        "chose runs as the compiler's template, its epilogue fused, under the gate too.",
    ))


# bf16 products cuBLAS got wrong on an H200 split to 38 SMs by CUDA MPS, beside two it got right
# (cublas-poison-h200-sm38-20261123.json): (m, n, k, layout).
CUBLAS_PROBES = ((1000, 1000, 1000, "nn"), (16, 4104, 4096, "linear"), (1, 4104, 4096, "linear"),
                 (1, 4096, 4096, "linear"), (256, 1024, 1024, "nn"))


def cublas_check(product: Callable | None = None, device: str = "cuda") -> Check:
    """cuBLAS's bf16 products on a few shapes against a float64 reference, on this GPU as this
    process sees it. ``product(problem, a, b)`` is torch's own by default (tests pass another,
    and the CPU for ``device``)."""
    import torch

    from gemmtune.problem import Problem
    from gemmtune.tuning import verify

    if product is None:
        product = lambda p, a, b: torch.mm(a, b.t() if p.layout == "linear" else b)  # noqa: E731
    wrong = []
    for m, n, k, layout in CUBLAS_PROBES:
        problem = Problem(m, n, k, "bfloat16", layout)
        inputs = verify.make_inputs(problem, device, seed=0)
        verdict = verify.judge(product(problem, inputs.a, inputs.b), problem, inputs)
        if not verdict.ok:
            wrong.append(f"{m}x{n}x{k} {layout} (relative error {verdict.rel_err:.1e})")
    if not wrong:
        return Check("cuBLAS products", f"right on {len(CUBLAS_PROBES)} bf16 shapes", "ok")
    return Check(
        "cuBLAS products", f"WRONG on {len(wrong)} of {len(CUBLAS_PROBES)} bf16 shapes", "warn",
        "cuBLAS, as torch.mm, F.linear and torch.compile call it, returned wrong products here:\n"
        + "\n".join(f"- {shape}" for shape in wrong)
        + "\nSeen on an H200 split to 38 SMs by CUDA MPS (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30). gemmtune "
        "checks every candidate, cuBLAS too, against a float64 reference before timing it, and does not "
        "choose one that is wrong; torch's own calls are not checked. On the whole GPU (132 SMs) the "
        "same products were right.",
    )


def cublaslt_check(library: Callable | None = None) -> Check:
    """Whether gemmtune can call cuBLASLt itself (the ``cublaslt`` backend: cuBLAS's algorithms
    beyond the one torch's call runs). ``library`` loads it (tests pass another)."""
    from gemmtune.backends import cublaslt_binding

    try:
        lib = (library or cublaslt_binding.library)()
    except (CublasLtError, OSError, AttributeError) as error:
        return Check("cuBLASLt", f"not callable ({error})", "info",
                     "The cublaslt backend is left out: cuBLAS through torch's own calls remains, "
                     "as do gemmtune's Triton kernels.")
    return Check("cuBLASLt", f"version {lib.cublasLtGetVersion()} ({lib._name})", "ok")


def cute_check(device: Device) -> Check:
    """Whether the ``cute`` backend (CuTe DSL GEMMs, the optional extra) is offered on ``device``."""
    from importlib.metadata import PackageNotFoundError, version

    from gemmtune.backends import cute

    arch = f"sm_{device.capability[0]}{device.capability[1]}"
    if device.capability[0] not in cute.RUNNABLE_ARCHS:
        return Check("CuTe DSL", f"not offered on {arch}", "info",
                     "gemmtune's CuTe DSL GEMMs run on Hopper (sm_90); here its other backends remain.")
    if not cute.installed():
        return Check("CuTe DSL", "not installed", "info",
                     "`pip install gemmtune[cute]` adds CuTe DSL GEMMs (QuACK's kernels on nvidia-cutlass-dsl) "
                     "to the candidates on this GPU.")
    try:
        found = ", ".join(f"{name} {version(name)}" for name in ("quack-kernels", "nvidia-cutlass-dsl"))
    except PackageNotFoundError:  # importable from a path, without the packages' metadata
        found = "importable"
    return Check("CuTe DSL", found, "ok")


# --- clocks and throttle reasons, live from NVML ---------------------------------------------


def nvml_checks(live: bool) -> list[Check]:
    """Current/max SM and memory clocks, and why the clocks are held down, if they are."""
    if not live:
        reason = "not queried: the device was given, not read from this machine"
        return [Check("clocks", reason, "info"), Check("throttle", reason, "info")]
    try:
        import pynvml
    except ImportError:
        return _nvml_unavailable("nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return _nvml_unavailable(f"NVML: {error}")
    try:
        handle = _nvml_handle(pynvml)
        return [_clocks(pynvml, handle), _throttle(pynvml, handle)]
    except pynvml.NVMLError as error:
        return _nvml_unavailable(f"NVML: {error}")
    finally:
        pynvml.nvmlShutdown()


def decode_reasons(mask: int) -> list[str]:
    """Names of the set bits of an NVML clock event reason mask."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    known = 0
    for bit, _ in CLOCK_EVENT_REASONS:
        known |= bit
    if mask & ~known:
        names.append(f"other (0x{mask & ~known:x})")
    return names


def _nvml_handle(pynvml: Any) -> Any:
    # NVML numbers GPUs its own way (all of them, PCI order); CUDA numbers the visible ones.
    # The UUID names the same GPU on both sides.
    import torch

    index = torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if uuid:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _clocks(pynvml: Any, handle: Any) -> Check:
    sm = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
    sm_max = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
    mem = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)
    mem_max = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
    # An idle GPU parks its clocks low; that is expected, so this line only informs.
    return Check("clocks", f"SM {sm}/{sm_max} MHz, memory {mem}/{mem_max} MHz (now/max)", "info")


def _throttle(pynvml: Any, handle: Any) -> Check:
    query = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
        or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    reasons = decode_reasons(int(query(handle)))
    if not reasons:
        return Check("throttle", "none", "ok")
    slowing = [reason for reason in reasons if reason not in BENIGN_REASONS]
    if not slowing:
        return Check("throttle", ", ".join(reasons), "ok")
    return Check(
        "throttle", ", ".join(reasons), "warn",
        f"The GPU is holding its clocks down ({', '.join(slowing)}): timings taken now may not repeat. "
        "Tune when the GPU is otherwise idle and cool, and compare kernels only side by side in one run.",
    )


def _nvml_unavailable(reason: str) -> list[Check]:
    return [Check("clocks", f"unavailable ({reason})", "info"),
            Check("throttle", f"unavailable ({reason})", "info")]


# --- software ----------------------------------------------------------------------------------


def _software_checks() -> list[Check]:
    return [
        _guard("driver", driver_check),
        _guard("CUDA", cuda_check),
        _guard("torch", torch_check),
        _guard("triton", triton_check),
        _guard("float32 matmul", precision_check),
    ]


def driver_check() -> Check:
    version = driver_version()
    if version is None:
        return Check("driver", "unavailable (no NVML: no NVIDIA driver, or nvidia-ml-py missing)", "info")
    return Check("driver", version, "ok")


def cuda_check() -> Check:
    import torch

    if torch.version.cuda is None:
        return Check("CUDA", "none: this torch is a CPU build", "info")
    if not torch.cuda.is_available():
        return Check(
            "CUDA", f"{torch.version.cuda} (torch's build), but no GPU is usable", "warn",
            "torch was built for CUDA but sees no GPU: check nvidia-smi, the driver version "
            "and CUDA_VISIBLE_DEVICES.",
        )
    return Check("CUDA", f"{torch.version.cuda} (torch's build)", "ok")


def torch_check() -> Check:
    import torch

    return Check("torch", torch.__version__, "ok")


def triton_check() -> Check:
    try:
        import triton
    except ImportError as error:
        return Check("triton", f"not importable ({error})", "warn",
                     "gemmtune's own kernels are Triton kernels: without triton only cuBLAS remains.")
    return Check("triton", triton.__version__, "ok")


def precision_check() -> Check:
    import torch

    precision = torch.get_float32_matmul_precision()
    if precision == "highest":
        return Check(
            "float32 matmul", 'precision "highest": TF32 off', "warn",
            f"float32 matmuls skip the tensor cores. On an H200 a float32 4096x4096x4096 matmul took "
            f"{FP32_HIGHEST_MS} ms under \"highest\" and {FP32_HIGH_MS} ms under \"high\" "
            f"({TF32_SPEEDUP:.1f}x faster, torch 2.11).\n"
            'If a 10-bit mantissa on the inputs is acceptable: torch.set_float32_matmul_precision("high")',
        )
    return Check(
        "float32 matmul", f'precision "{precision}": TF32 allowed; gemmtune keys float32 results by it', "ok",
    )


# --- the store ---------------------------------------------------------------------------------


def store_size(path: Path) -> int:
    """Bytes of the database plus its WAL and shared-memory files, those that exist."""
    total = 0
    for suffix in STORE_SIDECARS:
        part = path.with_name(path.name + suffix)
        if part.is_file():
            total += part.stat().st_size
    return total


def store_check(store_path: str | Path | None = None) -> Check:
    """Where the store is and how large; a server's store is reached to be measured."""
    from gemmtune.store import ServerStore, open_store

    location = store_path if store_path is not None else settings.store_location()
    store = open_store(location, strict=True)
    if isinstance(store, ServerStore):
        with store:
            return Check("store", f"{store.path} (a server; {_size(store.size_bytes())})", "ok")
    path = store.path
    if not path.exists():
        return Check("store", f"{path} (not created yet)", "info")
    return Check("store", f"{path} ({_size(store_size(path))})", "ok")


def compile_cache_check() -> Check:
    """Triton's on-disk kernel cache as gemmtune's workers use it: a warm one makes tuning fast."""
    from gemmtune.tuning import fork_compile
    from gemmtune.tuning.compiler import default_workers

    path = settings.triton_cache_dir()
    workers = default_workers()
    children = ("with up to as many forked children" if fork_compile.usable()
                else "without children (GEMMTUNE_COMPILE_FORK=0)")
    threads = f"{workers} thread{'s compile' if workers != 1 else ' compiles'}"
    compiling = f"{threads} ahead on a GPU, {children}" if workers else "compiling ahead is off"
    if not path.exists():
        return Check("compile cache", f"{path} (empty: the first tuning compiles every candidate; "
                     f"{compiling})", "info")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return Check("compile cache", f"{path} ({_size(size)}; {compiling})", "ok")


# --- helpers -----------------------------------------------------------------------------------


def _current_device() -> Device:
    from gemmtune import device

    return device.current()


def _is_current(device: Device) -> bool:
    # Device equality leaves versions out, so a Device read earlier on this GPU still matches.
    try:
        return not device.interpreter and device == _current_device()
    except Exception:  # noqa: BLE001 - no current device to compare with means "not live"
        return False


def _guard(name: str, build: Callable[[], Any]) -> Any:
    """``build()``, or an "info" Check saying why it failed: the doctor itself never raises."""
    try:
        return build()
    except Exception as error:  # noqa: BLE001 - see the module docstring
        return Check(name, f"unavailable ({type(error).__name__}: {error})", "info")


def _guard_many(names: tuple[str, ...], build: Callable[[], list[Check]]) -> list[Check]:
    result = _guard(names[0], build)
    if isinstance(result, Check):
        return [dataclasses.replace(result, name=name) for name in names]
    return result


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number readable: 227 KiB, 50 MiB."""
    units = ("B", "KiB", "MiB", "GiB")
    value, unit = float(n), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.0f} {units[unit]}" if value.is_integer() else f"{value:.1f} {units[unit]}"
