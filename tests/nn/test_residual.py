"""Residual adds in the GEMM's epilogue (gemmtune.nn.residual): which adds are sites, the rewritten
forward computing what the module's own does (eval mode, and every call it leaves to the class's
forward), copies and pickles, the forms optimize's check switches between; on the GPU, cuBLASLt's
fused product against float64 on every view of a size a caller can pass."""

import copy
import io
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

import gemmtune
from gemmtune.nn import keep, residual


class DropPath(nn.Module):
    """As timm's: the identity in eval mode."""

    def __init__(self, p=0.1):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep_mask = torch.rand(x.shape[0], *([1] * (x.dim() - 1)), device=x.device) > self.p
        return x * keep_mask / (1 - self.p)


class Mlp(nn.Module):
    """timm's Mlp: its output is its fc2's."""

    def __init__(self, d, hidden):
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.1)
        self.fc2, self.drop2 = nn.Linear(hidden, d), nn.Dropout(0.1)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Attention(nn.Module):
    """timm's Attention, shapes read from the input."""

    def __init__(self, d, heads=2):
        super().__init__()
        self.heads, self.qkv, self.proj, self.proj_drop = heads, nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Dropout(0.1)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))


class Block(nn.Module):
    """timm's pre-norm block: two residual sites, each a layer inside a child."""

    def __init__(self, d):
        super().__init__()
        self.norm1, self.attn, self.drop_path1 = nn.LayerNorm(d), Attention(d), DropPath()
        self.norm2, self.mlp, self.drop_path2 = nn.LayerNorm(d), Mlp(d, 4 * d), DropPath()

    def forward(self, x):
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class Output(nn.Module):
    """BERT's output layer: LayerNorm(dropout(dense(h)) + x), two tensors in."""

    def __init__(self, d, hidden):
        super().__init__()
        self.dense, self.dropout, self.LayerNorm = nn.Linear(hidden, d), nn.Dropout(0.1), nn.LayerNorm(d)

    def forward(self, hidden_states, input_tensor, scale=None):
        h = F.dropout(self.dense(hidden_states), p=0.1, training=self.training)
        return self.LayerNorm(h + input_tensor if scale is None else h * scale + input_tensor)


class MixerBlock(nn.Module):
    """timm's MixerBlock: one drop_path module called after both MLPs; the token mixing's output
    is transposed before its add (no site), the channel mixing's is not."""

    def __init__(self, d, tokens):
        super().__init__()
        self.norm1, self.mlp_tokens, self.drop_path = nn.LayerNorm(d), Mlp(tokens, 2 * tokens), DropPath()
        self.norm2, self.mlp_channels = nn.LayerNorm(d), Mlp(d, 4 * d)

    def forward(self, x):
        x = x + self.drop_path(self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2))
        return x + self.drop_path(self.mlp_channels(self.norm2(x)))


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.up = nn.Linear(d, 4 * d)
        self.out = Output(d, 4 * d)

    def forward(self, x):
        x = self.blocks(x)
        return self.out(self.up(x), x)


def _optimized(model):
    torch.manual_seed(0)
    reference = copy.deepcopy(model).eval()
    gemmtune.optimize(model.eval(), residual=True)
    return model, reference


def _rewritten(model):
    return {name: vars(m)["forward"] for name, m in model.named_modules()
            if isinstance(vars(m).get("forward"), residual.Rewritten)}


def test_every_residual_add_after_a_layer_is_a_site_and_the_output_is_the_module_s():
    model, reference = _optimized(Net())
    rewritten = _rewritten(model)
    assert sorted(rewritten) == ["blocks.0", "blocks.1", "out"]
    assert rewritten["blocks.0"].paths == ["attn.proj", "mlp.fc2"]
    assert rewritten["out"].paths == ["dense"]
    assert residual.fused(model) == (0, 5)  # the CPU has no cuBLASLt: every site adds apart
    for rows in (1, 7, 33):
        x = torch.randn(rows, 5, 16)
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))  # gradients on: the layer, then the add
    assert list(model.state_dict()) == list(reference.state_dict())
    site = rewritten["out"].sites[0]
    site.fused_for[3] = None
    site.eager_plain = True
    residual.settle([model], lambda: None)  # optimize's: the check's choices dropped before choosing again
    assert site.fused_for == {} and not site.eager_plain


def test_an_identity_called_twice_is_skipped_where_it_follows_a_site():
    model, reference = _optimized(MixerBlock(16, 8))
    assert _rewritten(model)[""].paths == ["mlp_channels.fc2"]
    x = torch.randn(3, 8, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_calls_the_trace_does_not_cover_run_the_class_s_forward(monkeypatch):
    model, reference = _optimized(Net())
    h, x = torch.randn(2, 5, 64), torch.randn(2, 5, 16)
    calls = []
    original = Output.forward
    monkeypatch.setattr(Output, "forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    with torch.no_grad():
        model.out(h, x)
        assert calls == []  # the rewritten forward
        for args, kwargs in (((h,), {"input_tensor": x}), ((h, x, torch.tensor(2.0)), {}),
                             ((h.double(), x.double()), {})):
            if args[0].dtype == torch.float64:
                model.out.double()
                reference.out.double()
            want = reference.out(*args, **kwargs)
            calls.clear()
            assert torch.equal(model.out(*args, **kwargs), want)
            assert calls == [1]


def test_training_mode_runs_the_class_s_forward_with_its_dropouts():
    model, reference = _optimized(Net())
    model.train()
    reference.train()
    x = torch.randn(4, 5, 16)
    torch.manual_seed(1)
    got = model(x)
    torch.manual_seed(1)
    assert torch.equal(got, reference(x))
    model.eval()
    model.blocks[0].mlp.drop2.train()  # a skipped dropout in training mode: the class's forward
    reference.eval()
    reference.blocks[0].mlp.drop2.train()
    torch.manual_seed(2)
    got = model(x)
    torch.manual_seed(2)
    assert torch.equal(got, reference(x))


def test_a_hook_on_a_module_traced_through_sends_the_calls_to_the_class_s_forward():
    model, reference = _optimized(Net())
    seen = []
    model.blocks[0].mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert seen == [(2, 5, 16)]


def test_under_torch_compile_the_class_s_forward_is_traced_in_one_graph():
    model, reference = _optimized(Net())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
        assert torch.allclose(torch.compile(model, backend="eager")(x), reference(x), rtol=1e-5, atol=1e-6)


def test_a_copy_or_a_pickle_traces_again_and_computes_the_same():
    model, reference = _optimized(Net())
    x = torch.randn(3, 5, 16)
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (copied, loaded):
        assert _rewritten(other)["blocks.0"].parent is other.blocks[0]
        with torch.no_grad():
            assert torch.equal(other(x), reference(x))
        assert _rewritten(other)["blocks.0"].sites  # traced again on its first call


def test_the_forward_reads_the_children_as_optimize_s_check_switches_them():
    model, reference = _optimized(Net())
    x = torch.randn(2, 5, 16)
    fc1 = model.blocks[0].mlp.fc1
    assert fc1.activation == "gelu" and isinstance(model.blocks[0].mlp.act, nn.Identity)  # fused
    form = keep.Form(fc1)
    form.to_torch()  # the nn.Linear, its GELU module back in its place
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    form.to_gemmtune()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    model.blocks[1].mlp.fc2 = nn.Linear(64, 16)  # a layer replaced after optimize
    reference.blocks[1].mlp.fc2 = copy.deepcopy(model.blocks[1].mlp.fc2)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


class Shared(nn.Module):
    """Adds that are no sites: an output read twice, transposed first, a layer with a hook."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        a = self.a(x)
        y = x + a + a.sum()
        y = y + self.b(y).transpose(0, 1).transpose(0, 1) * 2
        return y + self.c(y)


def test_adds_of_an_output_read_elsewhere_or_changed_first_or_seen_by_a_hook_are_no_sites():
    model = Shared()
    model.c.register_forward_hook(lambda module, args, out: out * 2)
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    gemmtune.optimize(model.eval(), residual=True)
    assert _rewritten(model) == {}
    x = torch.randn(4, 8)
    assert torch.equal(model(x), reference(x))


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.seen = []

    def forward(self, x):
        self.seen.append(x)
        return x + self.fc(x)


class Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, row):
        return self.fc(x) + row


def test_a_forward_that_changes_its_state_gets_no_site_and_a_broadcast_residual_adds_apart():
    model = Stateful()
    gemmtune.optimize(model.eval(), residual=True)
    assert _rewritten(model) == {} and model.seen == []
    broadcast = Broadcast()
    reference = copy.deepcopy(broadcast)
    gemmtune.optimize(broadcast.eval(), residual=True)
    assert list(_rewritten(broadcast)) == [""]
    x, row = torch.randn(5, 8), torch.randn(8)
    with torch.no_grad():
        assert torch.equal(broadcast(x, row), reference(x, row))


def test_off_by_default_and_finding_sites_draws_no_random_numbers():
    model = Net()
    gemmtune.optimize(model.eval())
    assert _rewritten(model) == {}
    model = Net().eval()
    state = torch.get_rng_state()
    gemmtune.optimize(model, residual=True)
    assert torch.equal(torch.get_rng_state(), state) and _rewritten(model)


class LayerScale(nn.Module):
    """As timm's: not an identity (it scales), so an add after it is no site."""

    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x):
        return x * self.gamma


class Inner(nn.Module):
    """A child whose output is its last layer's, through the wrappers given."""

    def __init__(self, d, bias, after):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d, bias=bias)
        self.wrappers = nn.ModuleList(after)

    def forward(self, x):
        x = self.fc2(F.relu(self.fc1(x)))
        for wrapper in self.wrappers:
            x = wrapper(x)
        return x


class Drawn(nn.Module):
    """A block drawn by the property test: pre- or post-norm, the layer a child or inside one,
    wrappers between the layer and the add, the add's operand order, and whether the layer's
    output is read once more."""

    def __init__(self, d, nested, bias, wrappers, pre_norm, order, reread):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.inner = Inner(d, bias, wrappers) if nested else None
        self.fc = None if nested else nn.Linear(d, d, bias=bias)
        self.wrappers = nn.ModuleList([] if nested else wrappers)
        self.pre_norm, self.order, self.reread = pre_norm, order, reread

    def forward(self, x):
        h = self.norm(x) if self.pre_norm else x
        out = self.inner(h) if self.inner is not None else self.fc(h)
        for wrapper in self.wrappers:
            out = wrapper(out)
        y = {"left": lambda: x + out, "right": lambda: out + x, "torch.add": lambda: torch.add(out, x)}[self.order]()
        if self.reread:
            y = y + out.mean()
        return y if self.pre_norm else self.norm(y)


WRAPPERS = {"identity": nn.Identity, "dropout": lambda: nn.Dropout(0.3), "drop_path": lambda: DropPath(0.3),
            "scale": lambda: LayerScale(8)}


@settings(max_examples=40, deadline=None)
@given(nested=st.booleans(), bias=st.booleans(), wrappers=st.lists(st.sampled_from(sorted(WRAPPERS)), max_size=2),
       pre_norm=st.booleans(), order=st.sampled_from(["left", "right", "torch.add"]), reread=st.booleans(),
       shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_a_drawn_block_has_a_site_exactly_where_its_layer_s_output_reaches_the_add_alone(
        nested, bias, wrappers, pre_norm, order, reread, shape, seed):
    torch.manual_seed(seed)
    model = Drawn(8, nested, bias, [WRAPPERS[w]() for w in wrappers], pre_norm, order, reread).eval()
    reference = copy.deepcopy(model)
    gemmtune.optimize(model, residual=True)
    site = "scale" not in wrappers and not reread
    found = {path for r in _rewritten(model).values() for path in r.paths}
    assert found == ({"inner.fc2" if nested else "fc"} if site else set())
    x = torch.randn(*shape, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    model.train()
    reference.train()
    torch.manual_seed(seed + 1)
    got = model(x)
    torch.manual_seed(seed + 1)
    assert torch.equal(got, reference(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 33, 4095])
def test_the_fused_product_matches_float64_on_every_view_a_block_passes(rows, bias, dtype):
    d, hidden = 64, 256
    model = Output(d, hidden)
    if not bias:
        model.dense.bias = None
    model = model.cuda().to(dtype).eval()
    gemmtune.optimize(model, residual=True, check=False)
    site = _rewritten(model)[""].sites[0] if _rewritten(model)[""].sites else None
    torch.manual_seed(rows)
    h = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    x = torch.randn(rows, d, device="cuda", dtype=dtype) * 3
    with torch.no_grad():
        model(h, x)  # traced, and the way chosen
        site = _rewritten(model)[""].sites[0]
        site.fused_for[rows] = site.plan(model.dense, h, rows)  # the fused product, whichever measured faster
        assert site.fused_for[rows] is not None
        got = model(h, x)
        w, b = model.dense.weight.double(), None if model.dense.bias is None else model.dense.bias.double()
        ref = F.layer_norm(F.linear(h.double(), w, b) + x.double(), (d,), model.LayerNorm.weight.double(),
                           model.LayerNorm.bias.double())
        plain = F.layer_norm(F.linear(h, model.dense.weight, model.dense.bias) + x, (d,), model.LayerNorm.weight,
                             model.LayerNorm.bias)
    assert (got.double() - ref).abs().max() <= 2 * (plain.double() - ref).abs().max() + 1e-3
    # views the fused product does not take (a transposed or offset input) add apart, and right
    for view in (h.t().contiguous().t(), torch.randn(rows, hidden + 8, device="cuda", dtype=dtype)[:, 8:]):
        view.copy_(h)
        with torch.no_grad():
            assert torch.allclose(model(view, x).float(), got.float(), rtol=0, atol=0.05)


@pytest.mark.gpu
def test_a_model_s_blocks_choose_their_way_and_compute_what_they_did():
    torch.manual_seed(0)
    model = Net(256).cuda().to(torch.bfloat16).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 64, 256, device="cuda", dtype=torch.bfloat16)
    gemmtune.optimize(model, (x,), residual=True)
    with torch.no_grad():
        got, want = model(x).float(), reference(x).float()
    fused, sites = residual.fused(model)
    assert sites == 5 and 0 <= fused <= 5
    assert (got - want).abs().max() <= 0.1 * want.abs().max()


@pytest.mark.gpu
def test_eager_plain_sites_add_apart_in_eager_calls_and_fuse_in_cuda_graphs():
    torch.manual_seed(0)
    d, hidden, rows = 256, 1024, 512
    model = Output(d, hidden).cuda().to(torch.bfloat16).eval()
    gemmtune.optimize(model, residual=True, check=False)
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    dense, norm = model.dense, model.LayerNorm
    with torch.no_grad():
        model(h, x)  # traced, and the way chosen
        site = _rewritten(model)[""].sites[0]
        plan = site.fused_for[rows] = site.plan(dense, h, rows)
        fused = F.layer_norm(residual._launch(plan, h, dense.weight, dense.bias, x), (d,), norm.weight, norm.bias)
        plain = F.layer_norm(dense(h) + x, (d,), norm.weight, norm.bias)
        site.eager_plain = True
        assert torch.equal(model(h, x), plain)
        graph, out = torch.cuda.CUDAGraph(), None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(h, x)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = model(h, x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused)
        site.eager_plain = False
        assert torch.equal(model(h, x), fused)


@pytest.mark.gpu
def test_optimize_settles_whether_eager_calls_stay_fused_and_says_so(caplog):
    torch.manual_seed(0)
    model = Net(256).cuda().to(torch.bfloat16).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 64, 256, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="gemmtune"):
        gemmtune.optimize(model, (x,), residual=True)
    sites = [s for r in _rewritten(model).values() for s in r.sites]
    fused = [s for s in sites if any(plan is not None for plan in s.fused_for.values())]
    said = [r.getMessage() for r in caplog.records if "residual adds" in r.getMessage() and "eager" in r.getMessage()]
    assert said if fused else not any(s.eager_plain for s in sites)
    assert len({s.eager_plain for s in fused}) <= 1  # one verdict for the model's sites
    with torch.no_grad():
        got, want = model(x).float(), reference(x).float()
    assert (got - want).abs().max() <= 0.1 * want.abs().max()
