import pytest

from gemmtune import settings


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GEMMTUNE_CACHE_DIR", str(tmp_path / "x"))
    assert settings.cache_dir() == tmp_path / "x"


def test_default_cache_dir_is_per_user(monkeypatch):
    monkeypatch.delenv("GEMMTUNE_CACHE_DIR")
    assert "gemmtune" in str(settings.cache_dir())


def test_mode_is_validated(monkeypatch):
    monkeypatch.setenv("GEMMTUNE_MODE", "LOOKUP")
    assert settings.mode() == "lookup"
    monkeypatch.setenv("GEMMTUNE_MODE", "fast")
    with pytest.raises(ValueError, match="GEMMTUNE_MODE='fast' is not a mode; accepted: tune, lookup"):
        settings.mode()


@pytest.mark.parametrize("given, expected", [
    ("team.db", "team.db"),  # a file not made yet: its suffix says so
    ("stores", "stores/gemmtune.sqlite"),  # a directory not made yet
    ("a-dir.d", "a-dir.d/gemmtune.sqlite"),  # an existing directory, whatever its name
    ("plainfile", "plainfile"),  # an existing file, whatever its name
])
def test_one_store_path_for_every_command(tmp_path, given, expected):
    (tmp_path / "a-dir.d").mkdir()
    (tmp_path / "plainfile").write_bytes(b"")
    assert settings.store_file(tmp_path / given) == tmp_path / expected
    assert settings.store_file(None) == settings.cache_dir() / settings.STORE_FILENAME
