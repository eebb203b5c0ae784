import os

import pytest

from fi_core import knobs


def test_bool_and_int_knobs():
    with knobs.override(FI_LOG_DISPATCH="yes", FI_MAX_JOBS="3"):
        assert knobs.log_dispatch() is True and knobs.max_jobs() == 3
    with knobs.override(FI_LOG_DISPATCH="0", FI_MAX_JOBS=None):
        assert knobs.log_dispatch() is False and knobs.max_jobs() is None



def test_auto_bool_knob():
    """auto-bool knobs (FI_FA3_MULTICAST): None for auto (also the default and an empty value),
    else a bool; anything else is an error naming the variable and the accepted words."""
    for raw, want in ((None, None), ("", None), ("AUTO", None), ("on", True), ("1", True), ("off", False),
                      ("0", False)):
        with knobs.override(FI_FA3_MULTICAST=raw):
            assert knobs.fa3_multicast() is want, raw
    with knobs.override(FI_FA3_MULTICAST="2"):
        with pytest.raises(ValueError, match="FI_FA3_MULTICAST must be one of auto/1/0"):
            knobs.fa3_multicast()

def test_bad_values_name_the_variable():
    with knobs.override(FI_CHECK_INPUTS="maybe"):
        with pytest.raises(ValueError, match="FI_CHECK_INPUTS"):
            knobs.check_inputs()
    with knobs.override(FI_MAX_JOBS="many"):
        with pytest.raises(ValueError, match="FI_MAX_JOBS must be an integer"):
            knobs.max_jobs()


def test_override_restores_and_rejects_unknown():
    before = os.environ.get("FI_CACHE_DIR")
    with knobs.override(FI_CACHE_DIR="/tmp/x-fi"):
        assert str(knobs.cache_dir()) == "/tmp/x-fi"
    assert os.environ.get("FI_CACHE_DIR") == before
    with pytest.raises(KeyError, match="unknown knob"):
        with knobs.override(FI_NOT_A_KNOB="1"):
            pass


def test_every_knob_is_documented():
    for name, _value, doc in knobs.describe():
        assert name.isupper() and len(doc) > 20, name


def test_no_other_module_reads_environ():
    """Knobs are the only reader of configuration from the environment."""
    import pathlib
    import re

    root = pathlib.Path(knobs.__file__).resolve().parents[3]  # packages/
    offenders = []
    for f in root.glob("*/src/**/*.py"):
        if f.name == "knobs.py":
            continue
        text = f.read_text()
        if re.search(r"os\.environ(\.get|\[)|os\.getenv", text):
            offenders.append(str(f.relative_to(root)))
    assert not offenders, f"read os.environ outside knobs.py: {offenders}"


def test_values_are_cached_until_override_or_refresh(monkeypatch):
    monkeypatch.delenv("FI_LOG_DISPATCH", raising=False)
    knobs.refresh()
    assert knobs.log_dispatch() is False
    monkeypatch.setenv("FI_LOG_DISPATCH", "1")
    assert knobs.log_dispatch() is False  # cached: direct environ edits need refresh()
    knobs.refresh()
    assert knobs.log_dispatch() is True
    monkeypatch.delenv("FI_LOG_DISPATCH")
    knobs.refresh()


def test_fa3_ctas_values():
    with knobs.override(FI_FA3_CTAS=None):
        assert knobs.fa3_ctas() == 0
    with knobs.override(FI_FA3_CTAS="all"):
        assert knobs.fa3_ctas() == -1
    with knobs.override(FI_FA3_CTAS="3"):
        assert knobs.fa3_ctas() == 3
    with knobs.override(FI_FA3_CTAS="0"):
        with pytest.raises(ValueError, match="FI_FA3_CTAS must be 'all' or a positive integer"):
            knobs.fa3_ctas()
