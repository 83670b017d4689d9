"""Both runners the tuner is handed meet the one ``Runner`` Protocol: every method it declares,
with its parameters, in this process and in the isolated worker alike."""

import inspect

import pytest

from gemmtune.device import Device
from gemmtune.tuning.runner import LocalRunner, Runner
from gemmtune.tuning.worker import IsolatedRunner

CPU = Device("cpu", (0, 0), 1, 0, 0, interpreter=True)
METHODS = ("start", "compile", "evaluate", "evaluate_many", "final")


@pytest.mark.parametrize("make", [LocalRunner, IsolatedRunner])  # the worker spawns on its first call only
def test_each_runner_is_a_runner_with_the_protocols_signatures(make):
    runner = make(CPU)
    assert isinstance(runner, Runner)
    assert {name for name in dir(Runner) if name in METHODS} == set(METHODS)
    for name in METHODS:
        declared = list(inspect.signature(getattr(Runner, name)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(runner, name)).parameters) == declared, name
