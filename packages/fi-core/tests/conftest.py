import pytest

from fi_core import knobs


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty kernel cache for one test."""
    d = tmp_path / "fi-cache"
    monkeypatch.setenv("FI_CACHE_DIR", str(d))
    knobs.refresh()
    yield d
    monkeypatch.undo()
    knobs.refresh()
