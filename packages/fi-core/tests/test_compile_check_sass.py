"""tools/compile_check.py's SASS rule: serialised wgmma (a wait after every wgmma, which ptxas can
do without a warning) and CUTLASS/CuTe sm_90a modules without wgmma are reported."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

_TOOL = Path(__file__).resolve().parents[3] / "tools" / "compile_check.py"
_spec = importlib.util.spec_from_file_location("compile_check", _TOOL)
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)

_PIPELINED = """
        Function : kern_a
        /*0b50*/                   WARPGROUP.ARRIVE ;
        /*0c10*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0c20*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0c30*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0c40*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0c90*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""
_SERIALISED = "        Function : kern_b\n" + "".join(
    "        /*0c10*/  WARPGROUP.ARRIVE ;\n"
    "        /*0c20*/  QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;\n"
    "        /*0c30*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n" for _ in range(5))


def test_parse_counts_per_function():
    counts = cc.parse_sass_wgmma(_PIPELINED + _SERIALISED)
    assert counts == {"kern_a": (4, 1), "kern_b": (5, 5)}


def test_serialised_wgmma_is_a_problem():
    spec = SimpleNamespace(name="m", arch="sm_90a", cutlass=True)
    ok, n = cc.sass_problems(spec, cc.parse_sass_wgmma(_PIPELINED))
    assert ok == [] and n == 4
    bad, n = cc.sass_problems(spec, cc.parse_sass_wgmma(_SERIALISED))
    assert n == 5 and len(bad) == 1 and "serialised" in bad[0]


def test_cutlass_module_without_wgmma_is_a_problem():
    counts = cc.parse_sass_wgmma("        Function : k\n        /*0000*/  FFMA R1, R2, R3, R4 ;\n")
    bad, _ = cc.sass_problems(SimpleNamespace(name="m", arch="sm_90a", cutlass=True), counts)
    assert len(bad) == 1 and "without wgmma" in bad[0]
    ok, _ = cc.sass_problems(SimpleNamespace(name="m", arch="sm_90a", cutlass=False), counts)
    assert ok == []

