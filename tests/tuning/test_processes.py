"""gemmtune's child processes never re-run the user's script, even one without a main guard."""

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = """
import sys
sys.path.insert(0, {src!r})
with open({mark!r}, "a") as f:  # what a training script without a main guard would redo
    f.write("x")
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning.worker import IsolatedRunner

with IsolatedRunner(current()) as runner:
    runner.start(Problem(4, 4, 4, "float32"), 0)
    trial = runner.evaluate("cublas", {{}}, 5.0)
print(trial.status.value, runner.restarts, __file__ == {script!r})
"""


def test_children_do_not_import_the_main_script(tmp_path):
    mark, script = tmp_path / "runs", tmp_path / "train.py"
    script.write_text(SCRIPT.format(src=str(SRC), mark=str(mark), script=str(script)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ok", "0", "True"]  # and the script's own __file__ is back
    assert mark.read_text() == "x"
