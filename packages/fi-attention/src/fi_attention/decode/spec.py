"""Kernel specs of batch/single decode: one module per (q dtype, kv dtype, head_dim, query heads
per CTA, position encoding, soft cap)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

_HERE = Path(__file__).resolve().parent

POS_CODES = {"NONE": 0, "ROPE_LLAMA": 1, "ALIBI": 2}
HEAD_DIMS = (64, 128, 256)
# Memory-parallelism variant of the tensor-core kernel (FI_MMA_VARIANT in decode_mma.cu) and the
# ring depth of variant 3 (FI_MMA_STAGES, 0 = sized by the source). None = per GPU and cache dtype (see
# mma_variant). Changed only by the decode bench routine (options mma_variant=N, mma_stages=N) for
# A/B runs and by the GPU tests of the variants.
MMA_VARIANT = None
MMA_STAGES = 0
# FI_PAGE_AHEAD of the register-tile variant (bench option page_ahead=0|1); None = the source's 1.
PAGE_AHEAD = None
# Extra -D switches of the tensor-core kernel ({"FI_NAME": value}), for A/B builds of
# tools/ab_decode.py only; empty in normal use.
MMA_AB: dict = {}
# Measured on the H200 (GQA 32/8, b128 x kv8192, 2026-11-30): fp8 e4m3 KV 547.9 us with the shared-
# memory ring (variant 3) against 638.2 us with register tiles (variant 0); bf16 KV 1105.8 us against
# 1002.5 us, so 16-bit caches kept variant 0. Session 9, with whole-line ring copies (decode_mma.cu):
# bf16 on the ring 1020.4 us against 983.4 for variant 0 in the same run (decode_ab_copy_session9.json).
# Those rings on 16-bit caches ran 3 CTAs per SM at 168 registers (spilling). Session 11: the ring
# built for 2 CTAs per SM (FI_MMA_CTAS=2: 240 registers, no spills), each kernel under the planner's
# plan for its own residency, in turns (tools/ab_decode.py, decode_ab_ring_ctas2_long_session11.json):
# b1 x 32768 40.03 -> 38.73 us, b16 x 8192 131.08 -> 127.00, b64 x 4096 248.73 -> 242.52, b128 x 8192
# 971.42 -> 945.77, b256 x 2048 486.96 -> 477.93, b32 x 4096 130.16 -> 125.53, b8 x 4096 39.62 -> 39.32
# (session 10 had measured it only on short steps: x1.10-1.17). So sm_90 streams every cache through
# the ring. Other GPUs keep register tiles for 16-bit caches: not measured there, and the 64 KB ring
# of a bf16 head_dim-128 CTA would leave an sm_86 / sm_89 SM (100 KB of shared memory) one CTA.
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# fi_plan_decode (decode_planner.h, host code in every decode module): config, indptr, last_page_len,
# batch, fixed_chunk, disable_split, capacity, out, out_len, info.
PLAN_DECODE_ARGS = ("ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "ptr", "i64", "ptr")
# fi_plan_decode_staged: config, indptr, last_page_len, batch, num_indices, indices, fixed_chunk,
# disable_split, capacity, out, out_len, info.
PLAN_DECODE_STAGED_ARGS = ("ptr", "ptr", "ptr", "i64", "i64", "ptr", "i64", "i64", "i64", "ptr", "i64", "ptr")
# fi_copy_tables (decode_common.cuh): three (dst, src, bytes) device-to-device copies, stream.
COPY_TABLES_ARGS = ("ptr", "ptr", "i64") * 3 + ("stream",)


def mma_variant(kv_dtype: torch.dtype, arch: Arch) -> int:
    """The tensor-core kernel variant: MMA_VARIANT if set, else the ring (3) for fp8 caches and
    on sm_90, register tiles (0) for 16-bit caches elsewhere."""
    if MMA_VARIANT is not None:
        return MMA_VARIANT
    return 3 if kv_dtype in _FP8 or arch.major >= 9 else 0


# CTAs per SM (FI_MMA_CTAS) of the ring on a 16-bit cache: at the source's default of 3 its 168
# registers spilled 24 bytes (see the history above); fp8 caches and register tiles keep 3.
RING_16BIT_CTAS = 2


def heads_per_cta(group: int) -> int:
    """Largest divisor of the GQA group that is <= 8: every query head of a CTA shares each K/V
    row it loads; more than 8 would need more than 255 registers for q and o."""
    for gh in range(min(group, 8), 0, -1):
        if group % gh == 0:
            return gh
    return 1


def _decode_module(kind: str, source: str, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
                   gh: int, pos_encoding_mode: str, soft_cap: bool, arch: Arch,
                   extra: dict | None = None) -> KernelSpec:
    """The two decode kernels share their launcher ABI and build defines; only the source differs."""
    pos = POS_CODES[pos_encoding_mode]
    extra = extra or {}
    suffix = "".join(f"_{k.lower().replace('fi_', '')}{v}" for k, v in sorted(extra.items()))
    return KernelSpec(
        name=f"{kind}_{tag(q_dtype)}_{tag(kv_dtype)}_d{head_dim}_gh{gh}_p{pos}_c{int(soft_cap)}{suffix}",
        sources=(_HERE / source,),
        arch=arch,
        defines={"FI_Q": cuda_type(q_dtype), "FI_KV": cuda_type(kv_dtype), "FI_HEAD_DIM": head_dim,
                 "FI_GH": gh, "FI_POS": pos, "FI_SOFTCAP": int(soft_cap), **extra},
        entries=(Entry("fi_batch_decode", ("ptr",)),
                 Entry("fi_batch_decode_occupancy", ("ptr",)),
                 Entry("fi_plan_decode", PLAN_DECODE_ARGS),
                 Entry("fi_plan_decode_staged", PLAN_DECODE_STAGED_ARGS),
                 Entry("fi_copy_tables", COPY_TABLES_ARGS)),
        package="fi_attention",
    )


@functools.cache
def decode_spec(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, gh: int,
                pos_encoding_mode: str, soft_cap: bool, arch: Arch) -> KernelSpec:
    """CUDA-core kernel (decode.cu): every case."""
    return _decode_module("batch_decode", "decode.cu", q_dtype, kv_dtype, head_dim, gh,
                          pos_encoding_mode, soft_cap, arch)


# Whether the default ("auto") decode path uses the tensor-core kernel where it applies. The
# CUDA-core kernel stays available (backend="cuda-core") and serves every other case.
TENSOR_CORE_DEFAULT = True
# Query heads per CTA from which "auto" takes the tensor-core kernel. With one head (MHA) the
# MMA uses 1 of its 8 columns and the CUDA-core kernel needs few instructions per K/V row: H200,
# MHA 32/32 b64 kv4096 measured 970 us on CUDA cores vs 1096 us on tensor cores; GQA 32/8
# (4 heads per CTA) measured 1080 us on tensor cores vs 1402 us on CUDA cores.
TENSOR_CORE_MIN_GH = 2
# ... except for small MHA grids on sm_90 with a 16-bit cache: at most this many (request, kv head)
# units, the ring (two CTAs per SM with 64 KB in flight each) streams much faster than the
# CUDA-core kernel. tools/ab_decode.py in turns, default (CUDA-core) against use_tensor_cores=True
# (the ring), H200 (decode_ab_mha_ring_session20.json): 1 x 32768 (32 units) x1.364, 8 x 2048
# (256) x1.275, 16 x 8192 (512) x1.001, 128 x 2048 (4096) x1.008, 64 x 4096 (2048) x0.982,
# ragged 32 x <=8192 x1.003 and 64 x <=4096 x0.999. 512 = two waves of unsplit ring CTAs.
# With an fp8 cache the ring wins at every size (the CUDA-core kernel's fp8 MHA path reached
# 1.7-3.2 TB/s): 1 x 32768 x1.901, 8 x 2048 x1.746, 16 x 8192 x1.577, 64 x 4096 x1.298 (516.71
# against 670.62 us, decode_ab_mha_fp8_ring_session20.json), so sm_90 MHA on fp8 caches always
# takes it.
MHA_RING_MAX_UNITS = 512


def small_mha_grid(num_qo_heads: int, num_kv_heads: int, batch: int) -> bool:
    """A batch that select_spec may give the ring although it is MHA (see MHA_RING_MAX_UNITS)."""
    return (type(num_kv_heads) is int and num_qo_heads == num_kv_heads and type(batch) is int
            and batch * num_kv_heads <= MHA_RING_MAX_UNITS)


def tensor_core_eligible(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, gh: int,
                         pos_encoding_mode: str) -> bool:
    """decode_mma.cu covers head_dim 64/128, <= 8 query heads per CTA, no RoPE, and a 16-bit cache
    of q's dtype or an fp8 cache."""
    fp8 = kv_dtype in _FP8
    return (head_dim in (64, 128) and gh <= 8 and pos_encoding_mode != "ROPE_LLAMA"
            and (fp8 or kv_dtype == q_dtype))


@functools.cache
def decode_mma_spec(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, gh: int,
                    pos_encoding_mode: str, soft_cap: bool, arch: Arch, variant: int | None = None,
                    ctas: int | None = None) -> KernelSpec:
    """Tensor-core kernel (decode_mma.cu): see tensor_core_eligible. ``variant``: FI_MMA_VARIANT
    (default: mma_variant's choice); ``ctas``: FI_MMA_CTAS, the most CTAs per SM the kernel's launch
    bound allows (default: RING_16BIT_CTAS for the ring on a 16-bit cache, else the source's 3)."""
    if variant is None:
        variant = mma_variant(kv_dtype, arch)
    if ctas is None and variant == 3 and kv_dtype not in _FP8:
        ctas = RING_16BIT_CTAS
    extra = {"FI_MMA_VARIANT": variant} if variant else {}
    if ctas is not None:
        extra["FI_MMA_CTAS"] = ctas
    if MMA_STAGES:
        extra["FI_MMA_STAGES"] = MMA_STAGES
    if PAGE_AHEAD is not None:
        extra["FI_PAGE_AHEAD"] = int(PAGE_AHEAD)
    extra.update(MMA_AB)
    return _decode_module("batch_decode_mma", "decode_mma.cu", q_dtype, kv_dtype, head_dim, gh,
                          pos_encoding_mode, soft_cap, arch, extra or None)


def _tensor_cores(q_dtype, kv_dtype, head_dim, gh, pos_encoding_mode, kernel, arch, small_mha) -> bool:
    eligible = tensor_core_eligible(q_dtype, kv_dtype, head_dim, gh, pos_encoding_mode)
    if not eligible or kernel == "cuda-core":
        return False
    if kernel == "tensor-core":
        return True
    ring_mha = gh == 1 and arch.major >= 9 and (kv_dtype in _FP8 or (small_mha and kv_dtype == q_dtype))
    return TENSOR_CORE_DEFAULT and (gh >= TENSOR_CORE_MIN_GH or ring_mha)


def select_spec(q_dtype, kv_dtype, head_dim, group, pos_encoding_mode, soft_cap, arch,
                kernel: str = "auto", small_mha: bool = False) -> KernelSpec:
    """The decode module for a call. kernel: "auto", "tensor-core" (if eligible) or "cuda-core";
    small_mha: the batch is a small MHA grid (small_mha_grid), which "auto" runs on the ring on
    sm_90 with a 16-bit cache (MHA on an fp8 cache takes the ring there at any size)."""
    gh = heads_per_cta(group)
    tc = _tensor_cores(q_dtype, kv_dtype, head_dim, gh, pos_encoding_mode, kernel, arch, small_mha)
    make = decode_mma_spec if tc else decode_spec
    return make(q_dtype, kv_dtype, head_dim, gh, pos_encoding_mode, soft_cap, arch)


def representative_specs(arch: Arch) -> list[KernelSpec]:
    return [decode_spec(torch.bfloat16, torch.bfloat16, 128, 4, "NONE", False, arch),
            decode_spec(torch.bfloat16, torch.float8_e4m3fn, 128, 4, "NONE", False, arch),
            decode_mma_spec(torch.bfloat16, torch.bfloat16, 128, 4, "NONE", False, arch),
            decode_mma_spec(torch.bfloat16, torch.float8_e4m3fn, 128, 4, "NONE", False, arch)]
