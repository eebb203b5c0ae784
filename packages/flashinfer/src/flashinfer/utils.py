"""flashinfer.utils: device capability queries (FlashInfer-compatible names)."""

from __future__ import annotations

import torch

from fi_core.arch import device_info
from fi_core.errors import GPUArchitectureError

__all__ = [
    "GPUArchitectureError", "device_support_pdl", "get_compute_capability",
    "is_sm90a_supported", "is_sm100a_supported",
]


def _index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


def get_compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device."""
    a = device_info(_index(device)).arch
    return a.major, a.minor


def device_support_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch needs sm_90 or newer."""
    return get_compute_capability(device)[0] >= 9


def is_sm90a_supported(device: torch.device) -> bool:
    return get_compute_capability(device) == (9, 0)


def is_sm100a_supported(device: torch.device) -> bool:
    return get_compute_capability(device) == (10, 0)
