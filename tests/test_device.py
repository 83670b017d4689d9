"""The device's fingerprint, which keys every stored result: what changes it and what does not."""

import importlib.metadata
import os

import pytest
import torch

from gemmtune import device


def _fingerprint_with(monkeypatch, installed: dict[str, str]) -> str:
    real = importlib.metadata.version

    def version(name):
        if name in device.KERNEL_LIBRARIES:
            if name not in installed:
                raise importlib.metadata.PackageNotFoundError(name)
            return installed[name]
        return real(name)

    monkeypatch.setattr(device.importlib.metadata, "version", version)
    device.kernel_library_versions.cache_clear()  # read once a process: read again for this install
    try:
        return device.interpreter_device().fingerprint()
    finally:
        device.kernel_library_versions.cache_clear()


def test_an_optional_kernel_library_installed_or_upgraded_is_a_new_fingerprint(monkeypatch):
    without = _fingerprint_with(monkeypatch, {})
    with_cute = _fingerprint_with(monkeypatch, {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.8.1"})
    upgraded = _fingerprint_with(monkeypatch, {"quack-kernels": "0.6.6", "nvidia-cutlass-dsl": "4.8.1"})
    assert len({without, with_cute, upgraded}) == 3
    # the same packages, the same fingerprint: a store stays valid from one process to the next
    assert _fingerprint_with(monkeypatch, {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.8.1"}) == with_cute
    assert _fingerprint_with(monkeypatch, {}) == without


def test_the_fingerprint_names_the_device_before_its_hash():
    fingerprint = device.interpreter_device().fingerprint()
    assert fingerprint.startswith("cpu-triton-interpreter-sm00-") and len(fingerprint.rsplit("-", 1)[1]) == 12


def test_describing_the_interpreter_leaves_the_process_as_it_is(monkeypatch):
    """Triton's kernels defined after TRITON_INTERPRET=1 is set are interpreted: a process with
    a GPU that asks for the interpreter's description keeps compiling them."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert device.interpreter_device().interpreter
    assert "TRITON_INTERPRET" not in os.environ


def test_a_process_without_a_gpu_is_switched_to_the_interpreter(monkeypatch):
    # imported first, as this process chose: triton imported with the variable set would make
    # its own helpers interpreted for the GPU tests this process runs next
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device.current.cache_clear()
    try:
        assert device.current().interpreter
        assert os.environ["TRITON_INTERPRET"] == "1"
    finally:
        device.current.cache_clear()
