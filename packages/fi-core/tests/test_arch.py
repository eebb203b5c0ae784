import pytest

from fi_core import knobs
from fi_core.arch import Arch, arch_list_from_env, device_count, device_info, parse_arch_list
from fi_core.errors import NoGPUError


@pytest.mark.parametrize("text, expected", [
    ("8.0", "sm_80"), ("8.6", "sm_86"), ("8.9", "sm_89"),
    ("9.0", "sm_90a"), ("9.0a", "sm_90a"), ("sm_90a", "sm_90a"), ("90a", "sm_90a"),
    ("10.0", "sm_100a"), ("10.0a", "sm_100a"), ("11.0", "sm_110a"),
    ("12.0", "sm_120f"), ("12.0f", "sm_120f"), ("compute_80", "sm_80"), ("7.5", "sm_75"),
])
def test_parse_table(text, expected):
    assert Arch.parse(text).sm == expected


@pytest.mark.parametrize("bad", ["", "9", "nine", "9.0b", "sm_", "9.10"])
def test_parse_rejects_with_expected_form(bad):
    with pytest.raises(ValueError, match="expected 'major.minor"):
        Arch.parse(bad)


def test_arch_list_parsing_dedups_and_strips_ptx():
    assert [a.sm for a in parse_arch_list("8.0 9.0a 10.0a 12.0f")] == ["sm_80", "sm_90a", "sm_100a", "sm_120f"]
    assert [a.sm for a in parse_arch_list("8.0,8.0;9.0+PTX")] == ["sm_80", "sm_90a"]
    with pytest.raises(ValueError, match="empty"):
        parse_arch_list("   ")


def test_flashinfer_alias_of_arch_list():
    with knobs.override(FI_CUDA_ARCH_LIST=None, FLASHINFER_CUDA_ARCH_LIST="8.9 9.0"):
        assert [a.sm for a in arch_list_from_env()] == ["sm_89", "sm_90a"]
    with knobs.override(FI_CUDA_ARCH_LIST="8.0", FLASHINFER_CUDA_ARCH_LIST="9.0"):
        assert [a.sm for a in arch_list_from_env()] == ["sm_80"]  # ours wins


def test_gencode_and_ordering():
    a = Arch.parse("9.0a")
    assert a.gencode == "-gencode=arch=compute_90a,code=sm_90a"
    assert Arch.parse("8.0").gencode == "-gencode=arch=compute_80,code=sm_80"
    assert a.cc == 90 and a.at_least("8.0") and not Arch.parse("8.6").at_least("8.9")
    assert Arch.from_cc(9, 0) == a and Arch.from_cc(8, 6).sm == "sm_86"


def test_runs_on():
    assert Arch.parse("8.0").runs_on(Arch.parse("8.6"))
    assert not Arch.parse("8.6").runs_on(Arch.parse("8.0"))
    assert Arch.parse("9.0a").runs_on(Arch.parse("9.0a"))
    assert not Arch.parse("9.0a").runs_on(Arch.parse("10.0a"))


def test_no_driver_gives_typed_error(monkeypatch):
    from fi_core import arch as arch_mod

    def boom():
        raise NoGPUError("no CUDA driver: simulated")
    arch_mod._init_driver.cache_clear()
    arch_mod.device_info.cache_clear()
    monkeypatch.setattr(arch_mod, "_init_driver", boom)
    with pytest.raises(NoGPUError, match="simulated"):
        device_info(0)
    assert device_count() == 0
    # NoGPUError is a RuntimeError, so generic handlers keep working
    assert issubclass(NoGPUError, RuntimeError)


def test_real_detection_without_gpu_is_typed():
    """On a machine without a GPU, the real driver probe raises NoGPUError (never a crash)."""
    from fi_core import arch as arch_mod

    arch_mod._init_driver.cache_clear()
    arch_mod.device_info.cache_clear()
    if device_count() > 0:
        info = device_info(0)
        assert info.sm_count > 0 and info.l2_bytes > 0 and info.smem_per_block_optin >= 48 * 1024
    else:
        with pytest.raises(NoGPUError):
            device_info(0)


def test_import_makes_no_cuda_call():
    import subprocess
    import sys

    code = ("import sys, fi_core, fi_core.jit, fi_core.registry, fi_core.cli; "
            "import fi_core.arch as a; "
            "print(a._init_driver.cache_info().currsize, a.device_info.cache_info().currsize, "
            "len(a._ARCH_BY_INDEX))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0", "0"]
