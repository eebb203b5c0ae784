"""Every CLI command runs (no GPU needed): show-config, support, cache, precompile, bench --list."""

import pytest
import torch

from fi_core.cli import main
from fi_core.jit.spec import find_nvcc
from fi_core.registry import Backend, OpInfo, register_op
from fi_core.selftest import selftest_spec

register_op(OpInfo("cli_unit_op", family="fi-core", backends=(Backend("cuda", min_arch="8.0",
                   dtypes=(torch.float16,)), Backend("reference", devices=("cpu",))),
                   specs=lambda arch: [selftest_spec(arch)]))
register_op(OpInfo("cli_unit_op_gpu_ref", family="fi-core", backends=(
    Backend("cuda", min_arch="8.0"), Backend("reference", devices=("cpu", "cuda")))))


def test_show_config(cache_dir, capsys):
    assert main(["show-config"]) == 0
    out = capsys.readouterr().out
    for section in ("== fi ==", "== GPU ==", "== kernel cache ==", "FI_CACHE_DIR"):
        assert section in out
    if not torch.cuda.is_available():
        assert "none:" in out


def test_support_matrix(capsys):
    assert main(["support", "--arch", "8.0"]) == 0
    out = capsys.readouterr().out
    assert "cli_unit_op" in out and "on sm_80" in out
    assert main(["support", "--arch", "7.5", "--op", "cli_unit_op"]) == 0
    out = capsys.readouterr().out
    assert "needs sm_80 or newer, GPU is sm_75" in out
    assert "pure-torch fallback" not in out  # this op's reference runs on the CPU only
    assert main(["support", "--arch", "9.0a", "--op", "cli_unit_op_gpu_ref"]) == 0
    assert "pure-torch fallback: backend='auto' takes it on a GPU only" in capsys.readouterr().out


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc")
def test_precompile_cache_ls_verify_clear(cache_dir, capsys):
    assert main(["precompile", "--arch", "8.0", "--jobs", "2", "cli_unit_op"]) == 0
    assert "precompiling 1 module(s) for sm_80" in capsys.readouterr().out
    assert main(["cache", "ls"]) == 0
    assert "fi_selftest-" in capsys.readouterr().out
    assert main(["cache", "verify"]) == 0
    assert "1/1 module(s) verified" in capsys.readouterr().out
    so = next(cache_dir.glob("modules/*/module.so"))
    so.write_bytes(b"corrupt")
    assert main(["cache", "verify"]) == 1
    assert "BAD" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 module(s)" in capsys.readouterr().out


def test_precompile_unknown_op_is_clear():
    with pytest.raises(SystemExit, match="unknown op"):
        main(["precompile", "--arch", "8.0", "no_such_op"])


def test_bench_list_and_no_gpu(capsys):
    assert main(["bench", "--list"]) == 0
    assert "launch_overhead" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main(["bench", "--routine", "launch_overhead"]) == 2


def test_broken_family_is_reported_not_fatal(monkeypatch, caplog):
    import importlib

    from fi_core import families

    real = importlib.import_module

    def fake(name, *a):
        if name == "fi_moe":
            raise RuntimeError("simulated broken install")
        return real(name, *a)
    monkeypatch.setattr(families.importlib, "import_module", fake)
    with caplog.at_level("WARNING", logger="fi"):
        done = families.import_all()
    assert "fi_moe" not in done and "fi_sampling" in done
    assert "could not import fi_moe (RuntimeError: simulated broken install)" in caplog.text
