"""`gemmtune compare`: on the CPU eager and gemmtune only, the compare file and its chart;
gemmtune.compile on the GPU."""

import json

import pytest
import torch

from gemmtune.cli import compare, main


def test_cpu_runs_eager_and_gemmtune_only():
    torch.manual_seed(0)
    rows = compare.run(compare.seed_mlp(32), torch.randn(4, 32), calls=5)
    assert [r.mode for r in rows] == ["eager", "gemmtune"]
    assert all(r.gpu_ms is None and r.host_us_per_call > 0 and r.host_vs_eager > 0 and r.max_rel_err < 1e-5
               for r in rows)


def test_the_cli_writes_the_compare_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "compare-cpu.json"
    assert main(["compare", "--input-shape", "8,64", "--dtype", "float32", "--modes", "eager", "gemmtune",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "compare" and doc["model"] == "seed-mlp" and doc["input_shape"] == [8, 64]
    assert [r["mode"] for r in doc["rows"]] == ["eager", "gemmtune"]
    assert set(doc["rows"][0]) == {"mode", "setup_s", "gpu_ms", "host_us_per_call", "host_vs_eager", "max_rel_err"}
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    on_gpu = torch.cuda.is_available()
    assert doc["gpu_timings"] is on_gpu and ("NOT GPU timings" in capsys.readouterr().out) is not on_gpu


def test_models_are_named_clearly():
    assert isinstance(compare.load_model("torch.nn:Identity"), torch.nn.Identity)
    with pytest.raises(ValueError, match="package.module:factory"):
        compare.load_model("resnet")
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        compare.load_model("builtins:dict")
    with pytest.raises(ValueError, match="mode 'turbo' is unknown"):
        compare.run(compare.seed_mlp(8), torch.randn(2, 8), ("turbo",))


def test_gemmtune_compile_is_a_mode_the_cpu_skips_as_it_skips_torch_compiles():
    rows = compare.run(compare.seed_mlp(32), torch.randn(4, 32), modes=("eager", "gemmtune.compile"), calls=5,
                       rounds=2)
    assert [row.mode for row in rows] == ["eager"]


@pytest.mark.gpu
def test_gemmtune_compile_runs_beside_eager_on_the_gpu():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    rows = compare.run(compare.seed_mlp(256), x, modes=("eager", "gemmtune.compile"), calls=5, rounds=2)
    assert [row.mode for row in rows] == ["eager", "gemmtune.compile"]
    assert rows[1].max_rel_err < 2e-2 and rows[1].gpu_ms > 0
