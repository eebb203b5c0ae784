"""Validation and small helpers shared by single prefill and the batch wrappers."""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import checks
from fi_core.errors import InputError, InputTypeError

from ..reference import POS_ENCODING_MODES

Q_DTYPES = (torch.float16, torch.bfloat16)


def dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def check_tensor(name: str, t, ndim: int, dtypes=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise InputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise InputTypeError(f"{name} must be {' or '.join(dtype_name(d) for d in dtypes)}, "
                             f"got {dtype_name(t.dtype)}")
    return t


def check_rows(name: str, t: torch.Tensor) -> None:
    """Last dim contiguous and every row start 16-byte aligned (the kernels use 16-byte copies)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise InputError(f"{name}: the head_dim dimension must be contiguous (stride 1), got strides {t.stride()}")
    if t.device.type != "cuda":
        return
    esz = t.element_size()
    if t.data_ptr() % 16 or any((s * esz) % 16 for s in t.stride()[:-1]):
        raise InputError(f"{name}: rows must start at 16-byte boundaries; got base address % 16 = "
                         f"{t.data_ptr() % 16} and strides {t.stride()[:-1]} of {esz}-byte elements")


def check_heads(num_qo_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
        raise InputError(f"num_qo_heads ({num_qo_heads}) must be a positive multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    return num_qo_heads // num_kv_heads


def check_options(pos_encoding_mode: str, window_left: int) -> None:
    if pos_encoding_mode not in POS_ENCODING_MODES:
        raise InputError(f"pos_encoding_mode must be one of {POS_ENCODING_MODES}, got {pos_encoding_mode!r}")
    checks.int_value("window_left (-1: no window)", window_left, -1)


def check_indptr(name: str, t, length: Optional[int] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.numel() < 1:
        raise InputError(f"{name} must be 1-D with batch + 1 entries, got shape {tuple(t.shape)}")
    if t.dtype != torch.int32:
        raise InputTypeError(f"{name} must be int32, got {dtype_name(t.dtype)}")
    if length is not None and t.numel() != length:
        raise InputError(f"{name} must have {length} entries, got {t.numel()}")
    return t


def host_lengths(name: str, indptr_host: torch.Tensor) -> torch.Tensor:
    """Segment lengths of a CSR indptr already on the host, validated."""
    ind = indptr_host.to(torch.int64)
    if int(ind[0]) != 0:
        raise InputError(f"{name}[0] must be 0, got {int(ind[0])}")
    lens = ind[1:] - ind[:-1]
    if bool((lens < 0).any()):
        bad = int(torch.nonzero(lens < 0)[0])
        raise InputError(f"{name} must be non-decreasing; {name}[{bad + 1}] < {name}[{bad}]")
    return lens


def unpack_mask(packed: torch.Tensor, offset: int, qo_len: int, kv_len: int) -> torch.Tensor:
    """Bool [qo_len, kv_len] from a little-endian packed segment starting at byte `offset`."""
    n = qo_len * kv_len
    nbytes = (n + 7) // 8
    b = packed[offset:offset + nbytes].to(torch.int32)
    bits = (b[:, None] >> torch.arange(8, device=b.device)[None, :]) & 1
    return bits.flatten()[:n].bool().view(qo_len, kv_len)


def to_float_scale(name: str, s) -> float:
    """A scale given as None (1.0), a number or a one-element tensor (read with .item(): on a GPU
    tensor that synchronises), as a finite float."""
    if s is None:
        return 1.0
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            raise InputError(f"{name} must be a float or a one-element tensor, got shape {tuple(s.shape)}")
        s = s.item()
    return checks.finite_float(name, s)
