"""Find a module (prebuilt -> JIT cache -> compile now) and load it with ctypes.

Launchers are called with raw pointers, sizes and the current torch stream; they return a
cudaError_t, which :class:`Module` turns into :class:`CudaError` carrying the runtime's message.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import threading
from pathlib import Path
from typing import Optional
from collections.abc import Callable, Sequence

from ..errors import CacheError, CudaError, KernelUnavailableError
from . import cache
from .build import build_many
from .spec import KernelSpec

log = logging.getLogger("fi.jit")

_CTYPES = {
    "ptr": ctypes.c_void_p, "stream": ctypes.c_void_p, "i32": ctypes.c_int32,
    "i64": ctypes.c_int64, "u32": ctypes.c_uint32, "u64": ctypes.c_uint64,
    "f32": ctypes.c_float, "f64": ctypes.c_double,
}
ABI_VERSION = 1


def bind_entry(cfn, args: Sequence[str]):
    """Give a ctypes function the C signature of an entry point: ``int`` return, one argument per
    name of ``args`` (Entry.args: "ptr", "stream", "i32", "i64", ...). Returns ``cfn``."""
    cfn.restype = ctypes.c_int
    cfn.argtypes = [_CTYPES[a] for a in args]
    return cfn


class Module:
    """A loaded kernel module. ``module.fn(name)`` (or attribute access) returns a callable that
    launches and raises CudaError on a non-zero return."""

    def __init__(self, spec: KernelSpec, path: Path, origin: str):
        self.spec = spec
        self.path = path
        self.origin = origin  # "prebuilt" | "cache" | "built"
        self._lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        abi = self._lib.fi_module_abi_version
        abi.restype = ctypes.c_int
        if abi() != ABI_VERSION:
            raise KernelUnavailableError(f"{path}: module ABI {abi()} != loader ABI {ABI_VERSION}")
        self._err_name = self._lib.fi_cuda_error_name
        self._err_name.restype = ctypes.c_char_p
        self._err_name.argtypes = [ctypes.c_int]
        self._err_str = self._lib.fi_cuda_error_string
        self._err_str.restype = ctypes.c_char_p
        self._err_str.argtypes = [ctypes.c_int]
        self._fns: dict[str, Callable] = {}
        for e in spec.entries:
            self._fns[e.name] = self._bind(e.name, e.args)

    def _bind(self, name: str, args: Sequence[str]) -> Callable:
        try:
            cfn = getattr(self._lib, name)
        except AttributeError:
            raise KernelUnavailableError(
                f"{self.path} does not export {name!r}: is it declared extern \"C\" with FI_EXPORT?"
            ) from None
        bind_entry(cfn, args)
        error = self.error

        def launch(*a):
            rc = cfn(*a)
            if rc:
                raise error(rc, name)

        launch.__name__ = name
        launch.raw = cfn  # type: ignore[attr-defined]
        return launch

    def error(self, code: int, where: str = "") -> CudaError:
        name = (self._err_name(code) or b"?").decode()
        msg = (self._err_str(code) or b"?").decode()
        return CudaError(code, name, msg, where)

    def fn(self, name: str) -> Callable:
        try:
            return self._fns[name]
        except KeyError:
            raise KeyError(f"{self.spec.name} has no entry {name!r}; entries: {list(self._fns)}") from None

    def __getattr__(self, name: str):
        fns = self.__dict__.get("_fns")
        if fns is not None and name in fns:
            return fns[name]
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"<fi module {self.spec.name}[{self.spec.arch}] from {self.origin}: {self.path}>"


_LOADED: dict[str, Module] = {}
_BY_ID: dict[int, Module] = {}
_LOCK = threading.Lock()


def prebuilt_dir(spec: KernelSpec) -> Optional[Path]:
    """Where a wheel built with FI_AOT=1 would hold this spec's module."""
    if not spec.package:
        return None
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    for loc in found.submodule_search_locations:
        d = Path(loc) / "_prebuilt" / spec.prebuilt_dirname
        if d.is_dir():
            return d
    return None


def locate(spec: KernelSpec) -> tuple[Optional[Path], str]:
    """(module path, origin) without compiling; (None, reason) if absent."""
    pre = prebuilt_dir(spec)
    if pre is not None:
        ok, why = cache.verify(pre)
        if ok:
            return pre / cache.MODULE, "prebuilt"
        log.warning("prebuilt module %s is unusable (%s); falling back to the JIT cache", pre, why)
    d = cache.module_dir(spec.dirname)
    ok, why = cache.verify(d)
    if ok:
        return d / cache.MODULE, "cache"
    return None, why


def load(spec: KernelSpec) -> Module:
    """The module for spec, compiling it now if it is neither prebuilt nor cached."""
    mod = _BY_ID.get(id(spec))
    if mod is not None and mod.spec is spec:
        return mod
    return load_many([spec])[0]


def load_many(specs: Sequence[KernelSpec], *, jobs: Optional[int] = None) -> list[Module]:
    """Load several modules, building all missing ones in one parallel ninja run."""
    with _LOCK:
        out: list[Optional[Module]] = []
        missing: list[KernelSpec] = []
        for s in specs:
            mod = _LOADED.get(s.key())
            out.append(mod)
            if mod is None and locate(s)[0] is None:
                missing.append(s)
        built: set = set()
        if missing:
            build_many(missing, jobs=jobs, built=built)
        for i, s in enumerate(specs):
            if out[i] is None:
                path, origin = locate(s)
                if path is None:
                    raise CacheError(f"module {s.dirname} failed verification after build: {origin}")
                if s.dirname in built:
                    origin = "built"
                mod = Module(s, path, origin)
                _LOADED[s.key()] = mod
                log.debug("loaded %r", mod)
                out[i] = mod
            _BY_ID[id(s)] = out[i]  # type: ignore[assignment]
        return out  # type: ignore[return-value]
