"""KernelSpec: everything that determines a compiled module, and its content hash.

The hash (the cache key) covers the content of every source and of every header it includes from
fi's own include directories (found by scanning ``#include`` lines recursively), the defines, the
flags, the target arch, the entry signatures, the fi-core version, the nvcc version and, when the
spec uses CUTLASS, the installed nvidia-cutlass version (its headers are a versioned package, so
the version stands for their content). Editing a kernel or a header it includes therefore changes
the key; editing an unrelated file does not.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union
from collections.abc import Mapping, Sequence

from .. import knobs
from ..arch import Arch
from ..errors import KernelUnavailableError
from ..version import __version__ as FI_CORE_VERSION

# Argument codes of an extern "C" launcher -> ctypes type names (resolved in loader.py).
ARG_CODES = ("ptr", "i32", "i64", "u32", "u64", "f32", "f64", "stream")

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


COMMON_SOURCE = Path(__file__).resolve().parent / "module_common.cu"


def fi_include_dir() -> Path:
    """fi-core's shared device headers (``#include <fi/vec.cuh>``)."""
    return Path(__file__).resolve().parent.parent / "include"


@functools.cache
def cutlass_include_dir() -> Path:
    """CUTLASS/CuTe headers of the installed nvidia-cutlass package."""
    try:
        import cutlass_library  # noqa: PLC0415
    except ImportError as exc:
        raise KernelUnavailableError(
            "this kernel needs the CUTLASS headers: pip install nvidia-cutlass==4.2.0.0") from exc
    root = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    if not (root / "cute").is_dir():
        raise KernelUnavailableError(f"nvidia-cutlass is installed but {root}/cute is missing")
    return root


@functools.cache
def cutlass_version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("nvidia-cutlass")
    except Exception:
        return "unknown"


@dataclass(frozen=True)
class Entry:
    """An exported launcher: ``extern "C" int name(args...)`` returning a cudaError_t."""

    name: str
    args: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "args", tuple(self.args))
        bad = [a for a in self.args if a not in ARG_CODES]
        if bad:
            raise ValueError(f"entry {self.name}: unknown argument codes {bad}; use {ARG_CODES}")


@dataclass(frozen=True)
class KernelSpec:
    """One compiled module: sources + defines + flags for one target arch.

    ``package`` is the import name of the package that owns the sources (for prebuilt lookup).
    ``defines`` may be given as a dict; it is stored sorted.
    """

    name: str
    sources: tuple[Path, ...]
    arch: Arch
    entries: tuple[Entry, ...]
    defines: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()
    include_dirs: tuple[Path, ...] = ()
    cutlass: bool = False
    package: str = ""
    # Spill bytes (stores or loads, per kernel) the compile check (tools/compile_check.py) accepts
    # for this module; 0 for every module unless a measurement showed the spilling build faster
    # than its spill-free alternative (the spec that sets it says which). Not part of the key.
    spill_budget: int = field(default=0, compare=False)
    # Memoised hashes. init=False: dataclasses.replace() must start a derived spec with an empty
    # memo (an init field would be copied, and the derived spec would answer with the key of the
    # spec it was made from, so the loader would hand back that spec's module).
    _key: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"spec name must be [A-Za-z0-9_.-]+, got {self.name!r}")
        d = self.defines
        if isinstance(d, Mapping):
            d = tuple(sorted((str(k), str(v)) for k, v in d.items()))
        object.__setattr__(self, "defines", tuple(d))
        object.__setattr__(self, "sources", tuple(Path(s).resolve() for s in self.sources))
        object.__setattr__(self, "arch", Arch.parse(self.arch))
        object.__setattr__(self, "entries", tuple(self.entries))
        object.__setattr__(self, "flags", tuple(self.flags))
        object.__setattr__(self, "include_dirs", tuple(Path(p) for p in self.include_dirs))
        if not self.sources:
            raise ValueError(f"spec {self.name} has no sources")
        if not self.entries:
            raise ValueError(f"spec {self.name} exports no entry points")

    # ----- include search path and dependencies -------------------------------------------
    def search_dirs(self) -> list[Path]:
        dirs = [fi_include_dir(), *self.include_dirs]
        if self.cutlass:
            dirs.append(cutlass_include_dir())
        return dirs

    def dependencies(self) -> list[Path]:
        """Sources plus every header they include from fi-owned directories, recursively.
        CUTLASS and CUDA headers are not scanned (they are versioned packages)."""
        own_dirs = [fi_include_dir(), *self.include_dirs]
        seen: dict[Path, None] = {}
        stack = [*self.sources, COMMON_SOURCE]
        while stack:
            path = stack.pop()
            if path in seen:
                continue
            seen[path] = None
            for inc in _includes(path, _mtime(path)):
                found = _resolve(inc, path.parent, own_dirs)
                if found is not None and found not in seen:
                    stack.append(found)
        return list(seen)

    # ----- hashing ------------------------------------------------------------------------
    def source_key(self) -> str:
        """Hash of everything but the compiler version: identifies a prebuilt module."""
        k = self._key.get("source")
        if k is None:
            h = hashlib.sha256()
            head = {
                "name": self.name, "arch": self.arch.sm, "defines": self.defines,
                "flags": self.flags, "entries": [(e.name, e.args) for e in self.entries],
                "fi_core": FI_CORE_VERSION, "base_flags": base_nvcc_flags(),
                "cutlass": cutlass_version() if self.cutlass else None,
            }
            h.update(json.dumps(head, sort_keys=True).encode())
            for dep in sorted(self.dependencies(), key=_stable_name):
                h.update(_stable_name(dep).encode() + b"\0")
                h.update(_digest(dep, _mtime(dep)).encode())
            k = self._key["source"] = h.hexdigest()
        return k

    def key(self) -> str:
        """The JIT cache key: the source key plus the nvcc version."""
        k = self._key.get("full")
        if k is None:
            h = hashlib.sha256(self.source_key().encode())
            h.update(nvcc_version().encode())
            k = self._key["full"] = h.hexdigest()
        return k

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.key()[:16]}"

    @property
    def prebuilt_dirname(self) -> str:
        return f"{self.name}-{self.source_key()[:16]}"

    def describe(self) -> dict:
        return {
            "name": self.name, "arch": self.arch.sm, "defines": dict(self.defines),
            "flags": list(self.flags), "sources": [str(s) for s in self.sources],
            "entries": {e.name: list(e.args) for e in self.entries}, "cutlass": self.cutlass,
            "package": self.package,
        }


# Top-level import names of fi's packages: a source's name in the hash starts at its package, so a
# checkout (packages/<dist>/src/<pkg>/...) and an installed wheel (<site>/<pkg>/...) give the same
# key, and a prebuilt module built from one is found from the other.
_PACKAGE_ROOTS = ("fi_core", "fi_attention", "fi_gemm", "fi_moe", "fi_sampling", "fi_comm", "flashinfer")


def _stable_name(path: Path) -> str:
    """A path name that does not depend on where the checkout or site-packages lives."""
    parts = path.parts
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in _PACKAGE_ROOTS:
            return "/".join(parts[i:])
    return path.name


def _mtime(path: Path) -> int:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"kernel source {path} does not exist") from None
    return st.st_mtime_ns ^ st.st_size


@functools.lru_cache(maxsize=4096)
def _digest(path: Path, _stamp: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.lru_cache(maxsize=4096)
def _includes(path: Path, _stamp: int) -> tuple[str, ...]:
    text = path.read_text(errors="replace")
    return tuple(_INCLUDE_RE.findall(text))


def _resolve(inc: str, here: Path, dirs: Sequence[Path]) -> Optional[Path]:
    for d in (here, *dirs):
        cand = d / inc
        if cand.is_file():
            return cand.resolve()
    return None


# ----- the compiler ----------------------------------------------------------------------------

def base_nvcc_flags() -> tuple[str, ...]:
    """Flags every module is built with. -DNDEBUG also keeps wgmma from being serialised by
    CUTLASS's device asserts (ptxas warning C7510)."""
    return (
        "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
        "-Xcompiler", "-fvisibility=hidden", "-Xptxas", "-v", "-lineinfo",
        "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
    )


@functools.cache
def find_nvcc() -> Optional[Path]:
    explicit = knobs.nvcc()
    if explicit is not None:
        return explicit if explicit.is_file() else None
    home = knobs.cuda_home()
    candidates = []
    if home is not None:
        candidates.append(home / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


@functools.cache
def nvcc_version() -> str:
    """'13.0.88'-style version of the nvcc that would build, or 'no-nvcc'.

    Read from the toolkit's version.json when present (no process start), else `nvcc --version`.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        return "no-nvcc"
    vj = nvcc.resolve().parent.parent / "version.json"
    try:
        data = json.loads(vj.read_text())
        return str(data["cuda_nvcc"]["version"])
    except Exception:
        pass
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
        m = re.search(r"V(\d+\.\d+\.\d+)", out.stdout)
        return m.group(1) if m else out.stdout.strip().splitlines()[-1]
    except Exception:
        return "unknown-nvcc"


def spec_names(specs: Sequence[KernelSpec]) -> str:
    return ", ".join(f"{s.name}[{s.arch}]" for s in specs)


SpecLike = Union[KernelSpec, Sequence[KernelSpec]]
