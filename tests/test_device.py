"""The device's fingerprint, which keys every stored result: what changes it and what does not."""

import importlib.metadata

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
