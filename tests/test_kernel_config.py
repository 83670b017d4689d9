"""A user's kernel config and its key as the store holds them (gemmtune.kernel_config): what is
valid, and the store's validation of kernel entries beside the GEMM ones."""

import json

import pytest

from gemmtune.errors import StoreError
from gemmtune.kernel_config import BACKEND, KernelConfig, is_kernel_key, kernel_key, key_issue
from gemmtune.results import TuneResult
from gemmtune.store import Store

KEY = kernel_key("add_kernel", "0123456789abcdef", "fedcba9876543210", "100;torch.float32")


class Config:  # what triton.Config holds
    def __init__(self, kwargs, num_warps=4, num_stages=3, num_ctas=1, maxnreg=None):
        self.kwargs, self.num_warps, self.num_stages, self.num_ctas, self.maxnreg = (
            kwargs, num_warps, num_stages, num_ctas, maxnreg)


def test_a_config_round_trips_as_data():
    data = KernelConfig.of(2, Config({"BLOCK": 64, "EVEN": True, "MODE": "fast"}, num_warps=8, num_stages=2))
    assert KernelConfig.from_dict(json.loads(json.dumps(data.as_dict()))) == data
    assert data.label() == "BLOCK=64,EVEN=True,MODE=fast,w8,s2"


@pytest.mark.parametrize("change, message", [
    ({"index": -1}, "index"), ({"index": True}, "index"), ({"num_warps": 3}, "power of two"),
    ({"num_warps": 128}, "num_warps"), ({"num_stages": -1}, "num_stages"), ({"num_ctas": 0}, "num_ctas"),
    ({"maxnreg": 1000}, "maxnreg"), ({"kwargs": {"BLOCK": [1, 2]}}, "BLOCK must be"),
    ({"kwargs": {"not a name": 1}}, "identifier"), ({"kwargs": {"class": 1}}, "identifier"),
    ({"kwargs": {"X": float("nan")}}, "X must be"), ({"kwargs": [["BLOCK", 1]]}, "kwargs is an object"),
    ({"extra": 1}, "keys"),
])
def test_an_invalid_stored_config_is_refused_with_what_is_wrong(change, message):
    data = {**KernelConfig(0, (("BLOCK", 64),)).as_dict(), **change}
    with pytest.raises((ValueError, TypeError), match=message):
        KernelConfig.from_dict(data)


def test_keys():
    assert is_kernel_key(KEY) and key_issue(KEY) is None and not is_kernel_key("4096x4096x4096")
    assert "starts with" in key_issue("add@x/y/z")
    assert "reads kernel:" in key_issue("kernel:add")
    assert "printable" in key_issue("kernel:a@b/c/\x00")
    with pytest.raises(ValueError):
        kernel_key("add", "h", "c", "x" * 5000)


def result(key=KEY, backend=BACKEND, config=None) -> TuneResult:
    return TuneResult(key, "dev", backend, config or KernelConfig(1, (("BLOCK", 32),)).as_dict(), 0.01, None, 0.5)


def test_the_store_keeps_a_kernel_s_choice_beside_the_gemm_ones(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.put(result())
    got = store.get("dev", KEY)
    assert got.config == result().config and got.backend == BACKEND and got.label() == "triton_config(BLOCK=32,w4,s3)"
    path = tmp_path / "export.json"
    assert store.export_json(path) == 1
    assert Store(tmp_path / "other.sqlite").import_json(path) == 1


@pytest.mark.parametrize("entry, message", [
    (result(backend="cublas", config={}), "goes with a kernel key"),
    (result(key="4096x4096x4096"), "problem"),
])
def test_a_kernel_entry_that_does_not_hold_together_is_refused(tmp_path, entry, message):
    with pytest.raises(ValueError, match=message):
        Store(tmp_path / "s.sqlite").put(entry)


def test_an_import_file_with_a_bad_kernel_config_is_refused_whole(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.put(result())
    path = tmp_path / "export.json"
    store.export_json(path)
    document = json.loads(path.read_text())
    document["choices"][0]["config"]["num_warps"] = 5
    path.write_text(json.dumps(document))
    with pytest.raises(StoreError, match="power of two"):
        Store(tmp_path / "other.sqlite").import_json(path)
