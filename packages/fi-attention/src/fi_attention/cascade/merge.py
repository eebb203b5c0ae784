"""merge_state, merge_state_in_place, merge_states: combine attention states over disjoint KV
sets (cascade / shared-prefix attention, split-KV). LSEs are base 2 (FlashInfer)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from fi_core import Arch, Backend, Entry, KernelSpec, OpInfo, arch_of, checks, load, register_op
from fi_core.dtypes import cuda_type, tag
from fi_core.errors import InputError, InputTypeError
from fi_core.launch import current_stream, on_device

from ..reference import merge_state_reference, merge_states_reference

_HERE = Path(__file__).resolve().parent
V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def merge_spec(dtype: torch.dtype, arch: Arch) -> KernelSpec:
    return KernelSpec(
        name=f"merge_states_{tag(dtype)}", sources=(_HERE / "merge.cu",), arch=arch,
        defines={"FI_T": cuda_type(dtype)},
        entries=(Entry("fi_merge_two", ("ptr", "i64", "i64", "ptr", "i64", "i64", "ptr", "i64", "i64",
                                        "ptr", "i64", "i64", "ptr", "i64", "i64", "ptr", "i64", "i64",
                                        "ptr", "i64", "i64", "i64", "stream")),
                 Entry("fi_merge_n", ("ptr", "i64", "i64", "i64", "ptr", "i64", "i64", "i64", "ptr",
                                      "ptr", "i64", "i64", "i64", "i64", "stream"))),
        package="fi_attention")


MERGE = register_op(OpInfo(
    name="merge_states", family="fi-attention", api="flashinfer.cascade.merge_state(s)",
    backends=(Backend("cuda", min_arch="8.0", dtypes=V_DTYPES),
              Backend("reference", devices=("cpu", "cuda"), notes="pure torch, fp32 math")),
    specs=lambda arch: [merge_spec(torch.bfloat16, arch)],
))


def _check_state(vn: str, v: torch.Tensor, sn: str, s: torch.Tensor, nd: int) -> None:
    for name, t in ((vn, v), (sn, s)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if v.dtype not in V_DTYPES:
        raise InputTypeError(f"{vn} must be float16, bfloat16 or float32, got {v.dtype}")
    if s.dtype != torch.float32:
        raise InputTypeError(f"{sn} must be float32 (base-2 LSE), got {s.dtype}")
    if v.dim() != nd or s.shape != v.shape[:-1]:
        raise InputError(f"{vn} must be {nd}-D and {sn} its shape without the last dim; got "
                         f"{vn} {tuple(v.shape)}, {sn} {tuple(s.shape)}")
    if v.stride(-1) != 1:
        raise InputError(f"{vn} must be contiguous in head_dim, got strides {v.stride()}")
    if s.device != v.device:
        raise InputError(f"{sn} must be on {vn}'s device {v.device}, got {s.device}")


def _use_cuda(v: torch.Tensor) -> bool:
    return v.device.type == "cuda" and MERGE.choose(v.device, v.dtype).name == "cuda"


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor):
    """Merge two attention states.

    Parameters
    ----------
    v_a, v_b : torch.Tensor
        ``[seq_len, num_heads, head_dim]`` float16/bfloat16/float32.
    s_a, s_b : torch.Tensor
        ``[seq_len, num_heads]`` float32 base-2 LSE.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        merged ``v`` (dtype of v_a) and ``s`` (float32).

    Examples
    --------
    >>> v, s = merge_state(torch.randn(3, 2, 8), torch.randn(3, 2), torch.randn(3, 2, 8), torch.randn(3, 2))
    >>> v.shape, s.shape
    (torch.Size([3, 2, 8]), torch.Size([3, 2]))
    """
    _check_state("v_a", v_a, "s_a", s_a, 3)
    _check_state("v_b", v_b, "s_b", s_b, 3)
    if v_a.shape != v_b.shape or v_a.dtype != v_b.dtype or v_a.device != v_b.device:
        raise InputError(f"v_a and v_b must match, got {v_a.dtype} {tuple(v_a.shape)} on {v_a.device} and "
                         f"{v_b.dtype} {tuple(v_b.shape)} on {v_b.device}")
    if not _use_cuda(v_a):
        return merge_state_reference(v_a, s_a, v_b, s_b)
    v = torch.empty_like(v_a, memory_format=torch.contiguous_format)
    s = torch.empty(s_a.shape, dtype=torch.float32, device=v_a.device)
    if torch.compiler.is_compiling():
        torch.ops.fi_attention.merge_state(v_a, s_a, v_b, s_b, v, s)
    else:
        _merge_two(v_a, s_a, v_b, s_b, v, s, None)
    return v, s


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor,
                         s_other: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place; rows where ``mask [seq_len]``
    (bool) is False are left unchanged. Shapes as in :func:`merge_state`."""
    _check_state("v", v, "s", s, 3)
    _check_state("v_other", v_other, "s_other", s_other, 3)
    if v.shape != v_other.shape or v.dtype != v_other.dtype or v.device != v_other.device:
        raise InputError(f"v and v_other must match, got {v.dtype} {tuple(v.shape)} on {v.device} and "
                         f"{v_other.dtype} {tuple(v_other.shape)} on {v_other.device}")
    if mask is not None and (checks.tensor("mask", mask).dtype != torch.bool or mask.shape != (v.shape[0],)
                             or mask.device != v.device):
        raise InputError(f"mask must be a bool tensor [{v.shape[0]}] on {v.device}, got {mask.dtype} "
                         f"{tuple(mask.shape)} on {mask.device}")
    if not _use_cuda(v):
        mv, ms = merge_state_reference(v, s, v_other, s_other)
        if mask is None:
            v.copy_(mv)
            s.copy_(ms)
        else:
            v[mask] = mv[mask]
            s[mask] = ms[mask]
        return
    if torch.compiler.is_compiling():
        torch.ops.fi_attention.merge_state_in_place(v, s, v_other, s_other, mask)
    else:
        _merge_two(v, s, v_other, s_other, v, s, mask)


def _merge_two(va, sa, vb, sb, vo, so, mask):
    mod = load(merge_spec(va.dtype, arch_of(va.device)))
    L, H, D = va.shape
    m = None if mask is None else mask.to(torch.uint8)
    with on_device(va.device):
        mod.fi_merge_two(va.data_ptr(), va.stride(0), va.stride(1), sa.data_ptr(), sa.stride(0), sa.stride(1),
                         vb.data_ptr(), vb.stride(0), vb.stride(1), sb.data_ptr(), sb.stride(0), sb.stride(1),
                         vo.data_ptr(), vo.stride(0), vo.stride(1), so.data_ptr(), so.stride(0), so.stride(1),
                         None if m is None else m.data_ptr(), L, H, D, current_stream(va.device))


def merge_states(v: torch.Tensor, s: torch.Tensor):
    """Merge ``N`` attention states per position.

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_states, num_heads, head_dim]``.
    s : torch.Tensor
        ``[seq_len, num_states, num_heads]`` float32 base-2 LSE.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``v [seq_len, num_heads, head_dim]``, ``s [seq_len, num_heads]``.
    """
    _check_state("v", v, "s", s, 4)
    if not _use_cuda(v):
        return merge_states_reference(v, s)
    L, N, H, D = v.shape
    vo = torch.empty((L, H, D), dtype=v.dtype, device=v.device)
    so = torch.empty((L, H), dtype=torch.float32, device=v.device)
    if torch.compiler.is_compiling():
        torch.ops.fi_attention.merge_states(v, s, vo, so)
    else:
        _merge_n(v, s, vo, so)
    return vo, so


def _merge_n(v, s, vo, so):
    L, N, H, D = v.shape
    mod = load(merge_spec(v.dtype, arch_of(v.device)))
    with on_device(v.device):
        mod.fi_merge_n(v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), s.data_ptr(), s.stride(0),
                       s.stride(1), s.stride(2), vo.data_ptr(), so.data_ptr(), L, N, H, D,
                       current_stream(v.device))


# ---- torch custom ops (torch.compile traces through these; eager calls skip the dispatcher) ----

@torch.library.custom_op("fi_attention::merge_state", mutates_args=("v_out", "s_out"))
def _merge_state_op(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                    v_out: torch.Tensor, s_out: torch.Tensor) -> None:
    _merge_two(v_a, s_a, v_b, s_b, v_out, s_out, None)


@_merge_state_op.register_fake
def _(v_a, s_a, v_b, s_b, v_out, s_out) -> None:
    return None


@torch.library.custom_op("fi_attention::merge_state_in_place", mutates_args=("v", "s"))
def _merge_state_in_place_op(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor,
                             s_other: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
    _merge_two(v, s, v_other, s_other, v, s, mask)


@_merge_state_in_place_op.register_fake
def _(v, s, v_other, s_other, mask) -> None:
    return None


@torch.library.custom_op("fi_attention::merge_states", mutates_args=("v_out", "s_out"))
def _merge_states_op(v: torch.Tensor, s: torch.Tensor, v_out: torch.Tensor, s_out: torch.Tensor) -> None:
    _merge_n(v, s, v_out, s_out)


@_merge_states_op.register_fake
def _(v, s, v_out, s_out) -> None:
    return None
