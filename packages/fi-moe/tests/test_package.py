"""fi-moe has no ops yet: it must install, import, register nothing and say so through flashinfer."""

import importlib

import pytest


def test_imports_and_exports_only_version():
    mod = importlib.import_module("fi_moe")
    assert mod.__all__ == ["__version__"] and mod.__version__


def test_registers_no_ops():
    from fi_core.registry import all_ops

    assert not [o for o in all_ops() if o.family == "fi-moe"]


def test_flashinfer_name_reports_missing_op():
    fi_mod = importlib.import_module("flashinfer.fused_moe")
    with pytest.raises(AttributeError, match="does not provide this FlashInfer name"):
        _ = fi_mod.cutlass_fused_moe
