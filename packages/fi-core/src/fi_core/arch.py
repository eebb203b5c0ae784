"""GPU architectures and device facts.

``Arch`` names a compilation target (``sm_90a``). ``device_info`` reads the facts kernels size
themselves by (SM count, opt-in shared memory per block, L2 size) from the driver through
cuda-bindings, lazily: importing fi never touches CUDA.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional, Union
from collections.abc import Iterable

from . import knobs
from .errors import NoGPUError



@dataclass(frozen=True, order=True)
class Arch:
    """A compute capability plus an optional feature suffix: 'a' (arch-specific, e.g. wgmma on
    sm_90a) or 'f' (family-portable, sm_120f)."""

    major: int
    minor: int
    suffix: str = ""

    def __post_init__(self):
        if self.suffix not in ("", "a", "f"):
            raise ValueError(f"arch suffix must be '', 'a' or 'f', got {self.suffix!r}")
        if not (0 <= self.minor <= 9) or self.major < 1:
            raise ValueError(f"invalid compute capability {self.major}.{self.minor}")

    @classmethod
    def from_cc(cls, major: int, minor: int) -> "Arch":
        """The target fi builds for a device of compute capability major.minor.

        Hopper and Blackwell datacenter parts get the 'a' target (wgmma, tcgen05 need it);
        12.x gets 'f'. Older parts get the plain target.
        """
        return cls(major, minor, _default_suffix(major))

    @classmethod
    def parse(cls, text: Union[str, "Arch"]) -> "Arch":
        """Parse '9.0a', '9.0', 'sm_90a', '90a', '8.6'. A 9.x/10.x/11.x without suffix gets 'a'
        and 12.x gets 'f' (FlashInfer's rule for FLASHINFER_CUDA_ARCH_LIST)."""
        if isinstance(text, Arch):
            return text
        token = text.strip().lower()
        m = re.match(r"^(?:sm_|compute_)?(\d+)\.(\d)([af]?)$", token) or \
            re.match(r"^(?:sm_|compute_)?(\d+)(\d)([af]?)$", token)
        if not m:
            raise ValueError(
                f"cannot parse architecture {text!r}: expected 'major.minor[a|f]' like '9.0a' or "
                f"'sm_90a'")
        major, minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
        if not suffix:
            suffix = _default_suffix(major)
        return cls(major, minor, suffix)

    @property
    def cc(self) -> int:
        """Compute capability as an integer, 90 for sm_90a."""
        return self.major * 10 + self.minor

    @property
    def sm(self) -> str:
        return f"sm_{self.major}{self.minor}{self.suffix}"

    @property
    def gencode(self) -> str:
        tag = f"{self.major}{self.minor}{self.suffix}"
        return f"-gencode=arch=compute_{tag},code=sm_{tag}"

    def at_least(self, other: Union[str, "Arch"]) -> bool:
        o = Arch.parse(other)
        return self.cc >= o.cc

    def runs_on(self, device_arch: "Arch") -> bool:
        """Whether SASS built for self loads on a device of device_arch: same major, minor not
        above; arch-specific ('a') SASS only on the exact capability."""
        if self.suffix == "a":
            return self.cc == device_arch.cc
        return self.major == device_arch.major and self.minor <= device_arch.minor

    def __str__(self) -> str:
        return self.sm


def _default_suffix(major: int) -> str:
    if major in (9, 10, 11):
        return "a"
    if major == 12:
        return "f"
    return ""


def parse_arch_list(text: str) -> list[Arch]:
    """Parse FI_CUDA_ARCH_LIST: space (or comma/semicolon) separated archs; '+PTX' is ignored."""
    tokens = [t for t in re.split(r"[\s,;]+", text.strip()) if t]
    if not tokens:
        raise ValueError("FI_CUDA_ARCH_LIST is empty: expected e.g. '8.0 9.0a'")
    out: list[Arch] = []
    for t in tokens:
        a = Arch.parse(t.replace("+PTX", "").replace("+ptx", ""))
        if a not in out:
            out.append(a)
    return out


def arch_list_from_env() -> Optional[list[Arch]]:
    raw = knobs.cuda_arch_list()
    return parse_arch_list(raw) if raw else None


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    arch: Arch
    sm_count: int
    smem_per_block_optin: int
    l2_bytes: int
    total_memory: int
    driver_version: int

    @property
    def cc(self) -> int:
        return self.arch.cc


def _driver():
    try:
        from cuda.bindings import driver  # noqa: PLC0415 (lazy: no CUDA at import)
    except Exception as exc:  # pragma: no cover - cuda-bindings is a declared dependency
        raise NoGPUError(f"cuda-bindings is not importable ({exc}); install cuda-bindings") from exc
    return driver


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise NoGPUError(f"{what} failed with {err!r}: no usable CUDA device")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


@functools.cache
def _init_driver():
    driver = _driver()
    try:
        _check(driver.cuInit(0), "cuInit")
    except NoGPUError:
        raise
    except Exception as exc:
        raise NoGPUError(f"no CUDA driver: {exc}") from exc
    count = _check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    if count == 0:
        raise NoGPUError("the CUDA driver reports no devices")
    return driver, count


def device_count() -> int:
    """Number of CUDA devices, 0 when there is no driver or device."""
    try:
        return _init_driver()[1]
    except NoGPUError:
        return 0


def has_gpu() -> bool:
    return device_count() > 0


@functools.cache
def device_info(index: int = 0) -> DeviceInfo:
    """Facts about CUDA device `index`, read from the driver. Raises NoGPUError without one."""
    driver, count = _init_driver()
    if not 0 <= index < count:
        raise NoGPUError(f"CUDA device {index} does not exist; {count} device(s) visible")
    dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    A = driver.CUdevice_attribute

    def attr(a) -> int:
        return int(_check(driver.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a})"))

    major = attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    minor = attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    raw_name = _check(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = raw_name.split(b"\0", 1)[0].decode() if isinstance(raw_name, bytes) else str(raw_name)
    total = int(_check(driver.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))
    drv = int(_check(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
    return DeviceInfo(
        index=index,
        name=name,
        arch=Arch.from_cc(major, minor),
        sm_count=attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        smem_per_block_optin=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        l2_bytes=attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        total_memory=total,
        driver_version=drv,
    )


def _index_of(device) -> int:
    if device is None:
        import torch  # noqa: PLC0415

        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    idx = getattr(device, "index", None)
    if idx is None:
        import torch  # noqa: PLC0415

        return torch.cuda.current_device()
    return idx


_ARCH_BY_INDEX: dict[int, Arch] = {}


def arch_of(device=None) -> Arch:
    """The build target for a torch device (or index); cached per device."""
    idx = _index_of(device)
    a = _ARCH_BY_INDEX.get(idx)
    if a is None:
        a = _ARCH_BY_INDEX[idx] = device_info(idx).arch
    return a


def archs_for_build(explicit: Optional[Iterable[Union[str, Arch]]] = None) -> list[Arch]:
    """Targets for precompile/AOT: explicit list, else FI_CUDA_ARCH_LIST, else the current GPU."""
    if explicit:
        return [Arch.parse(a) for a in explicit]
    env = arch_list_from_env()
    if env:
        return env
    if has_gpu():
        return [device_info(0).arch]
    raise NoGPUError(
        "no architecture to build for: set FI_CUDA_ARCH_LIST (e.g. '8.0 9.0a') or pass --arch")
