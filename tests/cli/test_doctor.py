"""``gemmtune doctor`` on the CPU: no GPU here, fake Devices for the GPU cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import triton
from rich.console import Console

from gemmtune.cli import doctor
from gemmtune.device import INDUCTOR_MIN_SMS, Device

RTX_3060 = Device(name="NVIDIA GeForce RTX 3060", capability=(8, 6), sm_count=28, smem_per_block=101376,
                  l2_bytes=3 << 20)
H100 = Device(name="NVIDIA H100 80GB HBM3", capability=(9, 0), sm_count=132, smem_per_block=232448,
              l2_bytes=50 << 20)

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU report")


def by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {check.name: check for check in checks}


@pytest.fixture
def precision():
    """Lets a test set the float32 matmul precision and puts it back afterwards."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GEMMTUNE_CACHE_DIR", str(tmp_path))
    return tmp_path


@needs_no_gpu
def test_without_gpu_says_interpreter_and_not_gpu_timings(cache_dir):
    checks = by_name(doctor.collect())
    gpu = checks["GPU"]
    assert gpu.status == "warn"
    assert "no CUDA GPU" in gpu.value
    assert "interpreter" in gpu.advice
    assert "not GPU timings" in gpu.advice
    assert checks["inductor max_autotune_gemm gate"].status == "info"
    assert "SMs" not in checks  # a CPU core count is not an SM count


def test_versions_are_reported(cache_dir):
    checks = by_name(doctor.collect())
    assert checks["torch"].value == torch.__version__
    assert checks["triton"].value == triton.__version__
    assert {"driver", "CUDA", "float32 matmul", "inductor max_autotune_gemm gate", "store"} <= set(checks)


def test_store_path_honours_cache_dir_and_sums_wal_and_shm(cache_dir):
    assert "not created yet" in by_name(doctor.collect(device=H100))["store"].value
    store = cache_dir / "gemmtune.sqlite"
    store.write_bytes(b"x" * 4096)
    (cache_dir / "gemmtune.sqlite-wal").write_bytes(b"x" * 1024)
    check = by_name(doctor.collect(device=H100))["store"]
    assert str(store) in check.value
    assert "5 KiB" in check.value
    assert doctor.store_size(store) == 5120


def test_explicit_store_path(tmp_path):
    store = tmp_path / "elsewhere.sqlite"
    store.write_bytes(b"x" * 100)
    assert doctor.store_check(store).value == f"{store} (100 B)"


def test_small_gpu_fails_the_gate_with_actionable_advice(cache_dir):
    checks = by_name(doctor.collect(device=RTX_3060))
    gate = checks["inductor max_autotune_gemm gate"]
    assert gate.status == "warn"
    assert "28" in gate.value and str(INDUCTOR_MIN_SMS) in gate.value
    for needle in ("28 SMs", "68", "Not enough SMs to use max_autotune_gemm mode", "not your input shapes",
                   "max-autotune-no-cudagraphs", "multiples of 8 or 16", "set_float32_matmul_precision",
                   "epilogue fusion", "scales its search space"):
        assert needle in gate.advice, needle
    assert checks["SMs"].value == "28"
    assert checks["shared memory / block"].value.startswith("99 KiB")
    assert checks["L2"].value == "3 MiB"


def test_big_gpu_passes_the_gate(cache_dir):
    checks = by_name(doctor.collect(device=H100))
    gate = checks["inductor max_autotune_gemm gate"]
    assert gate.status == "ok"
    assert gate.advice == ""
    assert checks["shared memory / block"].value.startswith("227 KiB")
    assert checks["L2"].value == "50 MiB"


def test_gate_boundary_is_inclusive():
    at_gate = Device(name="NVIDIA GeForce RTX 3080", capability=(8, 6), sm_count=68, smem_per_block=101376,
                     l2_bytes=5 << 20)
    assert doctor.gate_check(at_gate).status == "ok"


def test_given_device_skips_live_nvml_queries(cache_dir):
    checks = by_name(doctor.collect(device=RTX_3060))
    assert checks["clocks"].status == "info" and "not queried" in checks["clocks"].value
    assert checks["throttle"].status == "info"


def test_precision_highest_warns_with_the_measured_cost(precision, cache_dir):
    precision("highest")
    check = by_name(doctor.collect(device=H100))["float32 matmul"]
    assert check.status == "warn"
    assert "7.5x" in check.advice
    assert 'torch.set_float32_matmul_precision("high")' in check.advice


@pytest.mark.parametrize("value", ["high", "medium"])
def test_precision_with_tf32_is_ok(precision, value):
    precision(value)
    check = doctor.precision_check()
    assert check.status == "ok"
    assert "TF32 allowed" in check.value


def test_decode_throttle_reasons():
    assert doctor.decode_reasons(0) == []
    assert doctor.decode_reasons(0x4 | 0x40) == ["sw power cap", "hw thermal"]
    assert doctor.decode_reasons(0x1 | 0x2 | 0x8 | 0x20 | 0x80) == [
        "idle", "applications clocks", "hw slowdown", "sw thermal", "hw power brake"]
    assert doctor.decode_reasons(0x10000) == ["other (0x10000)"]


def test_a_failing_check_becomes_info_not_an_exception(monkeypatch, cache_dir):
    def broken() -> str:
        raise RuntimeError("NVML exploded")

    monkeypatch.setattr(doctor, "driver_version", broken)
    driver = by_name(doctor.collect(device=H100))["driver"]
    assert driver.status == "info"
    assert "NVML exploded" in driver.value


def test_render_shows_the_table_and_the_advice(cache_dir):
    console = Console(record=True, width=120)
    doctor.render(doctor.collect(device=RTX_3060), console)
    text = console.export_text()
    assert "NVIDIA GeForce RTX 3060" in text
    assert "Not enough SMs to use max_autotune_gemm mode" in text
    assert "inductor max_autotune_gemm gate" in text


def test_render_keeps_brackets_in_values():
    console = Console(record=True, width=120)
    doctor.render([doctor.Check("store", "/tmp/[bold]odd/gemmtune.sqlite (0 B)", "info")], console)
    assert "[bold]odd" in console.export_text()


def test_as_dict_is_json_serialisable(cache_dir):
    rows = doctor.as_dict(doctor.collect(device=RTX_3060))
    decoded = json.loads(json.dumps(rows))
    assert {"name", "value", "status", "advice"} <= set(decoded[0])
    assert any(row["name"] == "inductor max_autotune_gemm gate" and row["status"] == "warn" for row in decoded)


def test_check_rejects_unknown_status():
    with pytest.raises(ValueError, match="status"):
        doctor.Check("GPU", "x", "fine")


def test_compile_cache_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    check = next(c for c in doctor.collect() if c.name == "compile cache")
    assert str(tmp_path / "triton") in check.value and "empty" in check.value
    (tmp_path / "triton" / "abc").mkdir(parents=True)
    (tmp_path / "triton" / "abc" / "k.cubin").write_bytes(b"x" * 4096)
    monkeypatch.setenv("GEMMTUNE_COMPILE_WORKERS", "3")
    check = next(c for c in doctor.collect() if c.name == "compile cache")
    assert check.status == "ok" and "4" in check.value and "3 threads compile ahead" in check.value
    assert "forked children" in check.value
    monkeypatch.setenv("GEMMTUNE_COMPILE_FORK", "0")
    check = next(c for c in doctor.collect() if c.name == "compile cache")
    assert "without children (GEMMTUNE_COMPILE_FORK=0)" in check.value
    monkeypatch.setenv("GEMMTUNE_COMPILE_WORKERS", "0")
    assert "compiling ahead is off" in next(c for c in doctor.collect() if c.name == "compile cache").value


def test_cublas_products_right_and_wrong():
    def torch_product(p, a, b):
        return torch.mm(a, b.t() if p.layout == "linear" else b)

    def wrong_on_1000(p, a, b):
        out = torch_product(p, a, b)
        if p.m == 1000:
            out[::7] = 0  # a seventh of the rows never written, as a broken kernel might leave them
        return out

    right = doctor.cublas_check(torch_product, device="cpu")
    assert right.status == "ok" and f"right on {len(doctor.CUBLAS_PROBES)}" in right.value
    wrong = doctor.cublas_check(wrong_on_1000, device="cpu")
    assert wrong.status == "warn" and wrong.value.startswith("WRONG on 1 of")
    assert "1000x1000x1000 nn" in wrong.advice and "MPS" in wrong.advice and "float64 reference" in wrong.advice


@pytest.mark.gpu
def test_cublas_products_are_right_on_the_whole_gpu(cache_dir):
    """cuBLAS on this GPU, as the doctor checks it; on a GPU split by MPS this may rightly warn."""
    check = by_name(doctor.collect())["cuBLAS products"]
    assert check.status == "ok" and check.value == f"right on {len(doctor.CUBLAS_PROBES)} bf16 shapes", check


def test_cublaslt_callable_or_said_not_to_be():
    from gemmtune.errors import CublasLtError

    def missing():
        raise CublasLtError("libcublasLt is not loaded in this process")

    check = doctor.cublaslt_check(missing)
    assert check.status == "info" and "not loaded" in check.value and "cublaslt backend is left out" in check.advice

    class Loaded:
        _name = "/x/nvidia/cublas/lib/libcublasLt.so.13"

        def cublasLtGetVersion(self):
            return 130100

    assert doctor.cublaslt_check(Loaded).value == "version 130100 (/x/nvidia/cublas/lib/libcublasLt.so.13)"


@pytest.mark.gpu
def test_cublaslt_is_callable_on_the_gpu():
    check = doctor.cublaslt_check()
    assert check.status == "ok" and "libcublasLt" in check.value


def test_the_cute_backend_is_said_offered_or_why_not(monkeypatch):
    from gemmtune.backends import cute

    hopper = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 << 20)
    ampere = Device("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912, 40 << 20)
    check = doctor.cute_check(ampere)
    assert (check.status, check.value) == ("info", "not offered on sm_80")
    monkeypatch.setattr(cute, "installed", lambda: False)
    check = doctor.cute_check(hopper)
    assert check.status == "info" and "pip install gemmtune[cute]" in check.advice
    monkeypatch.setattr(cute, "installed", lambda: True)
    assert doctor.cute_check(hopper).status == "ok"
    assert any(c.name == "CuTe DSL" for c in doctor.collect(device=hopper))
