"""tools/same_code.py: the cubins of one source built from two places have identical code
sections (the anonymous namespace's path hash aside), and a changed kernel body is reported."""

import importlib.util
from pathlib import Path

import pytest

from fi_core.arch import Arch
from fi_core.jit.spec import find_nvcc
from fi_core.selftest import selftest_spec

_TOOL = Path(__file__).resolve().parents[3] / "tools" / "same_code.py"
_spec = importlib.util.spec_from_file_location("same_code", _TOOL)
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc")
def test_same_source_elsewhere_is_identical_and_a_change_is_not(tmp_path):
    spec = selftest_spec(Arch.parse("9.0a"))
    src = Path(spec.sources[0])
    nvcc = Path(find_nvcc())
    copy = tmp_path / "copy" / src.name
    copy.parent.mkdir()
    copy.write_text(src.read_text())
    changed = tmp_path / "changed" / src.name
    changed.parent.mkdir()
    changed.write_text(src.read_text().replace("fmaf(a, x[i], b)", "fmaf(a, x[i], 2.0f * b)"))
    built = {}
    for name, path in (("orig", src), ("copy", copy), ("changed", changed)):
        built[name] = tmp_path / f"{name}.cubin"
        sc.build_cubin(spec, path, built[name], nvcc, src.parent)
    orig = sc.code_sections(built["orig"])
    assert any(k.startswith(".text") for k in orig)
    assert sc.compare(orig, sc.code_sections(built["copy"])) == []
    diff = sc.compare(orig, sc.code_sections(built["changed"]))
    assert diff and any("axpb_kernel" in d and "slots differ" in d for d in diff)
