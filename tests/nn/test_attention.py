"""``nn.MultiheadAttention`` taken over by optimize (gemmtune.nn.attention): the calls it serves
compute what torch's forward does, the others run torch's forward, which modules are taken, the
GEMMs an example run records, and the way back."""

import copy
import logging

import pytest
import torch
from torch import nn

import gemmtune
from gemmtune.nn import attention, keep
from gemmtune.problem import Problem


def made(embed=24, heads=4, **kwargs):
    torch.manual_seed(0)
    return nn.MultiheadAttention(embed, heads, **kwargs).eval()


class Block(nn.Module):
    """A transformer block's attention, called as nn.TransformerEncoderLayer calls it."""

    def __init__(self, **kwargs):
        super().__init__()
        self.attn = made(**kwargs)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("batch_first,shape", [(True, (3, 7, 24)), (False, (7, 3, 24)), (True, (7, 24)),
                                               (False, (5, 24))])
@pytest.mark.parametrize("bias", [True, False])
def test_a_served_call_computes_what_torch_s_forward_does(batch_first, shape, bias, monkeypatch):
    model, reference = Block(batch_first=batch_first, bias=bias), Block(batch_first=batch_first, bias=bias)
    gemmtune.optimize(model)
    assert type(model.attn) is attention.MultiheadAttention
    projections = []
    linear = attention.api.linear
    monkeypatch.setattr(attention.api, "linear", lambda *args: projections.append(args[1].shape) or linear(*args))
    x = torch.randn(*shape)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
    assert projections == [(72, 24), (24, 24)]  # both projections through gemmtune.linear


def test_calls_it_does_not_serve_run_torch_s_forward(monkeypatch):
    module, reference = made(batch_first=True), made(batch_first=True)
    gemmtune.optimize(module)
    monkeypatch.setattr(attention.MultiheadAttention, "served_forward", lambda self, q: pytest.fail("served"))
    x, other = torch.randn(2, 5, 24), torch.randn(2, 6, 24)
    mask = torch.tensor([[False] * 4 + [True], [False] * 5])
    with torch.no_grad():
        for args, kwargs in [((x, x, x), {}),  # need_weights defaults to True: the weights are asked for
                             ((x, other, other), {"need_weights": False}),  # cross-attention
                             ((x, x, x), {"need_weights": False, "key_padding_mask": mask}),
                             ((x, x, x), {"need_weights": False, "attn_mask": torch.zeros(5, 5)})]:
            got, expected = module(*args, **kwargs), reference(*args, **kwargs)
            torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
            assert (got[1] is None) == (expected[1] is None)


def test_attention_it_cannot_serve_is_left_to_torch_with_its_reason(caplog):
    model = nn.ModuleDict({"cross": made(kdim=16, vdim=16), "biased": made(add_bias_kv=True), "plain": made()})
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        gemmtune.optimize(model)
    assert type(model["cross"]) is nn.MultiheadAttention and type(model["biased"]) is nn.MultiheadAttention
    assert type(model["plain"]) is attention.MultiheadAttention
    assert "key or value size" in caplog.text and "bias_k" in caplog.text
    # its output projection (an nn.Linear subclass it reads the weights of) is not taken on its own
    assert type(model["plain"].out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear


def test_release_gives_back_torch_s_attention():
    module, reference = made(batch_first=True), made(batch_first=True)
    gemmtune.optimize(module)
    keep.Form(module).release()
    assert type(module) is nn.MultiheadAttention and "torch_when_capturing" not in vars(module)
    x = torch.randn(2, 5, 24)
    with torch.no_grad():
        torch.testing.assert_close(module(x, x, x, need_weights=False)[0], reference(x, x, x, need_weights=False)[0])


def test_the_example_run_records_both_projections_of_each_attention(fake_tuning):
    """The input projection (M, 3E, E) and the output projection (M, E, E), both with their bias;
    the layer stays gemmtune's where one of them was tuned to a gemmtune kernel."""
    model = Block(batch_first=True)
    tuned = fake_tuning(lambda p: "triton_tiled" if p.n == 72 else "cublas")
    gemmtune.optimize(model, (torch.randn(3, 7, 24),))
    assert sorted(tuned, key=lambda p: p.n) == [Problem(21, 24, 24, "float32", "linear", True),
                                                Problem(21, 72, 24, "float32", "linear", True)]
    assert type(model.attn) is attention.MultiheadAttention


@pytest.mark.parametrize("batch_first, training, heads, fastpath, fused", [
    (True, False, 4, True, True),
    (False, False, 4, True, False),  # sequence first: torch runs it call by call
    (True, True, 4, True, False),    # training
    (True, False, 3, True, False),   # an odd number of heads
    (True, False, 4, False, False),  # the fused path turned off
])
def test_its_served_eager_call_costs_the_host_more_where_torch_runs_attention_as_one_fused_op(
        batch_first, training, heads, fastpath, fused):
    module = made(embed=24, heads=heads, batch_first=batch_first).train(training)
    gemmtune.optimize(module)
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        assert module.eager_host_us() == (attention.FUSED_CALL_HOST_US if fused else 0.0)
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


@pytest.mark.parametrize("cublas_ms, chosen_ms, training, graph_only", [
    (0.050, 0.045, False, True),   # 2 x 5 us saved on the GPU, under the fused call's host saving
    (0.100, 0.080, False, False),  # 2 x 20 us saved: the served call pays
    (0.050, 0.045, True, False),   # training: torch's forward is no cheaper on the host
])
def test_attention_whose_gemms_save_less_than_torch_s_fused_call_serves_graphs_alone(
        monkeypatch, cublas_ms, chosen_ms, training, graph_only):
    from gemmtune.results import Status, Timing, Trial, TuneResult
    from gemmtune.serving.dispatch import DISPATCHER

    module, reference = made(batch_first=True).train(training), made(batch_first=True).train(training)
    gemmtune.optimize(module)
    inner, outer, unrecorded = Problem(10, 72, 24, bias=True), Problem(10, 24, 24, bias=True), Problem(10, 8, 24)
    final = lambda ms: Timing((ms,) * 24)  # noqa: E731 - as long as cuBLAS's: the final rounds'
    trials = [Trial("cublas", {}, Status.OK, timing=final(cublas_ms)),
              Trial("triton_tiled", {"n": 1}, Status.OK, timing=final(chosen_ms))]
    monkeypatch.setattr(DISPATCHER, "trials", lambda problem, device: [] if problem == unrecorded else trials)
    results = {p.key(): TuneResult(p.key(), "fake-device", "triton_tiled", {"n": 1}, 1.0, 1.0, 0.1)
               for p in (inner, outer, unrecorded)}
    problems = {module: {inner.key(), outer.key(), unrecorded.key()}}  # one without final rounds saves nothing
    assert keep.eager_gain_us(problems[module], results) == pytest.approx(2e3 * (cublas_ms - chosen_ms))
    form = keep.Form(module)
    assert keep.served([form], problems, results) == [form]
    assert form.graph_only == graph_only and module.torch_when_capturing is (False if graph_only else None)
    if graph_only:  # its eager calls run torch's forward
        monkeypatch.setattr(attention.MultiheadAttention, "served_forward", lambda self, q: pytest.fail("served"))
        x = torch.randn(2, 5, 24)
        with torch.no_grad():
            torch.testing.assert_close(module(x, x, x, need_weights=False)[0],
                                       reference(x, x, x, need_weights=False)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_on_the_gpu_an_encoder_s_attention_runs_through_gemmtune():
    torch.manual_seed(0)
    model = nn.Sequential(Block(embed=256, heads=8, batch_first=True)).cuda().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    gemmtune.optimize(model, (x,), check=False)
    assert type(model[0].attn) is attention.MultiheadAttention
    with torch.no_grad():
        got, expected = model(x).float(), reference(x).float()
    assert (got - expected).norm() / expected.norm() < 2e-2
