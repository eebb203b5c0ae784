"""torch dtype <-> CUDA C++ type names and short tags used in spec names."""

from __future__ import annotations

import torch

_CUDA = {
    torch.float32: "float",
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
    torch.float8_e4m3fn: "__nv_fp8_e4m3",
    torch.float8_e5m2: "__nv_fp8_e5m2",
    torch.int32: "int32_t",
    torch.int64: "int64_t",
    torch.uint8: "uint8_t",
}
_TAG = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.int32: "i32",
    torch.int64: "i64", torch.uint8: "u8",
}


def cuda_type(dtype: torch.dtype) -> str:
    try:
        return _CUDA[dtype]
    except KeyError:
        raise TypeError(f"no CUDA type for {dtype}") from None


def tag(dtype: torch.dtype) -> str:
    try:
        return _TAG[dtype]
    except KeyError:
        raise TypeError(f"no tag for {dtype}") from None


def parse(d) -> torch.dtype:
    """torch.dtype from a dtype or a string ('float16', 'bfloat16', 'fp8_e4m3', ...)."""
    if isinstance(d, torch.dtype):
        return d
    if isinstance(d, str):
        name = d.replace("torch.", "")
        aliases = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
                   "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2"}
        name = aliases.get(name, name)
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            return dt
    raise TypeError(f"expected a torch.dtype or dtype name, got {d!r}")
