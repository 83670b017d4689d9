"""A new user's first commands, as a user runs them (a fresh process, an empty store, Python's
default warning filters): ``gemmtune doctor`` then ``gemmtune tune`` print no warning that
gemmtune caused. On a CPU-only machine the tune goes through Triton's interpreter; on the GPU
machine the same test tunes on the GPU, where torch's synchronization-debug warning once showed."""

import os
import subprocess
import sys

import pytest


def command(*argv, store):
    env = {name: value for name, value in os.environ.items() if name != "PYTHONWARNINGS"}
    env |= {"PYTHONPATH": os.pathsep.join(sys.path), "GEMMTUNE_CACHE_DIR": str(store)}
    return subprocess.run([sys.executable, "-m", "gemmtune", *argv], capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.mark.interpreter
def test_doctor_then_tune_print_no_warning(tmp_path):
    store = tmp_path / "fresh"
    for argv in (["doctor"], ["tune", "--shape", "7x33x40"]):
        done = command(*argv, store=store)
        assert done.returncode == 0, (argv, done.stderr)
        printed = done.stdout + done.stderr
        assert "Warning" not in printed and "warning:" not in printed.lower(), (argv, printed)
    assert (store / "gemmtune.sqlite").exists() or any(store.iterdir())
