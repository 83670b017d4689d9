"""The GPU's cluster occupancy kept across processes for QuACK's query (backends/cluster_occupancy):
a second process takes the stored count without asking, every other device asks again, and a
stored count that cannot be the device's is never used."""

import json
import sys
import types

import pytest

from gemmtune.backends import cluster_occupancy, cute
from gemmtune.device import Device

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 * 2**20)
UNDER_MPS = Device("NVIDIA H100 80GB HBM3", (9, 0), 38, 232448, 50 * 2**20)


class Query:
    """QuACK's query as a fake: how many clusters of a size fit (SMs over the size), counted."""

    def __init__(self):
        self.asked = []

    def __call__(self, cluster_size, device_capacity=None, device_id=0):
        self.asked.append((cluster_size, device_capacity, device_id))
        return devices[device_id].sm_count // cluster_size


devices = {0: H100, 1: UNDER_MPS}


def process(query, memo):
    """The query as a new process sees it: nothing answered in memory yet."""
    return cluster_occupancy.kept_query(query, memo, devices.__getitem__)


def test_a_second_process_takes_the_stored_count_without_asking(tmp_path):
    memo, query = tmp_path / "occupancy.json", Query()
    assert process(query, memo)(2) == 66
    assert process(query, memo)(2) == 66
    assert len(query.asked) == 1


def test_both_ways_quack_asks_share_one_answer(tmp_path):
    """QuACK's entry points ask with and without the capability: one query for both."""
    query = Query()
    kept = process(query, tmp_path / "occupancy.json")
    assert kept(2) == kept(2, device_capacity=(9, 0)) == 66
    assert query.asked == [(2, (9, 0), 0)]


def test_each_device_cluster_size_and_capability_is_asked_for_itself(tmp_path):
    memo, query = tmp_path / "occupancy.json", Query()
    kept = process(query, memo)
    assert (kept(1), kept(2), kept(2, device_id=1), kept(2, device_capacity=(10, 0))) == (132, 66, 19, 66)
    assert len(query.asked) == 4
    assert len(json.loads(memo.read_text())) == 4
    assert process(Query(), memo)(2, device_id=1) == 19


@pytest.mark.parametrize("stored", [0, -1, 133, 1.5, True, "66", None, [66]])
def test_a_stored_count_that_cannot_be_the_devices_is_asked_again(tmp_path, stored):
    memo, query = tmp_path / "occupancy.json", Query()
    process(Query(), memo)(2)
    key, = json.loads(memo.read_text())
    memo.write_text(json.dumps({key: stored}))
    assert process(query, memo)(2) == 66
    assert len(query.asked) == 1
    assert json.loads(memo.read_text()) == {key: 66}


@pytest.mark.parametrize("content", ["", "{", "[1, 2]", "null"])
def test_a_file_that_cannot_be_read_is_asked_again_and_replaced(tmp_path, content):
    memo, query = tmp_path / "occupancy.json", Query()
    memo.write_text(content)
    assert process(query, memo)(4) == 33
    assert len(query.asked) == 1
    assert list(json.loads(memo.read_text()).values()) == [33]


def test_a_cache_directory_that_cannot_be_written_still_answers(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a folder")
    query = Query()
    assert process(query, blocked / "occupancy.json")(2) == 66
    assert process(query, blocked / "occupancy.json")(2) == 66
    assert len(query.asked) == 2


@pytest.fixture
def quack(monkeypatch):
    """QuACK's three modules that bind the query, as fakes; a fourth name bound to another function."""
    query = Query()
    names = [*cluster_occupancy.QUACK_MODULES]
    fakes = {name: types.ModuleType(name) for name in names}
    for fake in fakes.values():
        fake.get_max_active_clusters = query
    fakes[names[2]].get_max_active_clusters = lambda *args, **kwargs: 7  # rebound: left alone
    for name, fake in fakes.items():
        monkeypatch.setitem(sys.modules, name, fake)
    return fakes, query


def test_install_answers_quacks_query_from_the_file_in_each_module_that_binds_it(quack, monkeypatch, tmp_path):
    fakes, query = quack
    monkeypatch.setenv("GEMMTUNE_CACHE_DIR", str(tmp_path))
    cluster_occupancy.install(devices.__getitem__)
    utils, gemm, host = (fakes[name] for name in cluster_occupancy.QUACK_MODULES)
    assert utils.get_max_active_clusters is gemm.get_max_active_clusters is not query
    assert host.get_max_active_clusters(2) == 7
    assert gemm.get_max_active_clusters(2, device_capacity=(9, 0)) == 66
    assert (tmp_path / cluster_occupancy.MEMO_FILENAME).is_file()
    installed = utils.get_max_active_clusters
    cluster_occupancy.install(devices.__getitem__)  # once a process: not wrapped again
    assert utils.get_max_active_clusters is installed


def test_without_quack_install_changes_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, cluster_occupancy.QUACK_MODULES[0], None)  # import fails
    cluster_occupancy.install(devices.__getitem__)


@pytest.mark.gpu
@pytest.mark.skipif(not cute.installed(), reason="needs gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
def test_the_installed_quack_binds_the_query_where_install_answers_it():
    """Fails where a QuACK release moves the query: its first call in a process would ask again."""
    cute._quack()
    for name in cluster_occupancy.QUACK_MODULES:
        bound = getattr(sys.modules[name], cluster_occupancy.QUERY)
        assert getattr(bound, "gemmtune_memo", False), name
