"""A served call whose operands lie on another GPU than the current one (a model split over GPUs):
its kernel runs with their GPU current, through the slow path and the front path's entry, and the
caller's current GPU is back after each. The CPU has no second GPU: the operands here say they
are on GPU 1 (``get_device``), and the current GPU is a fake that ``torch.cuda.device`` moves;
``tests/test_two_gpus.py`` runs the real thing on two GPUs."""

import pytest
import torch
import torch.nn.functional as F

from gemmtune.backends.base import function_kernel
from gemmtune.serving import calls
from gemmtune.serving.dispatch import DISPATCHER


class OnGpu1(torch.Tensor):
    def get_device(self):
        return 1


@pytest.fixture
def gpus(monkeypatch):
    """The current GPU (0 at first), moved by a stand-in for ``torch.cuda.device``."""
    state = {"current": 0}

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.before, state["current"] = state["current"], self.index

        def __exit__(self, *exc):
            state["current"] = self.before

    monkeypatch.setattr(calls, "current_gpu", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", Device)
    yield state
    DISPATCHER.forget()


def test_a_call_on_another_gpu_runs_its_kernel_with_that_gpu_current(gpus):
    ran_on = []

    def kernel(a, b, bias, out=None):
        ran_on.append(gpus["current"])
        return F.linear(a, b, bias)

    x = torch.randn(2, 3, 8).as_subclass(OnGpu1)
    w, bias = torch.randn(5, 8).as_subclass(OnGpu1), torch.randn(5).as_subclass(OnGpu1)
    DISPATCHER.kernels[calls.dispatch_key("linear", x, bias, 6, 5, 8, "none")] = function_kernel(
        kernel, serves_any_rank=True)
    front = ("a front-path key",)
    out = calls.run("linear", x, w, bias, 6, 5, 8, "none", front=front)
    assert ran_on == [1] and gpus["current"] == 0
    again = DISPATCHER.front[front](x, w, bias, x.data_ptr(), w.data_ptr(), bias.data_ptr())
    assert ran_on == [1, 1] and gpus["current"] == 0
    for result in (out, again):
        torch.testing.assert_close(result.as_subclass(torch.Tensor), F.linear(x, w, bias).as_subclass(torch.Tensor))


def test_a_call_on_the_current_gpu_switches_nothing(gpus, monkeypatch):
    def no_switch(index):
        raise AssertionError(f"switched to GPU {index}")

    monkeypatch.setattr(torch.cuda, "device", no_switch)
    gpus["current"] = 1
    x, w = torch.randn(4, 8).as_subclass(OnGpu1), torch.randn(5, 8).as_subclass(OnGpu1)
    DISPATCHER.kernels[calls.dispatch_key("linear", x, None, 4, 5, 8, "none")] = function_kernel(
        lambda a, b, bias, out=None: F.linear(a, b, bias), serves_any_rank=True)
    calls.run("linear", x, w, None, 4, 5, 8, "none", front=("key",))
    DISPATCHER.front[("key",)](x, w, None, x.data_ptr(), w.data_ptr(), 0)


def test_the_front_path_key_holds_the_current_gpu_of_a_gpu_operand(gpus):
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    cpu_key = calls.front_key(x, w, None, None, 0, 0, 0)
    gpu_x = x.as_subclass(OnGpu1)
    on_0 = calls.front_key(gpu_x, w, None, None, 0, 0, 0)
    gpus["current"] = 1
    assert calls.front_key(gpu_x, w, None, None, 0, 0, 0) != on_0
    assert calls.front_key(x, w, None, None, 0, 0, 0) == cpu_key  # a CPU operand asks for no GPU
