"""`gemmtune report` on a models file: each case's ratio per mode, each mode's summary, a PNG."""

import json

import pytest

from gemmtune.cli import main, zoo_report


def row(model, mode, speedup, *, phase="inference", dtype="bfloat16", baseline=None, control=None, **extra):
    return {"model": model, "source": "timm", "batch": 64, "seq": None, "dtype": dtype, "phase": phase,
            "mode": mode, "baseline": baseline or mode, "speedup": speedup, "spread": 0.01, "gemms": 49,
            "gemms_kept": 12, "fused_kept": 4, "control": control, **extra}


MODELS = {
    "kind": "models", "device": "NVIDIA H100 80GB HBM3", "sm_count": 132, "torch": "2.11", "date": "2026-11-27",
    "rows": [row("vit", "eager", 1.02, control=1.0), row("vit", "graph", 1.10),
             row("vit", "eager", 0.95, phase="train", control=1.01),
             row("bert", "eager", 0.98, control=0.99), row("bert", "graph", 1.00),
             row("bert", "gemmtune-compile", 0.96, baseline="max-autotune-no-cudagraphs"),
             {"model": "gpt2", "mode": "eager", "baseline": "eager", "dtype": "bfloat16", "phase": "inference",
              "error": "RuntimeError: out of memory"}],
    "skipped": [["llama", "graph"]],
}


def test_each_case_is_a_line_with_a_column_per_mode():
    text = zoo_report.markdown(MODELS)
    assert "NVIDIA H100 80GB HBM3 (132 SMs)" in text
    assert "| model | dtype | phase | batch | GEMM calls kept / seen (layers) | eager | graph | " \
           "gemmtune-compile vs max-autotune-no-cudagraphs |" in text
    assert "| vit | bfloat16 | inference | 64 | 12 / 49 (4 fused) | 1.020 +-0.010 (A/A 1.00) | 1.100 +-0.010 |  |" in text
    assert "| bert | bfloat16 | inference | 64 | 12 / 49 (4 fused) | **0.980 +-0.010 (A/A 0.99)** | 1.000 +-0.010 | " \
           "**0.960 +-0.010** |" in text
    assert "gpt2" not in text  # a failed row has no ratio
    assert "Skipped (time budget): 1." in text


def test_each_mode_is_summed_up_over_inference_cases_with_the_rows_under_the_floor():
    text = zoo_report.markdown(MODELS)
    assert f"| eager | 2 | {(1.02 * 0.98) ** 0.5:.3f}x | 0.980x | bert bfloat16 0.980 |" in text
    assert f"| graph | 2 | {(1.10 * 1.00) ** 0.5:.3f}x | 1.000x | - |" in text
    assert "| gemmtune-compile vs max-autotune-no-cudagraphs | 1 | 0.960x | 0.960x | bert bfloat16 0.960 |" in text
    assert "| vit | bfloat16 | train | 64 |" in text and "vit bfloat16 0.950" not in text  # train apart


def test_the_cli_renders_a_models_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "models-h100-20261127.json"
    path.write_text(json.dumps(MODELS))
    assert main(["report", str(path), "--out", str(tmp_path / "out")]) == 0
    png = (tmp_path / "out" / "models-h100-20261127.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (tmp_path / "out" / "models-h100-20261127.md").read_text() == zoo_report.markdown(MODELS)
    assert "wrote" in capsys.readouterr().out
