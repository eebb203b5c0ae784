"""The meta-package: FlashInfer module paths, missing families, the CLI and the demo."""

import importlib
import subprocess
import sys

import pytest

import flashinfer
from flashinfer._family import MissingFamilyError


MODULES = ["decode", "prefill", "page", "cascade", "sampling", "norm", "rope", "activation", "gemm",
           "fused_moe", "comm", "utils"]


def test_flashinfer_module_paths_exist():
    for m in MODULES:
        assert importlib.import_module(f"flashinfer.{m}") is getattr(flashinfer, m)


def test_flat_names_are_the_family_objects():
    for m in ("decode", "prefill", "page", "cascade", "sampling", "norm", "rope", "activation", "gemm"):
        mod = getattr(flashinfer, m)
        for name in mod.__all__:
            assert getattr(flashinfer, name) is getattr(mod, name), (m, name)


def test_missing_family_names_the_package(monkeypatch):
    import importlib.util

    from flashinfer import _family

    real = importlib.util.find_spec
    monkeypatch.setattr(_family.importlib.util, "find_spec",
                        lambda name, *a: None if name == "fi_sampling" else real(name, *a))
    ns = {"__name__": "flashinfer.norm"}
    assert _family.reexport(ns, "fi-sampling", "fi_sampling.norm") is False
    with pytest.raises(MissingFamilyError, match="provided by the 'fi-sampling' package.*pip install fi-sampling"):
        ns["__getattr__"]("rmsnorm")
    assert issubclass(MissingFamilyError, ImportError)


def test_unknown_name_says_what_is_provided():
    with pytest.raises(AttributeError, match="does not provide this FlashInfer name"):
        flashinfer.comm.custom_all_reduce  # noqa: B018


def test_import_without_a_family_installed_works():
    """`import flashinfer` in a process where fi_moe cannot be imported still succeeds."""
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'fi_moe': raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import importlib.util\n"
            "importlib.util.find_spec = (lambda f: lambda n, *a: None if n.startswith('fi_moe') else f(n, *a))(importlib.util.find_spec)\n"
            "import flashinfer\n"
            "try:\n"
            "    flashinfer.fused_moe.fused_moe\n"
            "except ImportError as e:\n"
            "    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "pip install fi-moe" in out.stdout


def test_utils_errors_on_cpu_device():
    with pytest.raises(ValueError, match="expected a CUDA device"):
        flashinfer.utils.get_compute_capability("cpu")


def test_cli_runs_as_module():
    out = subprocess.run([sys.executable, "-m", "flashinfer", "support", "--arch", "9.0a"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "support matrix for sm_90a" in out.stdout or "no ops registered" in out.stdout


def test_demo_runs_on_cpu():
    from flashinfer.demo import CPU_CONFIG, run_demo
    import dataclasses
    import torch

    cfg = dataclasses.replace(CPU_CONFIG, steps=3, prompt=3)
    res = run_demo(cfg, torch.device("cpu"))
    assert res["tokens"].shape == (cfg.batch, cfg.steps)
    assert res["tokens_per_s"] > 0
    assert set(res["ops"]) >= {"norm.rmsnorm", "decode.BatchDecodeWithPagedKVCacheWrapper"}
