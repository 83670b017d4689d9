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
