"""Spec hashing, the cache (locks, atomic install, checksums, permissions) and nvcc builds.

These build tiny modules with the real nvcc (about 2-4 s each on 2 cores) and load them with ctypes;
nothing here needs a GPU.
"""

import json
import multiprocessing as mp
import os
import stat
import textwrap
from pathlib import Path

import pytest

from fi_core.arch import Arch
from fi_core.errors import CacheError, CompileError
from fi_core.jit import Entry, KernelSpec, build_many, load
from fi_core.jit import cache, loader
from fi_core.jit.spec import find_nvcc

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc")

KERNEL = """
#include "fi/common.cuh"
#include "helper.cuh"
__global__ void k(float* y) { y[threadIdx.x] = HELPER_VALUE; }
FI_EXPORT int fi_test_launch(void* y, cudaStream_t s) {
  k<<<1, 32, 0, s>>>(static_cast<float*>(y));
  return FI_LAUNCH_STATUS();
}
"""


def make_sources(d: Path, helper_value="1.0f") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "kern.cu").write_text(KERNEL)
    (d / "helper.cuh").write_text(f"#pragma once\n#define HELPER_VALUE {helper_value}\n")
    (d / "unrelated.cuh").write_text("// not included\n")
    return d / "kern.cu"


def make_spec(src: Path, arch="8.0", **kw) -> KernelSpec:
    return KernelSpec(name="fi_unit", sources=(src,), arch=Arch.parse(arch),
                      entries=(Entry("fi_test_launch", ("ptr", "stream")),), **kw)


def test_hash_covers_included_header_not_unrelated_file(tmp_path):
    src = make_sources(tmp_path / "k")
    k0 = make_spec(src).key()
    (tmp_path / "k" / "unrelated.cuh").write_text("// changed\n")
    assert make_spec(src).key() == k0
    (tmp_path / "k" / "helper.cuh").write_text("#pragma once\n#define HELPER_VALUE 2.0f\n")
    assert make_spec(src).key() != k0


def test_hash_covers_fi_headers_defines_flags_arch(tmp_path):
    src = make_sources(tmp_path / "k")
    base = make_spec(src)
    deps = {p.name for p in base.dependencies()}
    assert {"kern.cu", "helper.cuh", "common.cuh", "module_common.cu"} <= deps
    assert make_spec(src, defines={"A": "1", "B": "2"}).key() == make_spec(src, defines={"B": "2", "A": "1"}).key()
    keys = {base.key(), make_spec(src, arch="9.0a").key(), make_spec(src, defines={"A": "1"}).key(),
            make_spec(src, flags=("-G",)).key()}
    assert len(keys) == 4


def test_hash_covers_nvcc_version(tmp_path, monkeypatch):
    from fi_core.jit import spec as spec_mod

    src = make_sources(tmp_path / "k")
    k0 = make_spec(src).key()
    monkeypatch.setattr(spec_mod, "nvcc_version", lambda: "99.9.9")
    assert make_spec(src).key() != k0
    assert make_spec(src).source_key() == make_spec(src).source_key()


def test_replaced_spec_gets_its_own_key(tmp_path):
    """A spec derived with dataclasses.replace (A/B tools build variants this way) after the
    original's key was memoised must hash its own fields: a copied memo gave the derived spec the
    original's key, and the loader then returned the original's module for it."""
    import dataclasses  # noqa: PLC0415

    src = make_sources(tmp_path / "k")
    other = make_sources(tmp_path / "k2", helper_value="2.0f")
    base = make_spec(src, defines={"A": "1"})
    k0 = base.key()
    for derived in (dataclasses.replace(base, defines={"A": "2"}), dataclasses.replace(base, sources=(other,)),
                    dataclasses.replace(base, name="fi_unit_b")):
        assert derived.key() != k0
        assert derived.key() == KernelSpec(**{f.name: getattr(derived, f.name)
                                              for f in dataclasses.fields(derived) if f.init}).key()
    assert base.key() == k0


def test_spec_validation(tmp_path):
    src = make_sources(tmp_path / "k")
    with pytest.raises(ValueError, match="unknown argument codes"):
        Entry("f", ("pointer",))
    with pytest.raises(ValueError, match="spec name"):
        KernelSpec(name="bad name", sources=(src,), arch="8.0", entries=(Entry("f", ()),))
    with pytest.raises(ValueError, match="no sources"):
        KernelSpec(name="x", sources=(), arch="8.0", entries=(Entry("f", ()),))


def test_cache_dir_is_private(cache_dir):
    root = cache.root()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_group_writable_cache_is_refused(cache_dir):
    cache_dir.mkdir(parents=True)
    os.chmod(cache_dir, 0o775)
    with pytest.raises(CacheError, match="writable by group or others.*chmod go-w"):
        cache.root()


@needs_nvcc
def test_build_load_and_meta(cache_dir, tmp_path):
    spec = make_spec(make_sources(tmp_path / "k"))
    mod = load(spec)
    assert mod.origin == "built" and callable(mod.fi_test_launch)
    meta = json.loads((cache.module_dir(spec.dirname) / "meta.json").read_text())
    assert meta["key"] == spec.key() and meta["nvcc"]
    assert any("nvcc" in c for c in meta["commands"])
    kernels = meta["ptxas"]["kernels"]
    assert kernels and all(k.get("spill_stores", 0) == 0 for k in kernels.values())
    assert all("registers" in k for k in kernels.values())
    ok, why = cache.verify(cache.module_dir(spec.dirname))
    assert ok, why
    # A second process-level lookup is a cache hit.
    loader._LOADED.clear()
    loader._BY_ID.clear()
    assert load(make_spec(spec.sources[0])).origin == "cache"


@needs_nvcc
def test_truncated_module_is_detected_and_rebuilt(cache_dir, tmp_path):
    spec = make_spec(make_sources(tmp_path / "k"), defines={"TRUNC": "1"})
    build_many([spec])
    so = cache.module_dir(spec.dirname) / "module.so"
    data = so.read_bytes()
    so.write_bytes(data[: len(data) // 2])
    ok, why = cache.verify(so.parent)
    assert not ok and "checksum" in why
    loader._LOADED.clear()
    loader._BY_ID.clear()
    mod = load(spec)
    assert mod.origin == "built"
    assert cache.verify(so.parent)[0]


@needs_nvcc
def test_nvcc_error_surfaces_message_and_command(cache_dir, tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "bad.cu").write_text("#include \"fi/common.cuh\"\nFI_EXPORT int f() { return undefined_thing; }\n")
    spec = KernelSpec(name="fi_bad", sources=(d / "bad.cu",), arch="8.0", entries=(Entry("f", ()),))
    with pytest.raises(CompileError) as ei:
        build_many([spec])
    text = str(ei.value)
    assert "undefined_thing" in text and "is undefined" in text
    assert "nvcc" in ei.value.command and "bad.cu" in ei.value.command
    assert not cache.module_dir(spec.dirname).exists()


def _worker(args):
    cache_dir, src, counter = args
    os.environ["FI_CACHE_DIR"] = cache_dir
    os.environ["FI_NVCC"] = counter
    from fi_core import knobs

    knobs.refresh()
    from fi_core.jit import spec as spec_mod

    spec_mod.find_nvcc.cache_clear()
    spec = make_spec(Path(src), defines={"CONCURRENT": "1"})
    mod = load(spec)
    return mod.origin


@needs_nvcc
def test_eight_processes_one_build(cache_dir, tmp_path):
    src = make_sources(tmp_path / "k")
    log = tmp_path / "nvcc-calls.log"
    wrapper = tmp_path / "nvcc-counting"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {log}
        exec {find_nvcc()} "$@"
        """))
    wrapper.chmod(0o755)
    # The real nvcc's version.json sits beside its bin/; the wrapper's doesn't: same key either
    # way because nvcc_version falls back to running `wrapper --version`, which is logged, so
    # count only compile/link invocations.
    ctx = mp.get_context("spawn")
    with ctx.Pool(8) as pool:
        origins = pool.map(_worker, [(str(cache_dir), str(src), str(wrapper))] * 8)
    calls = [c for c in log.read_text().splitlines() if "--version" not in c]
    # one build = 2 compiles (kernel + module_common) + 1 link
    assert len(calls) == 3, calls
    assert sorted(origins).count("built") == 1 and origins.count("cache") == 7


def test_missing_nvcc_says_how_to_get_kernels(cache_dir, tmp_path, monkeypatch):
    from fi_core.errors import KernelUnavailableError
    from fi_core.jit import build as build_mod

    monkeypatch.setattr(build_mod, "find_nvcc", lambda: None)
    spec = make_spec(make_sources(tmp_path / "k"), defines={"NONVCC": "1"})
    with pytest.raises(KernelUnavailableError, match="nvcc was not found.*prebuilt wheel"):
        build_many([spec])


def test_prebuilt_dir_is_looked_up_first(cache_dir, tmp_path, monkeypatch):
    """A module shipped in <package>/_prebuilt/<name>-<source_key16>/ wins over the cache."""
    pkg = tmp_path / "site" / "fakepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    src = make_sources(tmp_path / "k")
    spec = make_spec(src, package="fakepkg")
    d = pkg / "_prebuilt" / spec.prebuilt_dirname
    d.mkdir(parents=True)
    so = d / "module.so"
    so.write_bytes(b"\x7fELF fake")
    os.chmod(so, 0o755)
    (d / "meta.json").write_text(json.dumps({"checksum": cache.sha256_file(so)}))
    path, origin = loader.locate(spec)
    assert origin == "prebuilt" and path == so


def test_module_in_world_writable_dir_is_not_loaded(cache_dir, tmp_path):
    d = tmp_path / "shared-mod"
    d.mkdir()
    so = d / "module.so"
    so.write_bytes(b"\x7fELF x")
    os.chmod(so, 0o700)
    (d / "meta.json").write_text(json.dumps({"checksum": cache.sha256_file(so)}))
    assert cache.verify(d)[0]
    os.chmod(d, 0o777)
    ok, why = cache.verify(d)
    assert not ok and "writable by group/others" in why
    os.chmod(d, 0o700)
    os.chmod(so, 0o766)
    assert not cache.verify(d)[0]


@needs_nvcc
def test_aot_build_prebuilt_layout(cache_dir, tmp_path):
    from fi_core.aot import build_prebuilt
    from fi_core.registry import Backend, OpInfo, register_op
    from fi_core.selftest import selftest_spec

    register_op(OpInfo("aot_unit_op", family="fi-core", backends=(Backend("cuda"),),
                       specs=lambda arch: [selftest_spec(arch)]))
    out = build_prebuilt("fi_core", tmp_path / "_prebuilt", archs=["8.0"], jobs=2)
    spec = selftest_spec(Arch.parse("8.0"))
    assert [p.name for p in out] == [spec.prebuilt_dirname]
    assert cache.verify(out[0])[0]


def test_source_names_in_the_key_do_not_depend_on_the_install_location():
    from fi_core.jit.spec import _stable_name

    a = Path("/work/repo/packages/fi-sampling/src/fi_sampling/norm/norm.cu")
    b = Path("/usr/lib/python3/site-packages/fi_sampling/norm/norm.cu")
    c = Path("/tmp/target/fi_sampling/norm/norm.cu")
    assert _stable_name(a) == _stable_name(b) == _stable_name(c) == "fi_sampling/norm/norm.cu"
    h = Path("/x/src/fi_core/include/fi/vec.cuh")
    assert _stable_name(h) == "fi_core/include/fi/vec.cuh"
