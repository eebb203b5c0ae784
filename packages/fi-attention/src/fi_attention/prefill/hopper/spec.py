"""KernelSpecs of the Hopper (sm_90a) FA3-style prefill kernel: one module per
(dtype, head_dim, causal), so each builds in its own nvcc process."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from fi_core import Arch, Entry, KernelSpec, knobs
from fi_core.dtypes import tag

_HERE = Path(__file__).resolve().parent

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)

RAGGED_ENTRY = Entry(
    "fi_prefill_sm90_ragged",
    ("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr",  # q k v qo_indptr kv_indptr o lse
     "i64", "i64", "i64", "i64",                        # nnz_q nnz_kv num_qo_heads num_kv_heads
     "i64", "i64", "i64", "i64", "i64", "i64", "i64", "i64",  # q/k/v/o token and head strides
     "i64", "i64", "f32", "f32", "i64",                 # batch max_qo_len sm_scale softcap window_left
     "i64", "stream"),                                  # max_ctas (FI_FA3_CTAS knob) stream
)

PAGED_ENTRY = Entry(
    "fi_prefill_sm90_paged",
    ("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr",  # q k v qo_indptr kv_indptr kv_indices last_page_len
     "ptr", "ptr", "i64", "i64", "i64",                 # o lse nnz_q num_pages page_size
     "i64", "i64", "i64", "i64",                        # num_qo_heads num_kv_heads q strides (token, head)
     "i64", "i64", "i64", "i64", "i64", "i64",          # k/v strides (page, token, head)
     "i64", "i64",                                      # o strides
     "i64", "i64", "f32", "f32", "i64",                 # batch max_qo_len sm_scale softcap window_left
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


def use_multicast(head_dim: int, num_qo_heads: int, num_kv_heads: int) -> bool:
    """Whether a call runs the multicast module: with FI_FA3_MULTICAST=1 (off by default, see
    prefill_sm90.cu kMcast for the H200 measurements), head_dim 128 and an even GQA group (the
    pair's query heads 2h, 2h + 1 then share a KV head)."""
    return (head_dim == MULTICAST_HEAD_DIM and (num_qo_heads // num_kv_heads) % 2 == 0
            and knobs.fa3_multicast())


# KV tile rows of the kernel (kBlockN in prefill_sm90.cu); paged page sizes must tile it.
def kv_tile(head_dim: int) -> int:
    return 128 if head_dim <= 128 else 80


@functools.cache
def prefill_sm90_spec(dtype: torch.dtype, head_dim: int, causal: bool, arch, paged: bool = False,
                      softcap: bool = False, multicast: bool = False) -> KernelSpec:
    """The module for one (dtype, head_dim, causal, paged, softcap, multicast); ``arch`` must be
    9.0a. ``multicast`` (head_dim 128 only): 2-CTA clusters share K/V tiles by TMA multicast
    (FI_FA3_MCAST in prefill_sm90.cu); such a module serves only even GQA groups (see
    ``use_multicast``)."""
    if dtype not in DTYPES:
        raise ValueError(f"fa3 prefill supports bfloat16/float16, got {dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"fa3 prefill supports head_dim {HEAD_DIMS}, got {head_dim}")
    if multicast and head_dim != MULTICAST_HEAD_DIM:
        raise ValueError(f"fa3 multicast needs head_dim {MULTICAST_HEAD_DIM}, got {head_dim}")
    arch = Arch.parse(arch)
    layout = "paged" if paged else "ragged"
    mask = "causal" if causal else "full"
    defines = {}
    if VARIANT is not None:
        defines["FI_FA3_VARIANT"] = str(VARIANT)
    return KernelSpec(
        name=(f"prefill_sm90_{layout}_{tag(dtype)}_d{head_dim}_{mask}{'_softcap' if softcap else ''}"
              + ("_mc" if multicast else "") + (f"_v{VARIANT}" if VARIANT is not None else "")),
        sources=(_HERE / "prefill_sm90.cu",),
        arch=arch,
        defines={
            "FI_DTYPE_BF16": "1" if dtype == torch.bfloat16 else "0",
            "FI_HEAD_DIM": str(head_dim),
            "FI_CAUSAL": "1" if causal else "0",
            "FI_PAGED": "1" if paged else "0",
            "FI_SOFTCAP": "1" if softcap else "0",
            **({"FI_FA3_MCAST": "1"} if multicast else {}),
            **defines,
        },
        entries=(PAGED_ENTRY if paged else RAGGED_ENTRY,),
        cutlass=True,
        package="fi_attention",
    )
