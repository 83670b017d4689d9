import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any kernel module is imported: triton.jit reads it at decoration.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_store(tmp_path, monkeypatch):
    """No test writes to the user's real cache directory."""
    monkeypatch.setenv("GEMMTUNE_CACHE_DIR", str(tmp_path / "gemmtune-cache"))


@pytest.fixture(autouse=True)
def _float32_precision():
    """No test leaks torch's global float32 matmul precision into the next (float32 problems are
    keyed by it)."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)
