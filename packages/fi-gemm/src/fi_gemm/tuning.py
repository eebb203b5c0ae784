"""Optional autotuner of the CUTLASS GEMM units (FlashInfer's ``flashinfer.autotune``).

Outside the context every GEMM takes the unit its shape class names (``spec.sm90_config``): a
table measured on the H200. Inside ``with autotune():`` the first call of each exact problem
(op, dtypes, M, N, K, batch) on a device times every unit of that table on the call's own
operands, keeps the fastest and records it in ``<fi cache>/tuning/<device>.json``. Later calls,
and later processes on the same kind of device, take the recorded unit without timing again;
``FI_GEMM_TUNING=0`` ignores the records. Only the CUTLASS path (sm_90, M > 16) is tuned: the
decode-shape kernel has no table to choose from.

The file is keyed by device name and fi-gemm version (a new version may change what a unit name
means), written atomically under a lock, and read once per process and device. A file that does
not parse, or names units that no longer exist, is ignored with a warning, never an error.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

from fi_core import knobs
from fi_core.errors import CacheError
from fi_core.jit import cache

from .version import __version__

# Nesting depth of autotune(True) contexts; tuning is on while it is positive (process-wide, like
# FlashInfer's: serving engines tune once at warm-up, from one thread).
_depth = 0
_persist = True
# device index -> {problem key tuple: unit name}; filled from the device's file on first use.
RECORDS: dict[int, dict[tuple, str]] = {}
_DEVICE: dict[int, tuple[str, str]] = {}  # device index -> (device name, arch)


def active() -> bool:
    """Whether calls are being tuned (inside ``autotune(True)``)."""
    return _depth > 0


@contextlib.contextmanager
def autotune(tune_mode: bool = True, *, persist: bool = True) -> Iterator[None]:
    """Tune the CUTLASS GEMM unit of every new problem shape run inside the context.

    Parameters
    ----------
    tune_mode : bool
        True (FlashInfer's default) times the candidates of each new (op, dtypes, M, N, K, batch)
        once; False runs the block with the recorded or table choices only.
    persist : bool
        Record the choices in the fi cache for later processes (default True).

    Examples
    --------
    >>> import torch
    >>> from fi_gemm import autotune, bmm_fp8
    >>> with autotune():  # doctest: +SKIP
    ...     out = bmm_fp8(A, B, A_scale, B_scale, torch.bfloat16)  # times every unit once

    See Also
    --------
    spec.sm90_config : the table used without tuning.
    """
    global _depth, _persist
    saved = (_depth, _persist)
    _depth = _depth + 1 if tune_mode else 0  # autotune(False) inside autotune() stops tuning
    _persist = persist
    try:
        yield
    finally:
        _depth, _persist = saved


# ---- records ---------------------------------------------------------------------------------
def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "device"


def _path(device_name: str) -> Path:
    d = cache.root() / "tuning"
    d.mkdir(mode=0o700, exist_ok=True)
    return d / f"{_slug(device_name)}.json"


def problem_key(op: str, a_dtype, w_dtype, out_dtype, m: int, n: int, k: int, batch: int) -> tuple:
    return (op, str(a_dtype).removeprefix("torch."), str(w_dtype).removeprefix("torch."),
            str(out_dtype).removeprefix("torch."), m, n, k, batch)


def _encode(key: tuple) -> str:
    return "|".join(str(v) for v in key)


def _decode(text: str) -> Optional[tuple]:
    parts = text.split("|")
    if len(parts) != 8:
        return None
    try:
        return (*parts[:4], *(int(v) for v in parts[4:]))
    except ValueError:
        return None


def _read(path: Path, device_name: str, valid: Callable[[tuple, str], bool]) -> dict[tuple, str]:
    """Records of one file; {} (with a warning) for a file that is not ours or does not parse."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"fi-gemm: ignoring tuning records {path}: {exc}", stacklevel=3)
        return {}
    if not isinstance(data, dict) or data.get("fi_gemm") != __version__ or \
            data.get("device") != device_name or not isinstance(data.get("entries"), dict):
        return {}  # another version or device: its unit names may mean other kernels
    out = {}
    for text, entry in data["entries"].items():
        key = _decode(text)
        unit = entry.get("config") if isinstance(entry, dict) else None
        if key is None or not isinstance(unit, str) or not valid(key, unit):
            warnings.warn(f"fi-gemm: ignoring tuning record {text!r} in {path}", stacklevel=3)
            continue
        out[key] = unit
    return out


def load(index: int, device_name: str, arch: str, valid: Callable[[tuple, str], bool]) -> dict:
    """The records of device `index` (read from its file on first use)."""
    recs = RECORDS.get(index)
    if recs is None:
        _DEVICE[index] = (device_name, arch)
        recs = {}
        if knobs.gemm_tuning():
            try:
                path = _path(device_name)
            except (OSError, CacheError) as exc:  # GEMMs must not fail over an unusable cache
                warnings.warn(f"fi-gemm: tuning records unavailable: {exc}", stacklevel=3)
            else:
                recs = _read(path, device_name, valid)
        RECORDS[index] = recs
    return recs


def record(index: int, key: tuple, unit: str, times_us: dict[str, float]) -> None:
    """Keep `unit` for `key` on device `index` and, unless persist=False, add it to the file
    (read-modify-write under a lock, replaced atomically: concurrent tuners lose nothing)."""
    RECORDS.setdefault(index, {})[key] = unit
    if not _persist or index not in _DEVICE:
        return
    name, arch = _DEVICE[index]
    try:
        _write(name, arch, key, unit, times_us)
    except (OSError, CacheError) as exc:  # the choice still holds for this process
        warnings.warn(f"fi-gemm: could not record the tuning result: {exc}", stacklevel=3)


def _write(name: str, arch: str, key: tuple, unit: str, times_us: dict[str, float]) -> None:
    path = _path(name)
    with cache.lock(f"tuning-{_slug(name)}"):
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("fi_gemm") != __version__ or \
                    data.get("device") != name:
                data = None
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            data = {"fi_gemm": __version__, "device": name, "arch": arch, "entries": {}}
        data["entries"][_encode(key)] = {
            "config": unit, "us": {u: round(t, 3) for u, t in times_us.items()},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def forget() -> None:
    """Drop the in-memory records (the next call re-reads the files): for tests."""
    RECORDS.clear()
    _DEVICE.clear()


# ---- timing ----------------------------------------------------------------------------------
def fastest(candidates: list[str], time_us: Callable[[str], Optional[float]]) -> tuple[str, dict]:
    """The candidate with the smallest time (ties: the earlier one) and every time measured;
    a candidate whose timer returns None (it cannot run this problem) is skipped."""
    times = {}
    for c in candidates:
        t = time_us(c)
        if t is not None:
            times[c] = t
    if not times:
        raise ValueError(f"no candidate of {candidates} could run the problem")
    return min(times, key=lambda c: (times[c], candidates.index(c))), times


def time_launch(fn: Callable[[], None]) -> float:
    """Median time of fn() in microseconds: fi-core's benchmark timer (CUDA events on the current
    stream, which the launches use), eager, one warm-up call, 10 timings of 3 calls each."""
    from fi_core.bench import time_fn  # noqa: PLC0415  (torch's CUDA side, only when tuning)

    return time_fn(fn, [()], use_graph=False, reps=10, warmup=1, min_calls_per_replay=3).median_us
