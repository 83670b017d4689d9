"""cuBLAS on padded copies: same numbers as the unpadded product, at every misaligned size."""

import pytest
import torch

from gemmtune.backends import get
from gemmtune.backends.cublas_padded import PaddedConfig, padded_size
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning import verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["linear", "nn"])
@pytest.mark.parametrize("m,n,k", [(1, 7, 33), (7, 33, 4095), (33, 4097, 65), (5, 64, 13), (3, 13, 64)])
@pytest.mark.parametrize("align", [8, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(m, n, k, layout, align, bias):
    problem = Problem(m, n, k, "float32", layout, bias)
    inputs = verify.make_inputs(problem, DEVICE)
    kernel = get("cublas_padded").build(problem, PaddedConfig(align), current())
    assert verify.check(kernel, problem, inputs).ok
    result = kernel(inputs.a, inputs.b, inputs.bias)
    assert result.shape == (m, n) and result.is_contiguous()


def test_offered_only_for_misaligned_problems():
    backend = get("cublas_padded")
    assert backend.candidates(Problem(4096, 4096, 4096), current()) == []
    assert backend.candidates(Problem(4095, 4097, 4095), current()) == [PaddedConfig(8), PaddedConfig(64)]
    assert not Problem(8, 8, 4100).rows_aligned and Problem(8, 8, 4100, "float32").rows_aligned


def test_padded_sizes():
    assert padded_size(4095, 8, 8) == 4096 and padded_size(4097, 8, 8) == 4104
    assert padded_size(4097, 8, 64) == 4160 and padded_size(4096, 8, 64) == 4096


@pytest.mark.parametrize("data", [{"align": 3}, {"align": True}, {}, {"align": 8, "x": 1}, "align=8"])
def test_untrusted_configs_are_rejected(data):
    with pytest.raises(ValueError):
        get("cublas_padded").parse_config(data)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows, cols", [(9, 40), (3, 5), (7, 33), (9, 33)])
def test_copy_padded_cuts_and_zero_fills(rows, cols):
    from gemmtune.backends.cublas_padded import copy_padded

    src = torch.randn(13, 7, device=DEVICE)[::2, ::1]  # (7, 7), a strided view
    dst = copy_padded(src, rows, cols)
    expected = torch.zeros(rows, cols, device=DEVICE)
    r, c = min(rows, 7), min(cols, 7)
    expected[:r, :c] = src[:r, :c]
    assert torch.equal(dst, expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ["relu", "gelu_tanh"])
def test_activation_after_the_cut(act):
    problem = Problem(7, 33, 65, "float32", "linear", True, activation=act)
    inputs = verify.make_inputs(problem, DEVICE)
    kernel = get("cublas_padded").build(problem, PaddedConfig(8), current())
    assert verify.check(kernel, problem, inputs).ok


@pytest.mark.interpreter
@pytest.mark.parametrize("src_shape, stride, rows, cols", [((5, 12), 12, 7, 16), ((6, 8), 20, 4, 6), ((3, 4), 4, 3, 12)])
def test_the_flat_copy_cuts_and_zero_fills_rows_aligned_to_four(src_shape, stride, rows, cols):
    """Sources and destinations whose rows start every 4 elements take the flat copy (sizes as
    constants): a contiguous source, a view with wider rows, cut or padded in either dimension."""
    from gemmtune.backends.cublas_padded import _rows_aligned_to, copy_padded

    src = torch.randn(src_shape[0], stride, device=DEVICE)[:, :src_shape[1]]
    assert _rows_aligned_to(src, 4)
    dst = copy_padded(src, rows, cols)
    expected = torch.zeros(rows, cols, device=DEVICE)
    r, c = min(rows, src_shape[0]), min(cols, src_shape[1])
    expected[:r, :c] = src[:r, :c]
    assert torch.equal(dst, expected)
    assert not _rows_aligned_to(torch.randn(8, 12).t(), 4) and not _rows_aligned_to(torch.randn(4, 6), 4)


def test_copies_too_large_for_int32_offsets_go_through_torch(monkeypatch):
    """Past the kernels' int32 offsets (here a limit lowered to 30 elements) the copy is torch's:
    the same cut and zero fill, never an offset that wrapped around."""
    import gemmtune.backends.cublas_padded as padded
    import gemmtune.backends.kernels.pad as kernels

    monkeypatch.setattr(padded, "INDEX_LIMIT", 30)
    monkeypatch.setattr(padded, "_PLANS", {})  # no plan an earlier call made for these shapes
    for name in ("pad_copy", "pad_copy_flat"):  # neither kernel may run
        monkeypatch.setattr(kernels, name, None)
    src = torch.randn(6, 8, device=DEVICE)
    dst = padded.copy_padded(src, 5, 12)
    expected = torch.zeros(5, 12, device=DEVICE)
    expected[:, :8] = src[:5]
    assert torch.equal(dst, expected)


@pytest.mark.gpu
def test_the_copies_launch_their_binaries_after_the_first_call():
    from gemmtune.backends import cublas_padded as padded

    for (rows, k), (to_rows, to_k), which in (((5, 4100), (5, 4160), 0), ((7, 4097), (9, 4104), 1)):
        src = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        dst = padded.copy_padded(src, to_rows, to_k)  # through the JIT: makes the binary, the plan and the launchers
        launcher = padded._LAUNCHERS[which]  # 0: the flat copy, 1: the 2-D copy
        before, plans = launcher.binaries(), len(padded._PLANS)
        for _ in range(3):
            dst = padded.copy_padded(src, to_rows, to_k, out=torch.full_like(dst, float("nan")))
            assert torch.equal(dst[:rows, :k], src) and not dst[rows:].any() and not dst[:, k:].any()
        assert launcher.binaries() == before >= 1 and len(padded._PLANS) == plans  # nothing new made per call


def test_an_out_of_another_shape_is_refused():
    from gemmtune.backends.cublas_padded import copy_padded

    with pytest.raises(ValueError, match=r"out has shape \(3, 8\), not \(3, 9\)"):
        copy_padded(torch.randn(3, 7, device=DEVICE), 3, 9, out=torch.empty(3, 8, device=DEVICE))


def test_an_out_whose_rows_are_not_contiguous_is_refused():
    from gemmtune.backends.cublas_padded import copy_padded

    with pytest.raises(ValueError, match="out's rows must be contiguous"):
        copy_padded(torch.randn(3, 7, device=DEVICE), 3, 9, out=torch.empty(9, 3, device=DEVICE).t())
