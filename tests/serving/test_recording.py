"""Record -> tune -> deploy: what gemmtune.record writes, and `gemmtune tune --from` reading it (what
lookup mode appends on a miss, the other file it reads, is in test_dispatch)."""

import json

import pytest
import torch

import gemmtune
from gemmtune import shapes
from gemmtune.cli import main
from gemmtune.problem import Problem


def test_record_counts_forward_and_backward_gemms(tmp_path):
    path = tmp_path / "gemms.json"
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    with gemmtune.record(path) as recording:
        for _ in range(2):
            gemmtune.linear(x, w, activation="relu").sum().backward()
        gemmtune.matmul(torch.randn(4, 6), torch.randn(6, 2))
        torch.matmul(torch.randn(4, 6), torch.randn(6, 2))  # not through gemmtune: not recorded
    assert gemmtune.record.__module__ == "gemmtune.serving.recording" and recording.path == path
    entries = {(e["m"], e["n"], e["k"], e["layout"], e["activation"]): e["count"]
               for e in json.loads(path.read_text())["shapes"]}
    assert entries == {
        # the forward, x flattened to (15, 16): with a gradient the activation runs after it as
        # torch's op, whose backward reads the saved pre-activation (serving/autograd.py)
        (15, 8, 16, "linear", "none"): 2,
        (15, 16, 8, "nn", "none"): 2,      # dx = dz @ w
        (8, 16, 15, "nn", "none"): 2,      # dw = dz.T @ x
        (4, 2, 6, "nn", "none"): 1,
    }
    loaded = {named.problem for named in shapes.load(path)}
    assert Problem(15, 8, 16, "float32", "linear", tf32=False) in loaded


def test_record_writes_even_when_the_run_fails_and_does_not_nest(tmp_path):
    path = tmp_path / "gemms.json"
    with pytest.raises(KeyError):
        with gemmtune.record(path):
            gemmtune.matmul(torch.randn(4, 6), torch.randn(6, 2))
            with pytest.raises(RuntimeError, match="do not nest"):
                with gemmtune.record(tmp_path / "other.json"):
                    pass
            raise KeyError("the user's run failed")
    assert [e["count"] for e in json.loads(path.read_text())["shapes"]] == [1]
    with gemmtune.record(tmp_path / "again.json"):  # the failed block left no recording active
        pass


@pytest.mark.interpreter
def test_tune_from_a_recording(capsys, tmp_path):
    path = tmp_path / "gemms.json"
    with gemmtune.record(path):
        gemmtune.linear(torch.randn(7, 33), torch.randn(40, 33), torch.randn(40))
    code = main(["tune", "--from", str(path), "--json", "--cache", str(tmp_path / "store")])
    out = capsys.readouterr().out
    assert code == 0
    (result,) = json.loads(out)
    assert (result["m"], result["n"], result["k"], result["dtype"], result["layout"], result["bias"],
            result["tf32"]) == (7, 40, 33, "float32", "linear", True, False)


def test_empty_products_are_not_recorded(tmp_path):
    path = tmp_path / "gemms.json"
    with gemmtune.record(path):
        assert gemmtune.linear(torch.randn(3, 0), torch.randn(4, 0)).shape == (3, 4)
        assert gemmtune.matmul(torch.randn(0, 5), torch.randn(5, 2)).shape == (0, 2)
    assert json.loads(path.read_text())["shapes"] == []


def test_a_recording_without_a_path_is_kept_in_memory_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with gemmtune.record() as seen:
        gemmtune.matmul(torch.randn(4, 6), torch.randn(6, 2))
    assert seen.problems() == [(Problem(4, 2, 6, "float32", "nn", tf32=False), 1)]
    assert list(tmp_path.iterdir()) == []
