"""The CLI through ``main(argv)``: tune on the CPU interpreter, the cache commands, errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from gemmtune.cli import main
from gemmtune.problem import Problem


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for command in ("doctor", "tune", "bench", "cache", "compare", "report", "GEMMTUNE_CACHE_DIR", "GEMMTUNE_MODE"):
        assert command in out


def test_python_dash_m_runs_the_same_command_line():
    done = subprocess.run([sys.executable, "-m", "gemmtune", "tune", "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: gemmtune tune")


@pytest.mark.interpreter
def test_an_fp8_shape_is_tuned_and_stored_under_its_scaled_key(capsys, tmp_path):
    store = tmp_path / "store"
    code, out, err = run(capsys, "tune", "--shape", "5x32x130", "--dtype", "float8_e4m3fn", "--scaling", "row",
                         "--out-dtype", "float32", "--json", "--cache", str(store))
    assert code == 0, err
    row = json.loads(out)[0]
    assert (row["scaling"], row["out_dtype"]) == ("row", "float32") and row["rel_err"] < 8e-3
    key = Problem(5, 32, 130, "float8_e4m3fn", scaling="row", out_dtype="float32").key()
    code, out, _ = run(capsys, "cache", "--cache", str(store), "show", key)
    assert code == 0 and "triton_scaled" in out
    code, _, err = run(capsys, "tune", "--shape", "5x32x130", "--dtype", "float8_e4m3fn", "--cache", str(store))
    assert code != 0 and "--dtype float8_e4m3fn with --scaling none" in err


@pytest.mark.interpreter
def test_tune_json_then_cache_round_trip(capsys, tmp_path):
    store = tmp_path / "store"
    code, out, err = run(capsys, "tune", "--shape", "7x40x33", "--dtype", "float32", "--layout", "nn",
                         "--json", "--cache", str(store))
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 1 and rows[0]["m"] == 7 and rows[0]["k"] == 33 and rows[0]["rel_err"] < 1e-4
    on_gpu = torch.cuda.is_available()
    assert rows[0]["gpu_timings"] is on_gpu and ("NOT GPU timings" in err) is not on_gpu

    code, out, _ = run(capsys, "cache", "--cache", str(store), "list")
    assert code == 0 and "1 choices" in out

    key = Problem(7, 40, 33, "float32", "nn").key()
    code, out, _ = run(capsys, "cache", "--cache", str(store), "show", key)
    assert code == 0 and "triton_tiled" in out and "cublas" in out and "in CUDA graphs: " in out

    exported = tmp_path / "export.json"
    assert run(capsys, "cache", "--cache", str(store), "export", str(exported))[0] == 0
    assert json.loads(exported.read_text())["choices"][0]["problem"] == key
    other = tmp_path / "other"
    code, out, _ = run(capsys, "cache", "--cache", str(other), "import", str(exported))
    assert code == 0 and "imported 1" in out
    code, out, _ = run(capsys, "cache", "--cache", str(other), "clear")
    assert code == 0 and "removed 1" in out


def test_tune_rejects_a_bad_shape(capsys):
    code, _, err = run(capsys, "tune", "--shape", "4096x4096")
    assert code == 2 and "MxNxK" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's limit; a GPU tunes the shape")
def test_interpreter_refuses_gpu_sized_shapes(capsys):
    code, _, err = run(capsys, "tune", "--shape", "4096x4096x4096")
    assert code == 2 and "too large for the CPU interpreter" in err


def test_import_of_a_bad_file_is_refused(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "gemmtune-store", "version": 1, "choices": [
        {"device": "d", "problem": "v2/nn/float32/1x1x1/bias=0/act=none", "backend": "triton_tiled",
         "config": {"BLOCK_M": 3}, "time_ms": 1.0, "cublas_ms": 1.0, "rel_err": 0.0, "tune_s": 1.0,
         "gpu_timings": True}]}))
    code, _, err = run(capsys, "cache", "--cache", str(tmp_path / "s"), "import", str(bad))
    assert code == 2 and "config" in err


def test_doctor_runs(capsys):
    code, out, _ = run(capsys, "doctor", "--json")
    assert code == 0 and json.loads(out)


@pytest.mark.interpreter
@pytest.mark.parametrize("cache", ["team.db", "stores"])
def test_doctor_reports_the_store_that_tune_writes(capsys, tmp_path, cache):
    """``--cache`` names one store for every command (a file, or a directory holding one)."""
    code, _, err = run(capsys, "tune", "--shape", "7x40x33", "--dtype", "float32", "--layout", "nn",
                       "--json", "--cache", str(tmp_path / cache))
    assert code == 0, err
    written = [path for path in tmp_path.rglob("*") if path.is_file() and path.suffix in (".db", ".sqlite")]
    code, out, _ = run(capsys, "doctor", "--json", "--cache", str(tmp_path / cache))
    store = next(check for check in json.loads(out) if check["name"] == "store")
    assert written and store["value"].startswith(str(written[0])) and "not created" not in store["value"]


def test_budget_flag(capsys):
    from gemmtune.cli import parse_budget

    assert parse_budget("8").trials == 8 and parse_budget("2.5s").seconds == 2.5 and parse_budget(None).trials is None
    code, _, err = run(capsys, "tune", "--shape", "7x8x9", "--budget", "lots")
    assert code == 2 and "--budget 'lots'" in err


@pytest.mark.interpreter
def test_bucket_validation_report(capsys):
    code, out, err = run(capsys, "tune", "--shape", "24x48x48", "--dtype", "float32", "--layout", "nn",
                         "--bucket", "pow2", "--validate", "1", "--in-process", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 1 and rows[0]["bucket"].startswith("v2/nn/float32/32x64x64") and rows[0]["loss"] is not None
    code, _, err = run(capsys, "tune", "--shape", "24x40x48", "--validate", "1")
    assert code == 2 and "--bucket pow2" in err
    code, out, err = run(capsys, "tune", "--shape", "24x40x48", "--dtype", "float32", "--layout", "nn",
                         "--bucket", "pow2", "--validate", "1", "--in-process", "--json")
    assert code == 0 and json.loads(out) == [] and "a pow2 bucket of its own" in err


@pytest.mark.interpreter
def test_bench_times_the_stored_choice_and_writes_a_suite_file(capsys, tmp_path):
    store, out = tmp_path / "store", tmp_path / "bench.json"
    code, _, err = run(capsys, "bench", "--shape", "7x40x33", "--dtype", "float32", "--layout", "nn", "--bias",
                       "--activation", "relu", "--rounds", "3", "--out", str(out), "--cache", str(store))
    assert code == 0, err
    doc = json.loads(out.read_text())
    on_gpu = torch.cuda.is_available()
    assert doc["kind"] == "suite" and doc["gpu_timings"] is on_gpu and ("NOT GPU timings" in err) is not on_gpu
    (row,) = doc["rows"]
    assert (row["m"], row["n"], row["k"], row["layout"], row["bias"], row["activation"]) == (7, 40, 33, "nn", True, "relu")
    assert row["verified"] and row["rel_err"] < 1e-4
    assert row["speedup"] == pytest.approx(row["cublas_ms"] / row["gemmtune_ms"]) and row["noise"] >= 0
    # the choice was tuned into the store on the miss; a second bench finds it there
    code, out_text, _ = run(capsys, "cache", "--cache", str(store), "list")
    assert code == 0 and "1 choices" in out_text
    code, out_text, err = run(capsys, "bench", "--shape", "7x40x33", "--dtype", "float32", "--layout", "nn", "--bias",
                              "--activation", "relu", "--rounds", "3", "--json", "--cache", str(store))
    assert code == 0, err
    assert json.loads(out_text)[0]["choice"] == row["choice"]
    assert run(capsys, "report", str(out), "--no-png")[0] == 0
    assert "7x40x33" in (tmp_path / "bench.md").read_text()


def test_bench_rejects_bad_arguments(capsys):
    code, _, err = run(capsys, "bench", "--shape", "7x40x33", "--rounds", "0")
    assert code == 2 and "--rounds" in err
    code, _, err = run(capsys, "bench", "--shape", "7x40")
    assert code == 2 and "MxNxK" in err
    code, _, err = run(capsys, "bench", "--shapes", "/nonexistent/shapes.json")
    assert code == 2 and "--shapes /nonexistent/shapes.json: cannot read" in err


@pytest.mark.interpreter
def test_bench_fails_when_a_stored_choice_is_wrong(capsys, monkeypatch, tmp_path):
    from gemmtune import backends

    store = tmp_path / "store"
    assert run(capsys, "tune", "--shape", "7x40x33", "--dtype", "float32", "--cache", str(store), "--json")[0] == 0
    right = backends.build

    def off(*args):
        kernel = right(*args)
        return lambda a, b, bias, out=None: kernel(a, b, bias) * 1.05

    monkeypatch.setattr(backends, "build", off)
    code, out, err = run(capsys, "bench", "--shape", "7x40x33", "--dtype", "float32", "--rounds", "3",
                         "--cache", str(store))
    assert code == 1 and "WRONG" in out and "was wrong on 7x40x33" in err
