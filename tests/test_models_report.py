"""The model benchmark's reading of what the compiler's own GEMM autotuning chose, from the report
it writes to stderr (torch 2.11's format, lines as an H200 run wrote them)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

REPORT = """\
Autotune Choices Stats:
{"num_choices": 22, "num_triton_choices": 20, "best_kernel": "triton_mm_43", "best_time": 0.0198}
AUTOTUNE addmm(24576x196, 24576x384, 384x196)
strides: [0, 1], [384, 1], [1, 384]
dtypes: torch.bfloat16, torch.bfloat16, torch.bfloat16
  triton_mm_43 0.0198 ms 100.0% ACC_TYPE='tl.float32', BLOCK_K=64, BLOCK_M=64, BLOCK_N=128, num_stages=3, num_warps=4
  triton_mm_42 0.0224 ms 88.2% ACC_TYPE='tl.float32', BLOCK_K=32, BLOCK_M=64, BLOCK_N=128, num_stages=4, num_warps=8
  bias_addmm 0.0301 ms 65.8% \n\
SingleProcess AUTOTUNE benchmarking takes 8.6397 seconds and 0.0003 seconds precompiling for 22 choices
AUTOTUNE addmm(6272x3072, 6272x768, 768x3072)
strides: [0, 1], [768, 1], [1, 768]
dtypes: torch.bfloat16, torch.bfloat16, torch.bfloat16
  bias_addmm 0.0495 ms 100.0% \n\
  triton_mm_69 0.0612 ms 81.0% ACC_TYPE='tl.float32', BLOCK_K=64, BLOCK_M=128, BLOCK_N=128, num_stages=3, num_warps=4
AUTOTUNE convolution(32x3x224x224, 768x3x16x16)
strides: [150528, 50176, 224, 1], [768, 256, 16, 1]
dtypes: torch.bfloat16, torch.bfloat16
  convolution 0.3310 ms 100.0% \n\
"""


def models():
    if "benchmark_models" not in sys.modules:  # its dataclasses look their module up there
        spec = importlib.util.spec_from_file_location("benchmark_models", ROOT / "benchmarks" / "models.py")
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules["benchmark_models"]


def test_each_autotuned_op_gives_its_chosen_kernel_and_the_fastest_library_call_listed():
    found = models().autotuned_choices(REPORT)
    assert [(f["op"], f["choice"], f["ms"], f["library"], f["library_ms"]) for f in found] == [
        ("addmm(24576x196, 24576x384, 384x196)", "triton_mm_43", 0.0198, "bias_addmm", 0.0301),
        ("addmm(6272x3072, 6272x768, 768x3072)", "bias_addmm", 0.0495, "bias_addmm", 0.0495),
        ("convolution(32x3x224x224, 768x3x16x16)", "convolution", 0.331, "convolution", 0.331)]
    assert found[0]["config"].startswith("ACC_TYPE='tl.float32', BLOCK_K=64") and found[1]["config"] == ""


def test_the_report_is_read_while_still_written_to_stderr(capsys):
    module = models()
    with module.autotune_report() as found:
        sys.stderr.write(REPORT)
        assert found == []  # filled when the block exits
    assert [f["choice"] for f in found] == ["triton_mm_43", "bias_addmm", "convolution"]
    assert "AUTOTUNE addmm(6272x3072" in capsys.readouterr().err


def test_text_that_is_no_report_gives_nothing():
    assert models().autotuned_choices("AUTOTUNE benchmarking takes 1 s\n  x 1.0 ms 100.0%\nstrides: [1]\n") == []
