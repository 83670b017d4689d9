"""The model benchmark's models outside the zoo (``timm:NAME[@BATCH]``, ``hf:MODEL_TYPE[@BATCHxSEQ]``)
and its count of a step's GEMM FLOPs."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from test_models_report import models


@pytest.mark.parametrize("name, batch, about", [
    ("timm:beit_base_patch16_224", 32, "timm beit_base_patch16_224, random weights, batch 32 at 224x224"),
    ("timm:levit_128@128", 128, "timm levit_128, random weights, batch 128 at 224x224"),
    ("hf:opt", 8, "transformers opt, default config, random weights, 8 x 128 tokens"),
    ("hf:distilbert@32x256", 32, "transformers distilbert, default config, random weights, 32 x 256 tokens"),
])
def test_a_named_model_reads_its_library_name_and_sizes(name, batch, about):
    entry = models().entry_of(name)
    assert entry.about == about
    if name.startswith("timm:"):  # a timm entry's cases need no library to be listed
        (case,) = entry.cases(name, False)
        assert (case.batch, case.phase, case.dtype) == (batch, "inference", torch.bfloat16)


@pytest.mark.parametrize("name, says", [
    ("resnet50", "a zoo model, timm:NAME[@BATCH] or hf:MODEL_TYPE[@BATCHxSEQ]"),
    ("timm:", "a zoo model"),
    ("onnx:bert", "a zoo model"),
    ("timm:vit_base_patch16_224@0", "BATCH (positive integers), not '0'"),
    ("timm:vit_base_patch16_224@8x128", "BATCH (positive integers), not '8x128'"),
    ("hf:bert@32", "BATCHxSEQ (positive integers), not '32'"),
    ("hf:bert@32x0", "BATCHxSEQ (positive integers), not '32x0'"),
])
def test_a_name_that_cannot_be_read_is_refused_with_what_is_accepted(name, says):
    with pytest.raises(ValueError) as caught:
        models().named_entry(name)
    assert says in str(caught.value) and repr(name) in str(caught.value)


def test_the_command_line_refuses_an_unknown_model_naming_the_zoo(capsys):
    with pytest.raises(SystemExit):
        models().parse_args(["--models", "seed-mlp,resnet50", "--out", "x.json"])
    err = capsys.readouterr().err
    assert "--models: 'resnet50'" in err and "seed-mlp" in err and "hf:MODEL_TYPE" in err


def test_a_zoo_model_and_a_named_one_pass_the_command_line():
    args = models().parse_args(["--models", "seed-mlp,timm:levit_128@64,hf:opt@4x64", "--out", "x.json"])
    assert args.models == ["seed-mlp", "timm:levit_128@64", "hf:opt@4x64"]


class Products(nn.Module):
    """One of each GEMM op the count reads, at awkward sizes."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(33, 7)  # addmm on 2-D input
        self.weight = nn.Parameter(torch.randn(7, 5))
        self.bias = nn.Parameter(torch.randn(3, 1, 5))

    def forward(self, x):
        y = self.linear(x)  # (1, 7)... (n, 7)
        z = y @ self.weight  # mm
        batched = z.unsqueeze(0).expand(3, -1, -1)
        w = torch.bmm(batched, batched.transpose(1, 2))  # bmm
        return torch.baddbmm(self.bias.expand(3, w.shape[1], 5), w, batched)  # baddbmm


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("phase", ["inference", "train"])
def test_the_gemm_count_agrees_with_torchs_flop_counter(rows, phase):
    m = models()
    torch.manual_seed(0)
    model = Products()
    x = torch.randn(rows, 33)
    case = m.Case("products", "torch", rows, None, torch.float32, phase, lambda device, dtype: {"x": x})
    ours = m.all_gemm_flops(case, model, {"x": x})
    with FlopCounterMode(display=False) as counter, m.grad_mode(case):
        m.step_of(case, model, model, {"x": x})()
    gemm_ops = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")
    theirs = sum(f for op, f in counter.get_flop_counts()["Global"].items() if str(op) in gemm_ops)
    assert ours == theirs > 0


@pytest.mark.parametrize("name, kind", [
    ("triton_tem_fused_addmm_gelu_t_view_21", "gemm template"),
    ("triton_tem_fused_convolution_3", "convolution template"),
    ("triton_red_fused_convolution_native_layer_norm_permute_6", "compiled pointwise/reduction"),
    ("triton_poi_fused_gelu_view_7", "compiled pointwise/reduction"),
    ("conv2d_c1_k1_nhwc_specialized", "convolution"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "convolution"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "library gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("_stream_matmul_kernel", "gemmtune"),
    ("void at::native::vectorized_elementwise_kernel<4>", "other"),
])
def test_a_profiled_kernel_is_sorted_by_its_name(name, kind):
    assert models().kernel_kind(name) == kind
