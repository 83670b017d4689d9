"""Triton's cache key kept across processes: the stored key is taken only where every file
Triton hashes is as it was, and it is the key Triton computes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gemmtune
from gemmtune.backends import triton_key


@pytest.fixture
def package(tmp_path):
    """A stand-in for Triton's package: its hashed folders, libtriton and its cache module."""
    root = tmp_path / "triton"
    for folder in ("compiler", "backends/nvidia", "language", "_C", "runtime"):
        (root / folder).mkdir(parents=True)
    for name in ("compiler/code_generator.py", "backends/nvidia/compiler.py", "language/core.py",
                 "_C/libtriton.so", "runtime/cache.py"):
        (root / name).write_text(name)
    return root


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return f"key-{self.calls}"


def memo_of(package, tmp_path, compute):
    return triton_key.memoized(compute, package, package / "runtime/cache.py", tmp_path / "memo" / "key.json")


def test_a_new_process_takes_the_stored_key_without_computing_it(package, tmp_path):
    compute = Counting()
    assert memo_of(package, tmp_path, compute)() == "key-1"
    assert memo_of(package, tmp_path, compute)() == "key-1"  # another process: the file, not Triton's hash
    assert compute.calls == 1


@pytest.mark.parametrize("changed", ["compiler/code_generator.py", "backends/nvidia/compiler.py", "language/core.py",
                                     "_C/libtriton.so", "runtime/cache.py", "language/new_module.py"])
def test_any_change_to_a_hashed_file_computes_the_key_again(package, tmp_path, changed):
    compute = Counting()
    memo_of(package, tmp_path, compute)()
    path = package / changed
    path.write_text("changed, one byte longer" if path.exists() else "new")
    os.utime(path, ns=(1, 1))  # an older time than the first: only the size and the time say so
    assert memo_of(package, tmp_path, compute)() == "key-2"
    assert memo_of(package, tmp_path, compute)() == "key-2"


@pytest.mark.parametrize("content", ["not json", json.dumps(["a list"]), json.dumps({"stamp": 1, "key": 2}), ""])
def test_a_memo_file_that_cannot_be_read_is_computed_again(package, tmp_path, content):
    compute = Counting()
    memo_of(package, tmp_path, compute)()
    memo = tmp_path / "memo" / "key.json"
    memo.write_text(content)
    assert memo_of(package, tmp_path, compute)() == "key-2"
    assert json.loads(memo.read_text())["key"] == "key-2"


def test_a_memo_that_cannot_be_written_still_answers(package, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the memo's folder would be")
    compute = Counting()
    memo = triton_key.memoized(compute, package, package / "runtime/cache.py", blocked / "key.json")
    assert memo() == "key-1" and memo() == "key-1"  # once per process, as Triton's own
    assert not list(tmp_path.glob("**/*.tmp"))


FRESH = """
import sys, time
import triton.runtime.cache as cache
from gemmtune.backends import triton_key
triton_key.install()
t0 = time.perf_counter()
key = cache.triton_key()
print(time.perf_counter() - t0, file=sys.stderr)
print(key == cache.get_cache_key.__globals__["triton_key"]())
print(key)
"""


def test_triton_takes_the_kept_key_and_it_is_the_one_triton_computes(tmp_path):
    """Two fresh processes: the first computes and keeps the key, the second reads it; both equal
    what Triton's own triton_key computes (the process of this test)."""
    import triton.runtime.cache as cache

    expected = getattr(cache.triton_key, "__wrapped__", cache.triton_key)()
    env = {**os.environ, "GEMMTUNE_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(gemmtune.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH"))))}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", FRESH], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        same, key = done.stdout.splitlines()
        assert same == "True" and key == expected
    assert json.loads((tmp_path / triton_key.MEMO_FILENAME).read_text())["key"] == expected
