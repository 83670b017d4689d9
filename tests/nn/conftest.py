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
