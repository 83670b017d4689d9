"""Runners that end their worker on purpose, for tests/tuning/test_spread.py: at a module's top
level so that the spawned workers import them by name. The first worker to start the problem with
M = 7 ends itself (a flag file, named by the test, marks that it happened); with M = 9 every one
does."""

import os

from gemmtune.tuning.runner import LocalRunner


class DiesOnce(LocalRunner):
    def start(self, problem, seed):
        flag = os.environ["GEMMTUNE_SPREAD_FLAG"]
        if problem.m == 7 and not os.path.exists(flag):
            open(flag, "w").close()
            os._exit(7)
        super().start(problem, seed)


class AlwaysDies(LocalRunner):
    def start(self, problem, seed):
        if problem.m == 9:
            os._exit(9)
        super().start(problem, seed)


class CountsRunners(LocalRunner):
    """Leaves a file for each runner made, in the folder GEMMTUNE_SPREAD_FLAG names plus ".runners"."""

    def __init__(self, device):
        super().__init__(device)
        folder = os.environ["GEMMTUNE_SPREAD_FLAG"] + ".runners"
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, f"{os.getpid()}-{id(self)}"), "w").close()
