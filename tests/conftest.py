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


@pytest.fixture
def fresh_dispatch():
    """gemmtune's dispatcher with nothing built, its store reopened in this test's cache
    directory (``_isolated_store``), and left so for the next test."""
    from gemmtune.serving.dispatch import DISPATCHER

    DISPATCHER.forget()
    DISPATCHER._store = None
    yield DISPATCHER
    DISPATCHER.forget()
    DISPATCHER._store = None
