"""QuACK's source fingerprint kept across processes (backends/quack_source_key): the stored one is
taken only where every file QuACK hashes and every version it mixes in are as they were, and it
is the fingerprint QuACK computes."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import gemmtune
from gemmtune.backends import cute, quack_source_key

from .test_triton_key import Counting  # a computed answer, counted: key-1, key-2, ...

VERSIONS = ("py3.12", "cutlass=4.8.1", "tvm_ffi=0.1.6")


@pytest.fixture
def package(tmp_path):
    """A stand-in for QuACK's package: Python files in nested folders, and a file it does not hash."""
    root = tmp_path / "quack"
    for name in ("__init__.py", "gemm.py", "cache/jit.py", "epilogue/library.py", "README.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    return root


def process(compute, roots, tmp_path, versions=VERSIONS):
    """The fingerprint as a new process sees it: nothing answered in memory yet."""
    return quack_source_key.memoized(compute, lambda: roots, versions, tmp_path / "memo" / "key.json")


def test_a_new_process_takes_the_stored_fingerprint_without_computing_it(package, tmp_path):
    compute = Counting()
    assert process(compute, [package], tmp_path)() == "key-1"
    assert process(compute, [package], tmp_path)() == "key-1"
    assert compute.calls == 1


@pytest.mark.parametrize("changed", ["__init__.py", "cache/jit.py", "epilogue/library.py", "epilogue/new.py",
                                     "new_folder/module.py"])
def test_any_change_to_a_hashed_file_computes_it_again(package, tmp_path, changed):
    compute = Counting()
    process(compute, [package], tmp_path)()
    path = package / changed
    path.parent.mkdir(exist_ok=True)
    path.write_text("changed, one byte longer" if path.exists() else "new")
    os.utime(path, ns=(1, 1))  # an older time than the first: only the size and the time say so
    assert process(compute, [package], tmp_path)() == "key-2"
    assert process(compute, [package], tmp_path)() == "key-2"


def test_a_file_quack_does_not_hash_changes_nothing(package, tmp_path):
    compute = Counting()
    process(compute, [package], tmp_path)()
    (package / "README.md").write_text("a longer readme than before")
    assert process(compute, [package], tmp_path)() == "key-1"


@pytest.mark.parametrize("versions", [("py3.13", *VERSIONS[1:]), (VERSIONS[0], "cutlass=4.9.0", VERSIONS[2])])
def test_another_version_computes_it_again(package, tmp_path, versions):
    compute = Counting()
    process(compute, [package], tmp_path)()
    assert process(compute, [package], tmp_path, versions)() == "key-2"


def test_an_extra_source_folder_computes_it_again_even_empty(package, tmp_path):
    compute = Counting()
    process(compute, [package], tmp_path)()
    extra = tmp_path / "extra"
    extra.mkdir()
    assert process(compute, [package, extra], tmp_path)() == "key-2"


@pytest.mark.parametrize("content", ["not json", json.dumps(["a list"]), json.dumps({"stamp": 1, "key": 2}), ""])
def test_a_memo_file_that_cannot_be_read_is_computed_again_and_replaced(package, tmp_path, content):
    compute = Counting()
    process(compute, [package], tmp_path)()
    memo = tmp_path / "memo" / "key.json"
    memo.write_text(content)
    assert process(compute, [package], tmp_path)() == "key-2"
    assert json.loads(memo.read_text())["key"] == "key-2"


def test_a_memo_that_cannot_be_written_still_answers_once_a_process(package, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the memo's folder would be")
    compute = Counting()
    kept = quack_source_key.memoized(compute, lambda: [package], VERSIONS, blocked / "key.json")
    assert kept() == kept() == "key-1"
    assert compute.calls == 1


def test_a_file_gone_while_stamping_computes_without_keeping(package, tmp_path, monkeypatch):
    """A source file listed and then removed before its stat (an upgrade under way): QuACK's own
    fingerprint answers, and nothing is kept under a stamp that could not be taken."""
    compute = Counting()
    listed = quack_source_key.python_files([package])
    (package / "gemm.py").unlink()
    monkeypatch.setattr(quack_source_key, "python_files", lambda roots: listed)
    assert process(compute, [package], tmp_path)() == "key-1"
    assert not (tmp_path / "memo" / "key.json").exists()


@pytest.fixture
def quack(monkeypatch, package):
    """QuACK's package, its cache package and the module that computes the fingerprint, as fakes."""
    compute = Counting()
    top, state, jit = (types.ModuleType(name) for name in ("quack", "quack.cache", "quack.cache.jit"))
    top.__file__ = str(package / "__init__.py")
    state.EXTRA_SOURCE_DIRS = []
    jit._compute_source_fingerprint = compute
    jit.cutlass, jit.tvm_ffi = types.SimpleNamespace(__version__="4.8.1"), types.SimpleNamespace(__version__="0.1.6")
    top.cache, state.jit = state, jit
    for module in (top, state, jit):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return jit, compute


def test_install_makes_quack_take_the_kept_fingerprint(quack, monkeypatch, tmp_path):
    jit, compute = quack
    monkeypatch.setenv("GEMMTUNE_CACHE_DIR", str(tmp_path))
    quack_source_key.install()
    installed = jit._compute_source_fingerprint
    assert installed is not compute and installed() == "key-1"
    assert json.loads((tmp_path / quack_source_key.MEMO_FILENAME).read_text())["key"] == "key-1"
    quack_source_key.install()  # once a process: not wrapped again
    assert jit._compute_source_fingerprint is installed


@pytest.mark.parametrize("moved", ["cutlass", "tvm_ffi", "EXTRA_SOURCE_DIRS"])
def test_a_quack_laid_out_otherwise_is_left_as_it_is(quack, monkeypatch, tmp_path, moved):
    """Where what the stamp reads is not where quack-kernels 0.6.5 has it, QuACK hashes as before."""
    jit, compute = quack
    monkeypatch.setenv("GEMMTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.delattr(sys.modules["quack.cache"] if moved == "EXTRA_SOURCE_DIRS" else jit, moved)
    quack_source_key.install()
    assert jit._compute_source_fingerprint is compute


def test_without_quack_install_changes_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "quack", None)  # import fails
    quack_source_key.install()


FRESH = """
import sys
from pathlib import Path
import quack.cache.jit as jit
if sys.argv[1] == "kept":
    from gemmtune.backends import quack_source_key
    quack_source_key.install()
    assert jit._compute_source_fingerprint.gemmtune_memo
Path(sys.argv[2]).write_text(jit._compute_source_fingerprint())
"""


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
def test_the_installed_quack_takes_the_kept_fingerprint_and_it_is_quacks(tmp_path):
    """Fresh processes: QuACK's own fingerprint, then one that computes and keeps it, then one that
    reads it, all the same. Fails where a QuACK release moves or renames the function."""
    env = {**os.environ, "GEMMTUNE_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(gemmtune.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH"))))}
    fingerprints = []
    for i, how in enumerate(("quack", "kept", "kept")):
        answer = tmp_path / f"fingerprint-{i}.txt"
        done = subprocess.run([sys.executable, "-c", FRESH, how, str(answer)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        fingerprints.append(answer.read_text())
    assert len(set(fingerprints)) == 1 and len(fingerprints[0]) == 64
    assert json.loads((tmp_path / quack_source_key.MEMO_FILENAME).read_text())["key"] == fingerprints[0]
