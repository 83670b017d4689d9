"""The public functions: bad input gets an error naming the argument or a documented fallback."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gemmtune
from gemmtune.backends.base import KernelBase
from gemmtune.problem import Problem
from gemmtune.serving import calls


def test_import_touches_neither_triton_nor_cuda_nor_files(tmp_path):
    """``import gemmtune`` registers the custom ops (finding 5: they were missing until a
    gradient or torch.compile imported gemmtune.serving.torch_ops), which imports torch; but never
    triton, which picks its interpreter when first imported, nor CUDA, nor the store."""
    code = (
        "import sys, gemmtune, torch\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "assert torch.ops.gemmtune.linear.default and torch.ops.gemmtune.mm.default\n"
        "print('ok')\n"
    )
    src = str(Path(gemmtune.__file__).resolve().parents[1])
    env = {"GEMMTUNE_CACHE_DIR": str(tmp_path / "store"), "PATH": "/usr/bin:/bin", "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("call, error, message", [
    (lambda: gemmtune.matmul([[1.0]], torch.ones(1, 1)), TypeError, "a must be a torch.Tensor"),
    (lambda: gemmtune.matmul(torch.ones(2, 3), "b"), TypeError, "b must be a torch.Tensor"),
    (lambda: gemmtune.matmul(torch.ones(2, 3), torch.ones(4, 5)), ValueError, r"a.shape\[1\] must equal b.shape\[0\]"),
    (lambda: gemmtune.matmul(torch.ones(2, 3), torch.ones(3, 5, dtype=torch.float16)), TypeError, "does not mix dtypes"),
    (lambda: gemmtune.linear(torch.ones(2, 3), torch.ones(3)), ValueError, "weight must be 2-D"),
    (lambda: gemmtune.linear(torch.ones(2, 3), torch.ones(5, 4)), ValueError, "weight's K=4"),
    (lambda: gemmtune.linear(torch.ones(2, 3), torch.ones(5, 3), torch.ones(4)), ValueError, r"bias must have shape \(5,\)"),
    (lambda: gemmtune.linear(torch.ones(2, 3), torch.ones(5, 3), bias=3.0), TypeError, "bias must be a torch.Tensor"),
    (lambda: gemmtune.linear(torch.ones(2, 3), torch.ones(5, 3, dtype=torch.bfloat16)), TypeError, "weight has dtype"),
    (lambda: gemmtune.tune(["4096x4096x4096"]), TypeError, "item 0 is a str"),
    # finding 5 (issue 26): CPU and meta both have device index -1, and passed as one device
    (lambda: gemmtune.linear(torch.ones(2, 3), torch.ones(5, 3, device="meta")), ValueError, "weight is on meta"),
    (lambda: gemmtune.linear(torch.ones(2, 3), torch.ones(5, 3), torch.ones(5, device="meta")), ValueError,
     "bias is on meta"),
    (lambda: gemmtune.matmul(torch.ones(2, 3, device="meta"), torch.ones(3, 5)), ValueError, "b is on cpu"),
])
def test_bad_input_names_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixed devices need a GPU")
def test_mixed_devices_are_an_error():
    with pytest.raises(ValueError, match="weight is on cpu"):
        gemmtune.linear(torch.ones(2, 3, device="cuda"), torch.ones(5, 3))


@pytest.mark.parametrize("a, b", [
    (torch.randn(5, 7), torch.randn(7, 3)),  # CPU tensors: torch runs them
    (torch.randn(5, 7, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)),  # unsupported dtype
    (torch.randn(0, 7), torch.randn(7, 3)),  # zero-size M
    (torch.randn(5, 0), torch.randn(0, 3)),  # K = 0: zeros
    (torch.randn(2, 5, 7), torch.randn(7, 3)),  # batched: torch.matmul's rules
    (torch.randn(7), torch.randn(7, 3)),  # 1-D
])
def test_documented_fallbacks_match_torch(a, b):
    torch.testing.assert_close(gemmtune.matmul(a, b), torch.matmul(a, b))


def test_linear_fallbacks_match_torch():
    x, w, bias = torch.randn(2, 4, 7), torch.randn(3, 7), torch.randn(3)
    torch.testing.assert_close(gemmtune.linear(x, w, bias), F.linear(x, w, bias))
    v = torch.randn(7)
    torch.testing.assert_close(gemmtune.linear(v, w), F.linear(v, w))


def test_autograd_inputs_fall_back_and_keep_their_graph():
    x = torch.randn(4, 7, requires_grad=True)
    w = torch.randn(3, 7)
    gemmtune.linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, 7))


@pytest.mark.interpreter
def test_tune_stores_and_reuses(tmp_path):
    problem = Problem(7, 40, 100, "float32", "nn")
    first = gemmtune.tune(problem, store=tmp_path)
    assert len(first) == 1 and not first[0].from_store
    again = gemmtune.tune([problem], store=tmp_path)
    assert again[0].from_store and again[0].backend == first[0].backend and again[0].config == first[0].config
    retuned = gemmtune.tune([problem], store=tmp_path, retune=True)
    assert not retuned[0].from_store


@pytest.mark.interpreter
def test_a_shape_with_another_epilogue_tries_the_first_ones_best(tmp_path):
    """The seeds' MLP has one shape twice, with bias + ReLU and with bias alone: the second tries
    the first's fastest candidates and what no cost model ranks (cuBLAS's), nothing else, and is
    verified like any other."""
    from followers import measured_whole

    from gemmtune.device import current
    from gemmtune.tuning.tuner import SHORTLIST, TuneOptions, follower_plan, labels

    relu = Problem(33, 40, 72, "float32", "linear", bias=True, activation="relu")
    plain = Problem(33, 40, 72, "float32", "linear", bias=True)
    first, second = gemmtune.tune([relu, plain], store=tmp_path)
    # On a GPU the second compiled its best-predicted candidates beside the first, and tries the
    # first's fastest among those (api.tune); under the interpreter nothing compiles ahead
    device = current()
    among = None if device.interpreter else labels(follower_plan(plain, device, TuneOptions()))
    ranked = sorted((t for t in first.trials if t.ok and t.backend != "cublas"
                     and (among is None or t.label() in among)), key=lambda t: t.median_ms)
    inherited = {t.label() for t in ranked[:SHORTLIST]}
    tried = {t.label() for t in second.trials}
    assert tried == inherited | measured_whole(plain, device) and len(first.trials) > len(second.trials)
    assert all(t.ok for t in second.trials)
    alone = gemmtune.tune([plain], store=tmp_path / "alone")[0]  # tuned by itself: its whole plan
    assert len(alone.trials) == len(first.trials)


@pytest.mark.parametrize("act, fn", [("relu", torch.relu), ("gelu", F.gelu), ("silu", F.silu),
                                     ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
def test_linear_activation_fallback_matches_torch_and_keeps_autograd(act, fn):
    x = torch.randn(4, 7, requires_grad=True)
    w, bias = torch.randn(3, 7), torch.randn(3)
    out = gemmtune.linear(x, w, bias, activation=act)
    torch.testing.assert_close(out, fn(F.linear(x, w, bias)))
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_linear_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation='tanh' is not supported; accepted: None, relu"):
        gemmtune.linear(torch.ones(2, 3), torch.ones(4, 3), activation="tanh")


class CountingKernel(KernelBase):
    def __init__(self):
        self.calls = 0
        self.ranks = []

    def __call__(self, a, b, bias):
        self.calls += 1
        self.ranks.append(a.dim())
        return F.linear(a, b, bias)


class BindingKernel(CountingKernel):
    """A kernel whose ``bind`` returns a launch taking the operands' addresses."""

    serves_any_rank = True

    def __init__(self):
        super().__init__()
        self.launches = []

    def bind(self, a, b, bias):
        def launch(a, b, bias, pa, pb, pbias):
            self.launches.append((pa, pb))
            return F.linear(a, b, bias)

        return launch


def test_a_served_call_takes_the_front_path_and_a_different_one_is_checked_again(monkeypatch):
    """Served from the dispatcher once, the same call skips the checks; a call that differs in
    any operand's shape, dtype or device, or in the bias, goes through them (and errors)."""
    from gemmtune.serving.dispatch import DISPATCHER

    monkeypatch.setattr(calls, "falls_back", lambda first, n: False)  # CPU tensors served as if on a GPU
    monkeypatch.setattr(DISPATCHER, "kernels", {})
    monkeypatch.setattr(DISPATCHER, "front", {})
    x, w, bias = torch.randn(5, 8), torch.randn(3, 8), torch.randn(3)
    kernel = CountingKernel()
    DISPATCHER.kernels[calls.dispatch_key("linear", x, bias, 5, 3, 8, "relu")] = kernel
    with torch.no_grad():
        first = gemmtune.linear(x, w, bias, activation="relu")
        assert len(DISPATCHER.front) == 1
        again = gemmtune.linear(x, w, bias, activation="relu")
        assert kernel.calls == 2 and torch.equal(first, again)
        with pytest.raises(TypeError, match="bias has dtype"):
            gemmtune.linear(x, w, bias.double(), activation="relu")
        with pytest.raises(ValueError, match="last dimension"):
            gemmtune.linear(torch.randn(5, 9), w, bias, activation="relu")
        with pytest.raises(ValueError, match="activation='tanh'"):
            gemmtune.linear(x, w, bias, activation="tanh")
        with pytest.raises(ValueError, match=r"activation=\['relu'\]"):  # unhashable: no front-path key
            gemmtune.linear(x, w, bias, activation=["relu"])
        # a model's 3-D activations: served as (B*T, K) by the same kernel, from the front path
        x3 = torch.randn(2, 3, 8)
        DISPATCHER.kernels[calls.dispatch_key("linear", x3, bias, 6, 3, 8, "none")] = kernel
        outs = [gemmtune.linear(x3, w, bias) for _ in range(2)]
        assert len(DISPATCHER.front) == 2 and kernel.calls == 4 and kernel.ranks == [2, 2, 2, 2]
        assert outs[1].shape == (2, 3, 3) and torch.allclose(outs[1], F.linear(x3, w, bias), atol=1e-6)
        # a kernel that serves any rank gets the 3-D x itself from the front path: no views made
        any_rank = CountingKernel()
        any_rank.serves_any_rank = True
        x4 = torch.randn(2, 2, 8)
        DISPATCHER.kernels[calls.dispatch_key("linear", x4, bias, 4, 3, 8, "none")] = any_rank
        outs = [gemmtune.linear(x4, w, bias) for _ in range(2)]
        assert any_rank.ranks == [3, 3] and torch.allclose(outs[1], F.linear(x4, w, bias), atol=1e-6)
        # a kernel that binds its launch to a call's operands gets later calls' addresses
        bound = BindingKernel()
        DISPATCHER.kernels[calls.dispatch_key("linear", x, None, 5, 3, 8, "none")] = bound
        # (the first call through the wrapper, which binds; the next launches with its own
        # addresses; a view of other strides is a new key, served by the wrapper and bound in turn)
        operands = [torch.randn(5, 8), torch.randn(5, 8), torch.randn(5, 9)[:, 1:], torch.randn(5, 8)]
        for operand in operands:
            assert torch.allclose(gemmtune.linear(operand, w), F.linear(operand, w), atol=1e-6)
        assert bound.calls == 2
        assert bound.launches == [(operands[i].data_ptr(), w.data_ptr()) for i in (1, 3)]
        # an operand 16-byte aligned differently is a new key too: its launch is never bound
        # to the alignment of another call (Triton specializes on it)
        storage = torch.randn(41)
        shifted = storage[1:].view(5, 8)  # 4 bytes past the storage's aligned start
        assert torch.allclose(gemmtune.linear(shifted, w), F.linear(shifted, w), atol=1e-6)
        assert bound.calls == 3
    DISPATCHER.forget()
    assert DISPATCHER.front == {}
