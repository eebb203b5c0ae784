"""The op registry, backend dispatch and the support matrix.

Every public op registers one :class:`OpInfo` naming its backends in preference order. Each
:class:`Backend` states what it needs (archs, dtypes, and an optional ``check`` for anything else);
``OpInfo.choose`` returns the first backend whose needs hold for a call, or raises
:class:`UnsupportedError` listing every backend's reason. ``FI_LOG_DISPATCH=1`` logs each choice.
Where ``auto`` falls back to the pure-torch ``reference`` backend on a GPU (no kernel supports
the call there), it warns once per op, device and reasons (:class:`ReferenceFallbackWarning`).
``flashinfer support`` prints the matrix from the same objects, so documentation cannot drift.

Example
-------
>>> import torch
>>> from fi_core.registry import Backend, OpInfo
>>> op = OpInfo("demo_op", family="fi-core", backends=(
...     Backend("cuda", min_arch="8.0", dtypes=(torch.bfloat16,)),
...     Backend("reference", devices=("cpu", "cuda"))))
>>> op.choose(device="cpu", dtype=torch.float32).name
'reference'
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union
from collections.abc import Callable, Iterable, Sequence

import torch

from . import knobs
from .arch import Arch
from .errors import ReferenceFallbackWarning, UnsupportedError

dispatch_log = logging.getLogger("fi.dispatch")
_handler_installed = False
_fallbacks_warned: set = set()  # (op, device, reasons) already warned of


def _enable_dispatch_log() -> None:
    """FI_LOG_DISPATCH=1 must print even when the application configured no logging."""
    global _handler_installed
    if not _handler_installed:
        _handler_installed = True
        dispatch_log.setLevel(logging.INFO)
        if not dispatch_log.handlers and not logging.getLogger().handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            dispatch_log.addHandler(h)

# A check receives the call's facts and returns None when supported, else the reason.
Check = Callable[[dict], Optional[str]]


@dataclass(frozen=True)
class Backend:
    """One implementation of an op and what it needs.

    min_arch/max_arch bound the compute capability (inclusive); ``archs`` lists exact targets
    instead (e.g. ``("9.0a",)`` for a Hopper-only kernel). ``devices`` is "cuda" and/or "cpu".
    """

    name: str
    min_arch: Optional[str] = None
    max_arch: Optional[str] = None
    archs: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    devices: tuple[str, ...] = ("cuda",)
    check: Optional[Check] = None
    notes: str = ""

    def reason(self, device_type: str, arch: Optional[Arch], dtype: Optional[torch.dtype],
               facts: dict) -> Optional[str]:
        if device_type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {device_type}"
        if device_type == "cuda" and arch is not None:
            if self.archs and not any(Arch.parse(a).cc == arch.cc for a in self.archs):
                return f"needs {' or '.join(str(Arch.parse(a)) for a in self.archs)}, GPU is {arch}"
            if self.min_arch and arch.cc < Arch.parse(self.min_arch).cc:
                return f"needs {Arch.parse(self.min_arch)} or newer, GPU is {arch}"
            if self.max_arch and arch.cc > Arch.parse(self.max_arch).cc:
                return f"supports up to {Arch.parse(self.max_arch)}, GPU is {arch}"
        if self.dtypes and dtype is not None and dtype not in self.dtypes:
            return f"supports {_dtypes(self.dtypes)}, got {_dtype_name(dtype)}"
        if self.check is not None:
            return self.check(facts)
        return None

    def arch_summary(self) -> str:
        if "cuda" not in self.devices:
            return "cpu"
        if self.archs:
            return ", ".join(str(Arch.parse(a)) for a in self.archs)
        lo = str(Arch.parse(self.min_arch)) if self.min_arch else "any"
        hi = str(Arch.parse(self.max_arch)) if self.max_arch else ""
        return f"{lo}+" if not hi else f"{lo}..{hi}"


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _dtypes(ds: Iterable[torch.dtype]) -> str:
    return "/".join(_dtype_name(d) for d in ds)


@dataclass
class OpInfo:
    """A public op: its family, stability, backends in preference order, and the representative
    kernel variants that precompile and the compile check build (``specs(arch) -> [KernelSpec]``).
    """

    name: str
    family: str
    backends: tuple[Backend, ...]
    stability: str = "stable"
    api: str = ""  # public path, e.g. "flashinfer.norm.rmsnorm"
    specs: Optional[Callable[[Arch], Sequence[Any]]] = None
    doc: str = ""
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.stability not in ("stable", "experimental"):
            raise ValueError(f"stability must be 'stable' or 'experimental', got {self.stability!r}")
        if not self.backends:
            raise ValueError(f"op {self.name} has no backends")

    def backend_names(self) -> list[str]:
        return [b.name for b in self.backends]

    def choose(self, device: Union[torch.device, str], dtype: Optional[torch.dtype] = None,
               requested: str = "auto", **facts) -> Backend:
        """Pick the backend for a call. ``facts`` are op-specific (head_dim=..., causal=...)
        and are passed to each backend's check."""
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        arch = None
        if dev.type == "cuda":
            from .arch import arch_of  # noqa: PLC0415

            arch = arch_of(dev)
        facts = {"dtype": dtype, "arch": arch, "device": dev, **facts}
        reasons: list[tuple[str, str]] = []
        if requested != "auto":
            known = self.backend_names()
            if requested not in known:
                raise UnsupportedError(
                    f"{self.name}: unknown backend {requested!r}; choose 'auto' or one of {known}")
            candidates = [b for b in self.backends if b.name == requested]
        else:
            candidates = list(self.backends)
        for b in candidates:
            why = b.reason(dev.type, arch, dtype, facts)
            if why is None:
                if b.name == "reference" and dev.type == "cuda" and reasons:
                    _warn_fallback(self.name, dev, arch, reasons)
                if knobs.log_dispatch():
                    _enable_dispatch_log()
                    skipped = "; ".join(f"{n}: {r}" for n, r in reasons)
                    dispatch_log.info(
                        "%s -> %s (requested %s; %s%s)", self.name, b.name, requested,
                        f"{dev.type} {arch or ''} {_dtype_name(dtype) if dtype else ''}".strip(),
                        f"; skipped {skipped}" if skipped else "")
                return b
            reasons.append((b.name, why))
        detail = "\n".join(f"  - {n}: {r}" for n, r in reasons)
        raise UnsupportedError(
            f"{self.name}: no backend can run this call (requested {requested!r}, device "
            f"{dev}{' ' + str(arch) if arch else ''}, dtype {dtype and _dtype_name(dtype)}):\n{detail}")


def _warn_fallback(op: str, dev: torch.device, arch, reasons: list[tuple[str, str]]) -> None:
    key = (op, str(dev), tuple(reasons))
    if key in _fallbacks_warned:
        return
    _fallbacks_warned.add(key)
    why = "; ".join(f"{n}: {r}" for n, r in reasons)
    warnings.warn(f"{op}: no kernel runs this call on {dev}{' ' + str(arch) if arch else ''}, so it runs the "
                  f"pure-torch reference (correct, but slow) ({why})", ReferenceFallbackWarning, stacklevel=3)


OPS: dict[str, OpInfo] = {}


def register_op(op: OpInfo) -> OpInfo:
    if op.name in OPS and OPS[op.name] is not op:
        raise ValueError(f"op {op.name!r} is already registered by {OPS[op.name].family}")
    OPS[op.name] = op
    return op


def all_ops(load_families: bool = True) -> list[OpInfo]:
    if load_families:
        from .families import import_all  # noqa: PLC0415

        import_all()
    return sorted(OPS.values(), key=lambda o: (o.family, o.name))


def support_matrix(arch: Optional[Arch] = None) -> list[dict]:
    """One row per (op, backend): archs, dtypes, and whether it runs on `arch` (if given)."""
    rows = []
    for op in all_ops():
        for b in op.backends:
            row = {
                "op": op.name, "family": op.family, "stability": op.stability, "backend": b.name,
                "archs": b.arch_summary(),
                "dtypes": _dtypes(b.dtypes) if b.dtypes else "any",
                "notes": b.notes,
            }
            if arch is not None:
                why = b.reason("cuda", arch, None, {}) if "cuda" in b.devices else "cpu only"
                row["on_arch"] = "yes" if why is None else f"no ({why})"
            rows.append(row)
    return rows
