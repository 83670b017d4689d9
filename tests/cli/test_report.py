"""`gemmtune report`: a suite file as a Markdown table and a PNG."""

import json

import pytest

from gemmtune.cli import main, report

SUITE = {
    "kind": "suite", "device": "NVIDIA H200", "sm_count": 132, "torch": "2.11", "triton": "3.6.0",
    "date": "2026-11-22", "copy_tbps": 4.2,
    "rows": [
        {"name": "qkv.m1", "group": "decode", "m": 1, "n": 6144, "k": 4096, "dtype": "bfloat16",
         "cublas_ms": 0.023, "gemmtune_ms": 0.015, "speedup": 0.023 / 0.015, "inductor_ms": 0.019,
         "choice": "triton_splitk(SPLIT_K=4)", "tune_s": 1.2},
        {"name": "odd-4k", "group": "misaligned", "m": 4095, "n": 4097, "k": 4095, "dtype": "bfloat16",
         "cublas_ms": 0.9, "gemmtune_ms": 0.2, "speedup": 4.5, "inductor_ms": None, "choice": "cublas_padded",
         "tune_s": 3.0},
        {"name": "qkv.m16", "group": "decode", "m": 16, "n": 6144, "k": 4096, "dtype": "float32",
         "cublas_ms": 0.03, "gemmtune_ms": 0.03, "speedup": 1.0, "choice": "cublas", "tune_s": None},
    ],
}


def test_markdown_has_every_row_and_group_geomeans():
    text = report.suite_markdown(SUITE)
    assert "NVIDIA H200 (132 SMs)" in text and "| odd-4k | misaligned | 4095x4097x4095 |" in text
    assert "| 4.50x |" in text and "`triton_splitk(SPLIT_K=4)`" in text
    decode = (0.023 / 0.015 * 1.0) ** 0.5
    assert f"| decode | 2 | {decode:.3f}x | 1.000x |" in text
    assert "| 0.0190 |" in text and "| - |" in text  # a missing inductor time or tune time reads '-'
    assert "- tuning from cold: median 2.10 s, max 3.0 s per shape" in text


def test_decode_rows_read_their_weights_against_copy_and_read_bandwidth():
    lines = report.decode_bandwidth(dict(SUITE, read_tbps=4.0))
    assert lines[0] == "| decode shape | weights TB/s | of copy 4.20 TB/s | of read 4.00 TB/s |"
    qkv = 6144 * 4096 * 2 / (0.015 * 1e9)  # 3.36 TB/s
    assert f"| qkv.m1 | {qkv:.2f} | {100 * qkv / 4.2:.0f}% | {100 * qkv / 4.0:.0f}% |" in lines
    fp32 = 6144 * 4096 * 4 / (0.03 * 1e9)
    assert f"| qkv.m16 | {fp32:.2f} |" in lines[3] and len(lines) == 5
    assert report.decode_bandwidth(dict(SUITE, rows=SUITE["rows"][1:2])) == []


def test_an_fp8_decode_row_reads_one_byte_a_weight():
    row = {"name": "down.m1.fp8-row", "group": "decode", "m": 1, "n": 4096, "k": 14336, "dtype": "float8_e4m3fn",
           "scaling": "row", "out_dtype": "bfloat16", "cublas_ms": 0.03, "gemmtune_ms": 0.02, "speedup": 1.5,
           "choice": "triton_scaled", "tune_s": 1.0}
    lines = report.decode_bandwidth(dict(SUITE, rows=[row]))
    assert f"| down.m1.fp8-row | {4096 * 14336 / (0.02 * 1e9):.2f} |" in lines[2]
    assert "down.m1.fp8-row" in report.suite_markdown(dict(SUITE, rows=[row]))


def test_fp8_rows_are_summed_up_by_scaling_against_scaled_mm_and_the_unscaled_gemm():
    base = {"group": "decode", "m": 1, "n": 4096, "k": 4096, "dtype": "float8_e4m3fn", "out_dtype": "bfloat16",
            "choice": "triton_scaled", "tune_s": 1.0}
    rows = [dict(base, name="a", scaling="row", cublas_ms=0.03, gemmtune_ms=0.02, speedup=1.5, unscaled_ms=0.04),
            dict(base, name="b", scaling="row", cublas_ms=0.02, gemmtune_ms=0.02, speedup=1.0, unscaled_ms=0.02),
            dict(base, name="c", scaling="block", cublas_ms=None, cublas_refused="CUBLAS_STATUS_NOT_SUPPORTED",
                 gemmtune_ms=0.02, speedup=None, unscaled_ms=0.036),
            dict(base, name="d", dtype="bfloat16", scaling="none", cublas_ms=0.02, gemmtune_ms=0.02, speedup=1.0)]
    lines = report.fp8_summary(rows)
    assert lines[2] == f"| decode | row | 2 | {1.5 ** 0.5:.3f}x | 1.000x | 0 | {2 ** 0.5:.3f}x | 1.000x |"
    assert lines[3] == "| decode | block | 1 | - | - | 1 | 1.800x | 1.800x |"
    assert len(lines) == 5 and "| decode | block | 1 |" in report.suite_markdown(dict(SUITE, rows=rows))


def test_the_summary_reads_exhaustive_search_and_warm_tuning():
    rows = [dict(r, tune_s_warm=0.2, exhaustive_ms=r["gemmtune_ms"] * f, exhaustive_in_topk=f == 1.0)
            for r, f in zip(SUITE["rows"], (1.0, 0.9, 1.0))]
    lines = report.tuning_summary(rows)
    assert "warm: median 0.20 s" in lines[0]
    assert lines[-1] == ("- the choice within 2% of exhaustive search on 2 of 3 shapes; "
                         "the default strategy measured the exhaustive winner on 2 of 3")


def test_the_cli_writes_both_files_beside_the_results(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "suite-h200-20261122.json"
    path.write_text(json.dumps(SUITE))
    assert main(["report", str(path)]) == 0
    png = (tmp_path / "suite-h200-20261122.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (tmp_path / "suite-h200-20261122.md").read_text() == report.suite_markdown(SUITE)
    assert "wrote" in capsys.readouterr().out


def test_a_file_that_is_not_a_suite_or_models_file_is_refused(tmp_path):
    path = tmp_path / "dispatch.json"
    path.write_text(json.dumps({"kind": "dispatch", "rows": []}))
    with pytest.raises(ValueError, match="not a suite or models file"):
        report.read_results(path)
    with pytest.raises(ValueError, match="cannot read"):
        report.read_results(tmp_path / "missing.json")


def test_the_graph_line_names_the_kernel_cuda_graphs_replay():
    import random

    from gemmtune.cli.report import graph_line
    from gemmtune.results import Status, Timing, Trial, TuneResult

    def final(backend, config, median, seed):
        rng = random.Random(seed)
        return Trial(backend, config, Status.OK, timing=Timing(tuple(median * (1 + rng.uniform(-0.01, 0.01))
                                                                     for _ in range(24))))

    choice = TuneResult("key", "dev", "cublas", {}, 0.03, 0.03, 1.0)
    trials = [final("cublas", {}, 0.030, 1), final("cublaslt", {"algo": 1}, 0.027, 2)]
    assert graph_line(choice, trials).startswith(f"in CUDA graphs: {trials[1].label()}, its kernel 0.027")
    assert graph_line(choice, trials[:1]) == "in CUDA graphs: the choice's own kernel"
