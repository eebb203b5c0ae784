"""Validation and option handling shared by single and batch decode."""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import Backend, OpInfo, checks, register_op
from fi_core.errors import InputError, InputTypeError

from ..options import rope_options, soft_cap, softmax_scale  # noqa: F401 (shared with prefill)
from .spec import HEAD_DIMS, POS_CODES, representative_specs

Q_DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _cuda_check(facts: dict) -> Optional[str]:
    d = facts.get("head_dim")
    if d is not None and d not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS}, got {d}"
    kv = facts.get("kv_dtype")
    if kv is not None and kv not in KV_DTYPES:
        return f"KV cache dtype {kv} is not supported"
    return None


BATCH_DECODE = register_op(OpInfo(
    name="batch_decode_with_paged_kv_cache", family="fi-attention",
    api="flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper",
    backends=(
        Backend("cuda", min_arch="8.0", dtypes=Q_DTYPES, check=_cuda_check,
                notes="CUDA cores, all query heads of a GQA group per CTA, split-KV + merge; "
                      "head_dim 64/128/256; KV fp16/bf16/fp8"),
        Backend("reference", devices=("cpu", "cuda"), notes="pure torch, fp32 math"),
    ),
    specs=representative_specs,
))

SINGLE_DECODE = register_op(OpInfo(
    name="single_decode_with_kv_cache", family="fi-attention",
    api="flashinfer.decode.single_decode_with_kv_cache",
    backends=BATCH_DECODE.backends,
    specs=representative_specs,
))


def pos_mode(pos_encoding_mode: str) -> str:
    if pos_encoding_mode not in POS_CODES:
        raise InputError(f"pos_encoding_mode must be one of {tuple(POS_CODES)}, got {pos_encoding_mode!r}")
    return pos_encoding_mode


def heads(num_qo_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads <= 0 or num_qo_heads <= 0:
        raise InputError(f"head counts must be positive, got num_qo_heads={num_qo_heads}, "
                         f"num_kv_heads={num_kv_heads}")
    if num_qo_heads % num_kv_heads:
        raise InputError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    return num_qo_heads // num_kv_heads


def scale_value(name: str, x) -> float:
    """A calibration/softmax scale as a Python float without a device synchronisation."""
    if x is None:
        return 1.0
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise InputError(f"{name} must be a scalar, got a tensor of shape {tuple(x.shape)}")
        if x.device.type != "cpu":
            raise InputTypeError(f"{name} must be a Python float or a CPU scalar tensor (reading a "
                                 f"device tensor would synchronise), got a tensor on {x.device}")
        x = x.item()
    return checks.finite_float(name, x)

