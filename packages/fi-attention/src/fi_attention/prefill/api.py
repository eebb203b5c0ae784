"""single_prefill_with_kv_cache: attention of one request's queries over its KV (no paging).

Path: validate -> choose backend (fa3 / fa2 / reference) -> plan (cached per shape) -> launch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from fi_core import checks
from fi_core.errors import InputError, InputTypeError, UnsupportedError

from ..kv import check_kv_layout
from ..reference import attention_reference
from .backends import RUNNERS, SINGLE_PREFILL
from .common import (Q_DTYPES, check_heads, check_options, check_rows, check_tensor,
                     dtype_name, to_float_scale, unpack_mask)
from .. import options
from .launch import PrefillCall, make_schedule, plan_for_call
from .packbits import packbits

__all__ = ["single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse"]

# Partial-state workspace a single prefill may use for split-KV (allocated per call when needed).
_SINGLE_WORKSPACE_BYTES = 256 << 20


@functools.lru_cache(maxsize=256)
def _single_schedule(device, dtype, qo_len, kv_len, num_kv_heads, group, dqk, dvo, causal, window_left,
                     custom_mask, kv_dtype):
    plan = plan_for_call([qo_len], [kv_len], device=device, dtype=dtype, num_kv_heads=num_kv_heads,
                         group=group, head_dim_qk=dqk, head_dim_vo=dvo, paged=False, causal=causal,
                         window_left=window_left, workspace_bytes=_SINGLE_WORKSPACE_BYTES,
                         custom_mask=custom_mask, kv_dtype=kv_dtype)
    return plan, make_schedule(plan, device, None if plan.num_slots == 0 else _partials(plan, dvo, device),
                               dqk, dvo, non_blocking=False)


def _partials(plan, dvo, device):
    """fp32 storage for a plan's split-KV partial states (o and lse)."""
    return torch.empty(plan.num_slots * plan.cta_rows * (dvo + 1), dtype=torch.float32, device=device)


def _validate(q, k, v, kv_layout, custom_mask, packed_custom_mask, pos_encoding_mode, window_left,
              logits_soft_cap, o_dtype):
    check_tensor("q", q, 3, Q_DTYPES)
    check_tensor("k", k, 3)
    check_tensor("v", v, 3)
    check_kv_layout(kv_layout)
    if k.dtype != v.dtype:
        raise InputTypeError(f"k and v must have the same dtype, got {dtype_name(k.dtype)} and {dtype_name(v.dtype)}")
    if k.dtype not in Q_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2):
        raise InputTypeError(f"k/v must be float16, bfloat16 or float8, got {dtype_name(k.dtype)}")
    if not (q.device == k.device == v.device):
        raise InputError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    kn = k if kv_layout == "NHD" else k.transpose(0, 1)
    vn = v if kv_layout == "NHD" else v.transpose(0, 1)
    if kn.shape[:2] != vn.shape[:2]:
        raise InputError(f"k and v must agree in (kv_len, num_kv_heads), got {tuple(kn.shape)} and {tuple(vn.shape)}")
    if q.shape[2] != kn.shape[2]:
        raise InputError(f"q and k head_dim must match, got {q.shape[2]} and {kn.shape[2]}")
    if q.shape[2] < 1 or vn.shape[2] < 1:
        raise InputError(f"head_dim must be >= 1, got q/k {q.shape[2]} and v {vn.shape[2]}")
    check_heads(q.shape[1], kn.shape[1])
    check_options(pos_encoding_mode, window_left)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rows(name, t)
    lq, lkv = q.shape[0], kn.shape[0]
    if custom_mask is not None:
        check_tensor("custom_mask", custom_mask, 2, (torch.bool,))
        if tuple(custom_mask.shape) != (lq, lkv):
            raise InputError(f"custom_mask must be [qo_len, kv_len] = [{lq}, {lkv}], got {tuple(custom_mask.shape)}")
    if packed_custom_mask is not None:
        check_tensor("packed_custom_mask", packed_custom_mask, 1, (torch.uint8,))
        need = (lq * lkv + 7) // 8
        if packed_custom_mask.numel() < need:
            raise InputError(f"packed_custom_mask needs {need} bytes for a {lq} x {lkv} mask, "
                             f"got {packed_custom_mask.numel()}")
    if o_dtype is not None and checks.dtype_value("o_dtype", o_dtype, (*Q_DTYPES, torch.float32)) != q.dtype:
        raise UnsupportedError(f"o_dtype must be None or q.dtype ({dtype_name(q.dtype)}), got {o_dtype}")
    return kn, vn


def single_prefill_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_q=None,
                                 scale_k=None, scale_v=None, o_dtype=None,
                                 custom_mask: Optional[torch.Tensor] = None,
                                 packed_custom_mask: Optional[torch.Tensor] = None,
                                 causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                                 sm_scale: Optional[float] = None, window_left: int = -1,
                                 logits_soft_cap: Optional[float] = None,
                                 rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
                                 backend: str = "auto", return_lse: bool = False):
    """Prefill attention of one request: every query attends to the request's whole KV.

    Parameters
    ----------
    q : torch.Tensor
        ``[qo_len, num_qo_heads, head_dim_qk]``, float16 or bfloat16.
    k : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim_qk]`` (NHD) or ``[num_kv_heads, kv_len, head_dim_qk]`` (HND).
    v : torch.Tensor
        Same layout with ``head_dim_vo``.
    scale_q, scale_k, scale_v : float, optional
        Dequantisation scales (FP8): ``scale_q * scale_k`` folds into the softmax scale,
        ``scale_v`` multiplies the output.
    o_dtype : torch.dtype, optional
        Must be None or ``q.dtype``.
    custom_mask : torch.Tensor, optional
        Bool ``[qo_len, kv_len]`` (True = attend). Replaces ``causal`` when given (as FlashInfer).
    packed_custom_mask : torch.Tensor, optional
        The same mask flattened and packed with ``packbits(..., bitorder="little")`` (uint8).
    causal : bool
        Causal mask, aligned bottom-right when ``qo_len < kv_len``.
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    pos_encoding_mode : str
        ``"NONE"``, ``"ROPE_LLAMA"`` or ``"ALIBI"``.
    use_fp16_qk_reduction : bool
        Accepted for compatibility; accumulation is always fp32.
    sm_scale : float, optional
        Softmax scale, default ``1 / sqrt(head_dim_qk)``.
    window_left : int
        Sliding window (``-1`` = none): query at position p sees keys ``[p - window_left, p]``.
    logits_soft_cap : float, optional
        ``cap * tanh(logits / cap)`` when > 0.
    rope_scale, rope_theta : float, optional
        RoPE parameters (defaults 1 and 1e4).
    backend : str
        ``"auto"``, ``"fa2"`` or ``"fa3"``.
    return_lse : bool
        Also return the base-2 log-sum-exp.

    Returns
    -------
    out : torch.Tensor
        ``[qo_len, num_qo_heads, head_dim_vo]`` in ``q.dtype``.
    lse : torch.Tensor
        ``[qo_len, num_qo_heads]`` float32 (base 2), only when ``return_lse``.

    Examples
    --------
    >>> import torch
    >>> q = torch.randn(7, 8, 64, dtype=torch.bfloat16)
    >>> k = torch.randn(20, 2, 64, dtype=torch.bfloat16)
    >>> v = torch.randn(20, 2, 64, dtype=torch.bfloat16)
    >>> out, lse = single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([7, 8, 64]), torch.Size([7, 8]))

    See Also
    --------
    BatchPrefillWithRaggedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
    """
    kn, vn = _validate(q, k, v, kv_layout, custom_mask, packed_custom_mask, pos_encoding_mode,
                       window_left, logits_soft_cap, o_dtype)
    lq, hq, dqk = q.shape
    dvo = vn.shape[2]
    scale = (options.softmax_scale(sm_scale, dqk) * to_float_scale("scale_q", scale_q)
             * to_float_scale("scale_k", scale_k))
    v_mul = to_float_scale("scale_v", scale_v)
    if custom_mask is not None and packed_custom_mask is None:
        packed_custom_mask = packbits(custom_mask.flatten(), bitorder="little")
    if packed_custom_mask is not None and packed_custom_mask.device != q.device:
        packed_custom_mask = packed_custom_mask.to(q.device)  # the kernel reads it on q's device
    if packed_custom_mask is not None:
        causal = False  # FlashInfer: a custom mask replaces the causal mask
    out = torch.empty((lq, hq, dvo), dtype=q.dtype, device=q.device)
    lse = torch.empty((lq, hq), dtype=torch.float32, device=q.device) if return_lse else None
    cap = options.soft_cap(logits_soft_cap)
    rs, rt = options.rope_options(rope_scale, rope_theta)
    args = (out, lse, q, k, v, packed_custom_mask, bool(causal), kv_layout, pos_encoding_mode, scale, v_mul,
            int(window_left), cap, rs, rt, backend)
    if torch.compiler.is_compiling():
        torch.ops.fi_attention.single_prefill(*args)  # traced path: an opaque custom op
    else:
        _single_prefill_core(*args)
    return (out, lse) if return_lse else out


def single_prefill_with_kv_cache_return_lse(q, k, v, *args, **kwargs):
    """:func:`single_prefill_with_kv_cache` with ``return_lse=True``: returns ``(out, lse)``."""
    kwargs["return_lse"] = True
    return single_prefill_with_kv_cache(q, k, v, *args, **kwargs)


def _single_prefill_core(out, lse, q, k, v, packed_mask, causal, kv_layout, pos_encoding_mode, scale, v_scale,
                         window_left, soft_cap, rope_scale, rope_theta, backend) -> None:
    """Destination-passing core of single prefill (validated inputs): choose a backend, run it.
    ``v_scale`` multiplies the output (in the kernels' epilogues)."""
    kn = k if kv_layout == "NHD" else k.transpose(0, 1)
    vn = v if kv_layout == "NHD" else v.transpose(0, 1)
    lq, hq, dqk = q.shape
    lkv, hkv, dvo = kn.shape[0], kn.shape[1], vn.shape[2]
    choice = SINGLE_PREFILL.choose(
        device=q.device, dtype=q.dtype, requested=backend, head_dim_qk=dqk, head_dim_vo=dvo,
        kv_dtype=k.dtype, pos_encoding_mode=pos_encoding_mode, causal=causal, paged=False,
        custom_mask=packed_mask is not None, window_left=window_left,
        logits_soft_cap=soft_cap, qo_len=lq, kv_len=lkv)
    if choice.name == "reference":
        mask = unpack_mask(packed_mask, 0, lq, lkv) if packed_mask is not None else None
        o, ref_lse = attention_reference(q, kn, vn, causal=causal, sm_scale=scale, logits_soft_cap=soft_cap or None,
                                         window_left=window_left, pos_encoding_mode=pos_encoding_mode,
                                         rope_scale=rope_scale, rope_theta=rope_theta, custom_mask=mask,
                                         v_scale=v_scale if v_scale != 1.0 else None, return_lse=True)
        out.copy_(o)
        if lse is not None:
            lse.copy_(ref_lse)
        return
    if lq == 0:
        return
    call = PrefillCall(
        q=q, k=kn, v=vn, out=out, lse=lse, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=dqk,
        head_dim_vo=dvo, max_qo_len=lq, k_strides=(0, kn.stride(0), kn.stride(1)),
        v_strides=(0, vn.stride(0), vn.stride(1)), qo_len=lq, kv_len=lkv, causal=causal,
        window_left=window_left, sm_scale=scale, v_scale=v_scale, logits_soft_cap=soft_cap,
        pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta,
        packed_mask=packed_mask)
    if choice.name == "fa2":
        plan, sched = _single_schedule(q.device, q.dtype, lq, lkv, hkv, hq // hkv, dqk, dvo,
                                       bool(causal), int(window_left), packed_mask is not None, k.dtype)
        if plan.num_slots:  # fresh partial storage per call: concurrent streams never share it
            ws = _partials(plan, dvo, q.device)
            n_o = sched.tmp_o.numel()
            sched = dataclasses.replace(sched, tmp_o=ws[:n_o], tmp_lse=ws[n_o:])
        call.schedule = sched
    RUNNERS[choice.name](call)


@torch.library.custom_op("fi_attention::single_prefill", mutates_args=("out", "lse"))
def _single_prefill_op(out: torch.Tensor, lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, packed_mask: Optional[torch.Tensor], causal: bool, kv_layout: str,
                       pos_encoding_mode: str, scale: float, v_scale: float, window_left: int, soft_cap: float,
                       rope_scale: float, rope_theta: float, backend: str) -> None:
    _single_prefill_core(out, lse, q, k, v, packed_mask, causal, kv_layout, pos_encoding_mode, scale, v_scale,
                         window_left, soft_cap, rope_scale, rope_theta, backend)


@_single_prefill_op.register_fake
def _(out, lse, q, k, v, packed_mask, causal, kv_layout, pos_encoding_mode, scale, v_scale, window_left, soft_cap,
      rope_scale, rope_theta, backend) -> None:
    return None
