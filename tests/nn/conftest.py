import pytest
import torch

from gemmtune.nn import refused


@pytest.fixture(autouse=True)
def _cpu_models_taken_on_a_gpu_host(request, monkeypatch):
    """This folder's CPU tests build CPU models, which ``optimize`` leaves unchanged on a host with
    a GPU (``refused.on_the_cpu``: their calls would run torch's kernels). There they are taken
    over anyway, as on a CPU host, so the same assertions run on both; tests marked ``gpu`` or
    ``cpu_rule`` (the rule's own) see the rule."""
    if torch.cuda.is_available() and not any(request.node.get_closest_marker(m) for m in ("gpu", "cpu_rule")):
        monkeypatch.setattr(refused, "on_the_cpu", lambda model: False)


@pytest.fixture
def fake_tuning(monkeypatch):
    """optimize told of an H100 with its tuning faked: ``fake_tuning(backend_of)`` makes each
    problem's stored choice ``backend_of(problem)`` and returns the list the tuned problems go to."""
    from gemmtune import nn as gnn
    from gemmtune.device import Device
    from gemmtune.results import TuneResult

    def install(backend_of):
        tuned = []
        monkeypatch.setattr(gnn, "current", lambda: Device("H100", (9, 0), 132, 232448, 50 << 20))

        def tune(problems, options=None):
            tuned.extend(problems)
            return [TuneResult(p.key(), "fake-device", backend_of(p), {}, 1.0, 1.0, 0.1) for p in problems]

        monkeypatch.setattr(gnn.api, "tune", tune)
        return tuned

    return install


@pytest.fixture
def lean_calls(monkeypatch):
    """The dispatcher's lean serving recorded, not done: ('serve', problems) and ('drop', problems);
    the layers taken to lie on GPU 0."""
    from gemmtune.nn import keep
    from gemmtune.serving.dispatch import DISPATCHER

    calls = []
    monkeypatch.setattr(DISPATCHER, "serve_lean", lambda picks, index: calls.append(("serve", set(picks))))
    monkeypatch.setattr(DISPATCHER, "drop_lean", lambda problems, index: calls.append(("drop", set(problems))))
    monkeypatch.setattr(keep, "on_a_gpu", lambda forms: True)
    monkeypatch.setattr(keep, "device_index", lambda forms: 0)
    return calls
