"""KernelSpecs of the Hopper (sm_90a) FA3-style prefill kernel: one module per
(dtype, head_dim, causal), so each builds in its own nvcc process."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch
from fi_core import Arch, Entry, KernelSpec, knobs
from fi_core.dtypes import tag

_HERE = Path(__file__).resolve().parent

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
# fp8 K/V caches (widened to the q dtype in shared memory, FI_KV_FP8 in prefill_sm90.cu): the
# value of FI_KV_FP8 per dtype, and the head dims it is built for.
FP8_KV = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
FP8_HEAD_DIMS = (64, 128)

RAGGED_ENTRY = Entry(
    "fi_prefill_sm90_ragged",
    ("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr",  # q k v qo_indptr kv_indptr o lse
     "i64", "i64", "i64", "i64",                        # nnz_q nnz_kv num_qo_heads num_kv_heads
     "i64", "i64", "i64", "i64", "i64", "i64", "i64", "i64",  # q/k/v/o token and head strides
     "i64", "i64", "f32", "f32", "f32", "i64",          # batch max_qo_len sm_scale softcap v_scale window_left
     "ptr", "ptr",                                      # mask mask_indptr (custom-mask modules; else NULL)
     "i64", "stream"),                                  # max_ctas (FI_FA3_CTAS knob) stream
)

PAGED_ENTRY = Entry(
    "fi_prefill_sm90_paged",
    ("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr",  # q k v qo_indptr kv_indptr kv_indices last_page_len
     "ptr", "ptr", "i64", "i64", "i64",                 # o lse nnz_q num_pages page_size
     "i64", "i64", "i64", "i64",                        # num_qo_heads num_kv_heads q strides (token, head)
     "i64", "i64", "i64", "i64", "i64", "i64",          # k/v strides (page, token, head)
     "i64", "i64",                                      # o strides
     "i64", "i64", "f32", "f32", "f32", "i64",          # batch max_qo_len sm_scale softcap v_scale window_left
     "ptr", "ptr",                                      # mask mask_indptr (custom-mask modules; else NULL)
     "i64", "stream"),                                  # max_ctas (FI_FA3_CTAS knob) stream
)

# Experimental schedule of the kernel (FI_FA3_VARIANT in prefill_sm90.cu; its meaning is defined
# there, now: bit 2 = ping-pong between the consumer warpgroups on, bit 64 = Q K^T SS instead of RS
# at d = 64 and 128). None = the shipped kernel.
# Changed only by the prefill bench routines (option variant=N) and tools/ab_fa3.py for A/B runs.
VARIANT = None


# K/V multicast over 2-CTA clusters (prefill_sm90.cu, FI_FA3_MCAST): d = 128 only, where each CTA
# of a pair loads one of the two 64-column boxes of a tile.
MULTICAST_HEAD_DIM = 128


# FI_FA3_MULTICAST=auto takes the multicast module for launches of at least this much attention
# work (2 (d_qk + d_vo) FLOPs per visible (query, key) pair and query head): about 1.6 ms at the
# kernel's rate, long enough to run at the H200's 700 W cap, where sharing K/V tiles costs less
# energy per tile and the SM clock rises. Bench routines (causal, 32/8 heads), multicast against
# not, same machine (benchmarks/notes.md, sessions 24-25): L = 16384 (2.2e12 FLOPs) +1.5, +1.0,
# +4.4, -1.0, -0.5, +0.7 % (the power limiter sets in during its 2 s of replays: medians jump),
# L = 32768 +1.3, +1.1, +0.7, +1.2, +1.9 %; L = 4096 -1.4, -0.9 %, L = 8192 (5.5e11) -0.4 %, paged
# 16 x 2048 (5.5e11) -0.8, +1.2 %. Runs of one module differ by up to 2 %.
MULTICAST_MIN_FLOPS = 1.0e12


def visible_pairs(qo_len: int, kv_len: int, causal: bool, window_left: int = -1) -> int:
    """(query, key) pairs one query head of a request attends to: all of them, or under the
    bottom-right aligned causal mask sum over rows i of clamp(i + kv_len - qo_len + 1, 0, kv_len);
    a sliding window caps each row at window_left + 1 keys (applied to the total)."""
    qo, kv = int(qo_len), int(kv_len)
    if qo <= 0 or kv <= 0:
        return 0
    if not causal:
        pairs = qo * kv
    elif qo <= kv:
        pairs = qo * kv - qo * (qo - 1) // 2
    else:  # the first qo - kv rows see no key
        pairs = kv * (kv + 1) // 2
    return min(pairs, qo * (window_left + 1)) if window_left is not None and window_left >= 0 else pairs


def batch_visible_pairs(qo_lens: torch.Tensor, kv_lens: torch.Tensor, causal: bool, window_left: int = -1) -> int:
    """visible_pairs summed over a batch (host int tensors of per-request lengths), vectorised."""
    qo, kv = qo_lens.to(torch.int64).clamp(min=0), kv_lens.to(torch.int64).clamp(min=0)
    if causal:
        pairs = torch.where(qo <= kv, qo * kv - qo * (qo - 1) // 2, kv * (kv + 1) // 2)
    else:
        pairs = qo * kv
    pairs = torch.where((qo > 0) & (kv > 0), pairs, torch.zeros_like(pairs))
    if window_left is not None and window_left >= 0:
        pairs = torch.minimum(pairs, qo * (window_left + 1))
    return int(pairs.sum())


def use_multicast(head_dim: int, num_qo_heads: int, num_kv_heads: int, flops: Optional[float] = None) -> bool:
    """Whether a call runs the multicast module: only at head_dim 128 with an even GQA group (the
    pair's query heads 2h, 2h + 1 then share a KV head); then as FI_FA3_MULTICAST says: 1 / 0, or
    auto (the default): when the launch's attention work ``flops`` is at least
    MULTICAST_MIN_FLOPS (unknown work: no)."""
    if head_dim != MULTICAST_HEAD_DIM or num_kv_heads <= 0 or (num_qo_heads // num_kv_heads) % 2:
        return False
    mode = knobs.fa3_multicast()
    if mode is not None:
        return mode
    return flops is not None and flops >= MULTICAST_MIN_FLOPS


# Custom-mask consumers (ptxas, nvcc 13.0): d = 64 spill-free; d = 128 28 bytes, 52 with a soft cap
# too; d = 256 36 bytes (its consumers hold a 64x256 O at 240 registers), 72 in the paged module.
# Measured with the spills on the H200 (custom_mask_prefill routine, random mask, L = 4096, session
# 32): 1.48x / 1.82x / 2.24x the fa2 kernel and 1.27x / 1.65x / 2.12x torch SDPA at d = 64 / 128 /
# 256; with a soft cap (session 33) 1.23x / 1.66x / 2.21x fa2. At d = 128 the spill-free form (Q K^T
# SS, Q read from shared memory: FI_FA3_VARIANT=64) is slower in turns (tools/ab_fa3.py, 9 rounds,
# prefill_fa3_ab_session33_mask_ss.json): x0.985 with the mask alone, x0.936 with a soft cap too.
# The compile check allows these budgets (bytes, keyed by head_dim and soft cap), no more.
MASK_SPILL_BUDGET = {(128, False): 32, (128, True): 56, (256, False): 80, (256, True): 80}
# fp8 K/V modules (ptxas, nvcc 13.0, session 47's build): the producer warpgroup, at its 40
# registers, keeps some tile-loop state in local memory (stored and loaded per KV tile or work
# tile, not in the widening loop): 28 bytes of spill stores / loads in the paged d = 128 modules
# (4 ragged), 92 with a soft cap (paged; 48 ragged), 32 with a custom mask and 56 with both
# (ragged; paged masked fp8 modules not measured); d = 64 none. Since session 51's epilogue
# (16-byte stores after a transpose in each quad of lanes) the paged d = 128 fp8 modules spill 48
# bytes: the extra 20 are five per-thread constants of the consumer warpgroups, stored once at the
# kernel's start and reloaded once per work tile (outside the KV loop); ragged 24, soft cap 40.
# Session 52 (the epilogue under the next tile's second Q K^T, its stores predicated): paged
# d = 128 28 again, ragged 4, soft cap 44 / 60 (stores / loads); the budget stays at 48.
# Keyed by (softcap, custom_mask).
FP8_SPILL_BUDGET = {(False, False): 48, (True, False): 92, (False, True): 32, (True, True): 56}


# KV tile rows of the kernel (kBlockN in prefill_sm90.cu); paged page sizes must tile it.
def kv_tile(head_dim: int) -> int:
    return 128 if head_dim <= 128 else 80


@functools.cache
def prefill_sm90_spec(dtype: torch.dtype, head_dim: int, causal: bool, arch, paged: bool = False,
                      softcap: bool = False, multicast: bool = False, custom_mask: bool = False,
                      kv_dtype: Optional[torch.dtype] = None) -> KernelSpec:
    """The module for one (dtype, head_dim, causal, paged, softcap, multicast, custom_mask,
    kv_dtype); ``arch`` must be 9.0a. ``multicast`` (head_dim 128 only): 2-CTA clusters share K/V
    tiles by TMA multicast (FI_FA3_MCAST in prefill_sm90.cu); such a module serves only even GQA
    groups (see ``use_multicast``). ``custom_mask``: packed boolean masks (FI_CUSTOM_MASK; a custom
    mask replaces causality, so such a module is never causal). ``kv_dtype``: None or ``dtype``
    (16-bit K/V), or fp8 e4m3 / e5m2 at head_dim 64 / 128 (no multicast)."""
    if dtype not in DTYPES:
        raise ValueError(f"fa3 prefill supports bfloat16/float16, got {dtype}")
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if kv_dtype != dtype and (kv_dtype not in FP8_KV or head_dim not in FP8_HEAD_DIMS or multicast):
        raise ValueError(f"fa3 prefill takes k/v of q's dtype, or fp8 e4m3/e5m2 at head_dim {FP8_HEAD_DIMS} "
                         f"without multicast; got {kv_dtype} at head_dim {head_dim}, multicast={multicast}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"fa3 prefill supports head_dim {HEAD_DIMS}, got {head_dim}")
    if multicast and head_dim != MULTICAST_HEAD_DIM:
        raise ValueError(f"fa3 multicast needs head_dim {MULTICAST_HEAD_DIM}, got {head_dim}")
    if custom_mask and causal:
        raise ValueError("a custom mask replaces the causal mask: custom_mask modules are not causal")
    arch = Arch.parse(arch)
    layout = "paged" if paged else "ragged"
    mask = "mask" if custom_mask else "causal" if causal else "full"
    defines = {}
    if VARIANT is not None:
        defines["FI_FA3_VARIANT"] = str(VARIANT)
    return KernelSpec(
        name=(f"prefill_sm90_{layout}_{tag(dtype)}_d{head_dim}_{mask}{'_softcap' if softcap else ''}"
              + ("_mc" if multicast else "") + (f"_kv{tag(kv_dtype)}" if kv_dtype != dtype else "")
              + (f"_v{VARIANT}" if VARIANT is not None else "")),
        sources=(_HERE / "prefill_sm90.cu",),
        arch=arch,
        defines={
            "FI_DTYPE_BF16": "1" if dtype == torch.bfloat16 else "0",
            "FI_HEAD_DIM": str(head_dim),
            "FI_CAUSAL": "1" if causal else "0",
            "FI_PAGED": "1" if paged else "0",
            "FI_SOFTCAP": "1" if softcap else "0",
            **({"FI_CUSTOM_MASK": "1"} if custom_mask else {}),
            **({"FI_FA3_MCAST": "1"} if multicast else {}),
            **({"FI_KV_FP8": str(FP8_KV[kv_dtype])} if kv_dtype != dtype else {}),
            **defines,
        },
        entries=(PAGED_ENTRY if paged else RAGGED_ENTRY,),
        cutlass=True,
        package="fi_attention",
        spill_budget=max(MASK_SPILL_BUDGET.get((head_dim, softcap), 0) if custom_mask else 0,
                         FP8_SPILL_BUDGET[(softcap, custom_mask)] if kv_dtype != dtype else 0),
    )
