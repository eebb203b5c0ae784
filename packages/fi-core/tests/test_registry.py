import logging
import warnings

import pytest
import torch

from fi_core import knobs
from fi_core.arch import Arch
from fi_core import registry
from fi_core.errors import ReferenceFallbackWarning, UnsupportedError
from fi_core.registry import Backend, OpInfo, OPS, register_op, support_matrix


def needs_even(facts):
    return None if facts.get("head_dim", 0) % 2 == 0 else f"head_dim must be even, got {facts['head_dim']}"


OP = OpInfo("unit_op", family="fi-core", backends=(
    Backend("hopper", archs=("9.0a",), dtypes=(torch.bfloat16,)),
    Backend("portable", min_arch="8.0", dtypes=(torch.bfloat16, torch.float16), check=needs_even),
    Backend("reference", devices=("cpu", "cuda")),
))


@pytest.fixture
def on_arch(monkeypatch):
    def set_arch(text):
        import fi_core.arch as arch_mod

        monkeypatch.setattr(arch_mod, "arch_of", lambda device=None: Arch.parse(text))
    return set_arch


def test_cpu_goes_to_reference():
    assert OP.choose("cpu", torch.bfloat16).name == "reference"


def test_auto_picks_first_supported(on_arch, monkeypatch):
    monkeypatch.setattr(registry, "_fallbacks_warned", set())
    on_arch("9.0a")
    assert OP.choose("cuda", torch.bfloat16, head_dim=128).name == "hopper"
    assert OP.choose("cuda", torch.float16, head_dim=128).name == "portable"
    with pytest.warns(ReferenceFallbackWarning):
        assert OP.choose("cuda", torch.float16, head_dim=127).name == "reference"
    on_arch("8.6")
    assert OP.choose("cuda", torch.bfloat16, head_dim=64).name == "portable"
    on_arch("7.5")
    with pytest.warns(ReferenceFallbackWarning):
        assert OP.choose("cuda", torch.bfloat16, head_dim=64).name == "reference"


def test_reference_fallback_on_gpu_warns_once(on_arch, monkeypatch):
    monkeypatch.setattr(registry, "_fallbacks_warned", set())
    on_arch("9.0a")
    with pytest.warns(ReferenceFallbackWarning) as rec:
        assert OP.choose("cuda", torch.float16, head_dim=127).name == "reference"
    msg = str(rec[0].message)
    assert "unit_op: no kernel runs this call on cuda sm_90a" in msg
    assert "hopper: supports bfloat16, got float16" in msg and "portable: head_dim must be even, got 127" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert OP.choose("cuda", torch.float16, head_dim=127).name == "reference"  # once per reason
        assert OP.choose("cuda", torch.float16, head_dim=64).name == "portable"  # a kernel: no warning
        assert OP.choose("cpu", torch.float16, head_dim=127).name == "reference"  # the CPU backend
        assert OP.choose("cuda", torch.float16, requested="reference").name == "reference"  # asked for
    on_arch("7.5")
    with pytest.warns(ReferenceFallbackWarning, match="needs sm_80 or newer, GPU is sm_75"):
        OP.choose("cuda", torch.bfloat16, head_dim=64)


def test_impossible_explicit_backend_lists_reasons(on_arch):
    on_arch("8.0")
    with pytest.raises(UnsupportedError) as ei:
        OP.choose("cuda", torch.float32, requested="hopper")
    assert "needs sm_90a, GPU is sm_80" in str(ei.value)
    with pytest.raises(UnsupportedError) as ei:
        OP.choose("cuda", torch.float32, requested="portable", head_dim=3)
    assert "supports bfloat16/float16, got float32" in str(ei.value)
    with pytest.raises(UnsupportedError, match="unknown backend 'fa9'.*'hopper', 'portable', 'reference'"):
        OP.choose("cuda", torch.bfloat16, requested="fa9")


def test_every_reason_listed_when_nothing_fits(on_arch):
    on_arch("8.0")
    op = OpInfo("unit_none", "fi-core", backends=(
        Backend("a", archs=("9.0a",)), Backend("b", min_arch="8.0", dtypes=(torch.float16,))))
    with pytest.raises(UnsupportedError) as ei:
        op.choose("cuda", torch.float32)
    msg = str(ei.value)
    assert "- a: needs sm_90a" in msg and "- b: supports float16, got float32" in msg


def test_dispatch_log_explains_choice(on_arch, caplog):
    on_arch("9.0a")
    with knobs.override(FI_LOG_DISPATCH="1"), caplog.at_level(logging.INFO, logger="fi.dispatch"):
        OP.choose("cuda", torch.float16, head_dim=64)
    text = caplog.text
    assert "unit_op -> portable" in text and "skipped hopper: supports bfloat16, got float16" in text
    caplog.clear()
    with knobs.override(FI_LOG_DISPATCH="0"), caplog.at_level(logging.INFO, logger="fi.dispatch"):
        OP.choose("cuda", torch.float16, head_dim=64)
    assert caplog.text == ""


def test_register_and_matrix():
    register_op(OP)
    assert OPS["unit_op"] is OP
    with pytest.raises(ValueError, match="already registered"):
        register_op(OpInfo("unit_op", "other", backends=(Backend("x"),)))
    rows = [r for r in support_matrix(Arch.parse("8.0")) if r["op"] == "unit_op"]
    assert [r["backend"] for r in rows] == ["hopper", "portable", "reference"]
    assert rows[0]["on_arch"].startswith("no (needs sm_90a")
    assert rows[1]["on_arch"] == "yes" and rows[1]["archs"] == "sm_80+"
    assert rows[2]["archs"] == "any+" or rows[2]["on_arch"] == "yes"


def test_bad_stability_rejected():
    with pytest.raises(ValueError, match="stability"):
        OpInfo("x", "f", backends=(Backend("a"),), stability="beta")
