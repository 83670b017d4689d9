"""``gemmtune.nn.ScaledLinear``: a weight quantized by its owner, the input quantized per call to
match its scaling, the product through ``gemmtune.scaled_mm``; its checks name the argument."""

import pytest
import torch

import gemmtune
from gemmtune import scaling
from gemmtune.nn import ScaledLinear
from gemmtune.problem import Problem
from gemmtune.tuning import verify

E4M3 = torch.float8_e4m3fn


def quantized_weight(how, n=64, k=256):
    return scaling.quantize(torch.randn(n, k), E4M3, how, weight=True)


@pytest.mark.parametrize("how", ["tensor", "row", "block"])
@pytest.mark.parametrize("shape", [(5, 256), (2, 3, 256), (1, 256)])
def test_its_output_is_the_product_of_the_quantized_input_and_weight(how, shape):
    wq, ws = quantized_weight(how)
    bias = torch.randn(64).to(torch.bfloat16)
    layer = ScaledLinear(wq, ws, bias, activation="gelu")
    x = torch.randn(*shape, dtype=torch.bfloat16)
    out = layer(x)
    assert out.shape == (*shape[:-1], 64) and out.dtype == torch.bfloat16
    xq, sx = scaling.quantize(x.reshape(-1, 256), E4M3, how, weight=False)
    p = Problem(xq.shape[0], 64, 256, "float8_e4m3fn", scaling=how, bias=True, activation="gelu")
    inputs = verify.inputs_of(p, xq, wq, bias, sx, ws)
    assert verify.judge(out.reshape(-1, 64), p, inputs).ok


def test_a_static_input_scale_quantizes_every_call_alike():
    # the same product of the input quantized by the fixed scale, bit for bit: only the layer's
    # quantization can differ (torch._scaled_mm itself rounds its sums in another order than the
    # CPU's dequantized product, one output in a few thousand)
    wq, ws = quantized_weight("tensor")
    layer = ScaledLinear(wq, ws, input_scale=torch.tensor(0.01))
    x = torch.randn(4, 256)
    expected = gemmtune.scaled_mm((x / 0.01).clamp(-448, 448).to(E4M3), wq.t(), torch.tensor(0.01), ws,
                                  out_dtype=torch.bfloat16)
    assert torch.equal(layer(x), expected)


def test_its_weight_and_scales_are_buffers_of_its_state():
    wq, ws = quantized_weight("row")
    state = ScaledLinear(wq, ws.reshape(-1)).state_dict()
    assert set(state) == {"weight", "weight_scale"} and state["weight_scale"].shape == (1, 64)


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((torch.randn(64, 256), torch.tensor(1.0)), {}, TypeError, "weight must be a 2-D \\(N, K\\) tensor in"),
    ((torch.randn(64, 256).to(E4M3), torch.ones(3, 3)), {}, ValueError, "weight_scale \\(3, 3\\) is no scaling"),
    ((torch.randn(64, 256).to(E4M3), torch.ones(64)), {"input_scale": torch.tensor(1.0)}, ValueError,
     "input_scale .* goes with a per-tensor weight_scale only"),
    ((torch.randn(64, 256).to(E4M3), [1.0]), {}, TypeError, "weight_scale must be a float tensor"),
])
def test_a_malformed_layer_names_its_argument(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        ScaledLinear(*args, **kwargs)


def test_the_scaling_is_read_from_the_weight_scale():
    w = torch.randn(300, 200).to(E4M3)
    layers = [ScaledLinear(w, s) for s in (torch.tensor(1.0), torch.ones(300), torch.ones(300, 1), torch.ones(3, 2))]
    assert [layer.scaling for layer in layers] == ["tensor", "row", "row", "block"]
    assert layers[3].weight_scale.shape == (2, 3)  # (K/128, N/128), as scaled_mm takes it for weight.t()


def test_torch_compile_traces_it_whole_into_torch_s_scaled_mm():
    # per tensor: the scaling torch's CPU _scaled_mm takes (torch 2.11)
    wq, ws = quantized_weight("tensor")
    layer = ScaledLinear(wq, ws, activation="relu")
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))
