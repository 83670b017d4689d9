"""gemmtune's kernels on two GPUs of one process. The fleet benchmark's crosscheck, which tuned on
GPU 0 and then timed the same choices on GPU 1 in one process, stopped on an illegal memory
access (docs/tuning-time.md). Per backend, in a child process of its own with
CUDA_LAUNCH_BLOCKING=1 (a fault poisons the process's CUDA context, and the failure must name
its backend): two candidates of each product built, run, checked against float64 and timed in
final rounds as the tuner's on GPU 0, then the same on GPU 1; and a layer on GPU 1 served while
GPU 0 is the current one (a model split over GPUs), through the slow path and the front path.
Needs two GPUs."""

import json
import os
import subprocess
import sys

import pytest
import torch

BACKENDS = ("cublas", "cublaslt", "triton_tiled", "triton_splitk", "triton_stream", "triton_persistent")
PRODUCTS = ("16x1024x1024", "256x1024x1024")  # decode's kernels (split-K, the stream) and the tiles'

CHILD = """
import json, sys
import torch
from gemmtune import backends
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning import verify
from gemmtune.tuning.runner import LocalRunner
from gemmtune.tuning.tuner import MIN_ROUNDS_FINAL

name, answer, products = sys.argv[1], sys.argv[2], sys.argv[3:]
backend = backends.get(name)
checked = timed = 0
for text in products:
    problem = Problem(*(int(v) for v in text.split("x")))
    for gpu in (0, 1):
        torch.cuda.set_device(gpu)
        device = current(gpu)
        if not backend.is_available(device):
            continue
        configs = [c.as_dict() for c in backend.candidates(problem, device)[:2]]
        inputs = verify.make_inputs(problem, "cuda", seed=gpu)
        for config in configs:
            verdict = verify.check(backends.build(problem, name, config, device), problem, inputs)
            assert verdict.ok, (text, gpu, config, verdict.reason())
            checked += 1
        if configs:  # timed as the tuner's final rounds time them, on GPU 0, then on GPU 1
            runner = LocalRunner(device)
            runner.start(problem, seed=0)
            final = runner.final([("cublas", {}), *((name, c) for c in configs)], 20.0, MIN_ROUNDS_FINAL)
            torch.cuda.synchronize()
            timed += len(final)
assert timed or not checked, "nothing was timed"
with open(answer, "w") as f:  # the answer in a file: a library may write to stdout
    json.dump({"checked": checked}, f)
"""


OFF_DEVICE = """
import json, sys
import torch
from gemmtune import api, backends
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.serving.calls import dispatch_key
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.tuning import verify

name, answer, products = sys.argv[1], sys.argv[2], sys.argv[3:]
backend, checked = backends.get(name), 0
for text in products:
    m, n, k = (int(v) for v in text.split("x"))
    problem = Problem(m, n, k, bias=True)
    torch.cuda.set_device(1)
    configs = backend.candidates(problem, current(1)) if backend.is_available(current(1)) else []
    if not configs:
        continue
    kernel = backends.build(problem, name, configs[0].as_dict(), current(1))
    x = torch.randn(2, m // 2, k, device="cuda:1", dtype=torch.bfloat16)  # a model's (batch, tokens, K)
    w = torch.randn(n, k, device="cuda:1", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda:1", dtype=torch.bfloat16)
    kernel(x.view(m, k), w, bias)  # its binary made on GPU 1
    DISPATCHER.forget()
    DISPATCHER.kernels[dispatch_key("linear", x, bias, m, n, k, "none")] = kernel
    torch.cuda.set_device(0)
    expected = verify.reference(problem, x.view(m, k), w, bias)
    for _ in range(3):  # the slow path, then the front path's entry
        out = api.linear(x, w, bias)
        torch.cuda.synchronize(1)
        assert torch.cuda.current_device() == 0, "the current GPU changed"
        assert verify.rel_err(out.view(m, n), expected) <= verify.tolerance(problem), (text, name)
        checked += 1
with open(answer, "w") as f:
    json.dump({"checked": checked}, f)
"""


SCRIPTS = {"serves_and_times": CHILD, "a_layer_on_another_gpu": OFF_DEVICE}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_process_serves_on_two_gpus(backend, script, tmp_path):
    """``script`` for ``backend`` over PRODUCTS in a child process with blocking launches: a
    failure names its backend with the child's last words."""
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    env.pop("TRITON_INTERPRET", None)
    answer = tmp_path / "answer.json"
    done = subprocess.run([sys.executable, "-c", SCRIPTS[script], backend, str(answer), *PRODUCTS], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    if json.loads(answer.read_text())["checked"] == 0:
        pytest.skip(f"{backend} has no candidate for these products on this GPU")
