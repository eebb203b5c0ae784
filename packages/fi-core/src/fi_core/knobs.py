"""Every environment variable fi reads, declared once.

Nothing else in the project reads ``os.environ`` for configuration: code asks ``knobs.<name>()``.
Values are parsed once and cached (hot paths read knobs); tests and programs change knobs with
:func:`override`, which sets the variable for the duration of a ``with``, or call :func:`refresh`
after editing ``os.environ``.

Example
-------
>>> from fi_core import knobs
>>> with knobs.override(FI_LOG_DISPATCH="1"):
...     assert knobs.log_dispatch() is True
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from collections.abc import Callable, Iterator


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # "str" | "int" | "bool" | "auto-bool" (None = auto) | "path"
    default: Optional[str]
    doc: str
    aliases: tuple[str, ...] = ()

    def raw(self) -> Optional[str]:
        for var in (self.name, *self.aliases):
            value = os.environ.get(var)
            if value is not None and value != "":
                return value
        return self.default


KNOBS: dict[str, Knob] = {}


# Values are parsed on first use and cached: some knobs sit on hot paths (FI_CHECK_INPUTS in every
# run(), where os.environ.get alone costs ~1.5 us). override() and refresh() invalidate the cache;
# code that edits os.environ directly at run time must call refresh().
_generation = [0]
# The generation itself ([int], bumped by override() and refresh()): a hot path that read a knob
# once may compare it instead of calling the knob again (fi_attention's decode run()).
GENERATION = _generation


def _declare(knob: Knob) -> Callable[[], object]:
    KNOBS[knob.name] = knob
    state: list = [-1, None]

    def get():
        if state[0] != _generation[0]:
            state[1] = _convert(knob)  # raises on a bad value, and is then not cached
            state[0] = _generation[0]
        return state[1]
    return get


def refresh() -> None:
    """Re-read every knob from the environment on next use."""
    _generation[0] += 1


def _convert(knob: Knob):
    raw = knob.raw()
    if knob.kind in ("bool", "auto-bool"):
        auto = knob.kind == "auto-bool"
        if raw is None:
            return None if auto else False
        low = raw.strip().lower()
        if auto and low == "auto":
            return None
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{knob.name} must be one of {'auto/' if auto else ''}1/0/true/false/yes/no/on/off, "
                         f"got {raw!r}")
    if knob.kind == "int":
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{knob.name} must be an integer, got {raw!r}") from None
    if knob.kind == "path":
        return None if raw is None else Path(os.path.expanduser(raw))
    return raw


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fi")


cache_dir_raw = _declare(Knob(
    "FI_CACHE_DIR", "path", None,
    "Directory of the JIT kernel cache. Default: $XDG_CACHE_HOME/fi or ~/.cache/fi. Created 0700; "
    "a directory writable by group or others is refused."))


def cache_dir() -> Path:
    value = cache_dir_raw()
    return value if value is not None else Path(_default_cache_dir())


cuda_arch_list = _declare(Knob(
    "FI_CUDA_ARCH_LIST", "str", None,
    "Architectures to build for, space separated 'major.minor' with optional suffix, e.g. "
    "'8.0 9.0a 10.0a 12.0f'. Used by precompile and the AOT wheel build; default: the current GPU.",
    aliases=("FLASHINFER_CUDA_ARCH_LIST",)))

nvcc = _declare(Knob(
    "FI_NVCC", "path", None,
    "Path of nvcc. Default: $CUDA_HOME/bin/nvcc, then nvcc on PATH."))

cuda_home = _declare(Knob(
    "CUDA_HOME", "path", None, "CUDA toolkit root, used to find nvcc when FI_NVCC is unset.",
    aliases=("CUDA_PATH",)))

max_jobs = _declare(Knob(
    "FI_MAX_JOBS", "int", None,
    "Parallel nvcc processes for kernel builds. Default: the number of CPU cores."))

log_level = _declare(Knob(
    "FI_LOG_LEVEL", "str", "WARNING",
    "Level of the 'fi' logger: DEBUG, INFO, WARNING, ERROR."))

log_dispatch = _declare(Knob(
    "FI_LOG_DISPATCH", "bool", "0",
    "Log every backend choice of every op, with the reason, at INFO level on the 'fi.dispatch' logger."))

check_inputs = _declare(Knob(
    "FI_CHECK_INPUTS", "bool", "0",
    "Run expensive input checks that need data from the device (page indices in range, monotone "
    "indptr). They synchronise, so keep them off in production."))

aot = _declare(Knob(
    "FI_AOT", "bool", "0",
    "When building a wheel, compile the package's declared kernel variants into it "
    "(for FI_CUDA_ARCH_LIST)."))

gemm_tuning = _declare(Knob(
    "FI_GEMM_TUNING", "bool", "1",
    "Use the GEMM unit choices recorded by fi_gemm.autotune() in the cache's tuning/ files; 0 "
    "ignores them (every GEMM takes its shape-class table unit)."))

no_jit = _declare(Knob(
    "FI_NO_JIT", "bool", "0",
    "Never compile at run time: a kernel missing from the prebuilt set and the cache is an error."))

fa3_ctas_raw = _declare(Knob(
    "FI_FA3_CTAS", "str", None,
    "Testing/A-B knob of the Hopper prefill kernel's persistent grid: unset = one CTA per SM, "
    "'all' = one CTA per work tile (non-persistent launch), N > 0 = at most N CTAs."))


fa3_multicast = _declare(Knob(
    "FI_FA3_MULTICAST", "auto-bool", "auto",
    "K/V multicast of the Hopper prefill kernel (head_dim 128, even GQA group: 2-CTA clusters share "
    "each K/V tile by TMA multicast, half the L2-to-SM traffic). auto (default): launches of at "
    "least fi_attention.prefill.hopper.spec.MULTICAST_MIN_FLOPS of attention work, which run at the "
    "power cap (H200: about 1 % faster there, about 1 % slower on short launches); 1: always; 0: never."))


def fa3_ctas() -> int:
    """FI_FA3_CTAS as the launcher's max_ctas argument: 0 = default, -1 = one per tile, N = cap."""
    raw = fa3_ctas_raw()
    if raw is None:
        return 0
    if raw.strip().lower() == "all":
        return -1
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"FI_FA3_CTAS must be 'all' or a positive integer, got {raw!r}") from None
    if n <= 0:
        raise ValueError(f"FI_FA3_CTAS must be 'all' or a positive integer, got {raw!r}")
    return n


verbose_build = _declare(Knob(
    "FI_VERBOSE_BUILD", "bool", "0", "Print nvcc/ninja output of kernel builds as they run."))


@contextlib.contextmanager
def override(**values: Optional[str]) -> Iterator[None]:
    """Set knobs (by variable name) for the duration of the block; None unsets."""
    unknown = [k for k in values if k not in KNOBS and k not in _alias_names()]
    if unknown:
        raise KeyError(f"unknown knob(s) {unknown}; declared: {sorted(KNOBS)}")
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        refresh()
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        refresh()


def _alias_names() -> set[str]:
    return {a for k in KNOBS.values() for a in k.aliases}


def describe() -> list[tuple[str, str, str]]:
    """(name, current raw value, doc) for every knob: used by `flashinfer show-config`."""
    return [(k.name, str(k.raw()), k.doc) for k in KNOBS.values()]
