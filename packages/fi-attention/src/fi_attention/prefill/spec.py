"""KernelSpecs of the portable fa2 prefill kernel: one module per (dtype, head dims, KV layout,
mask/variant flags, tile config, arch)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

_HERE = Path(__file__).resolve().parent

# (warps, 16-row mma blocks per warp, kv tile) by the larger head dim; CTA rows = 16 * warps *
# m_tiles; shared memory = Q tile + 2 stages of (K, V) tiles.
# d <= 128: 4 warps x 32 rows: every K/V fragment read from shared memory feeds two mma row
# blocks, halving shared-memory traffic per FLOP against 16 rows per warp (the limit of
# mma.sync attention). d = 128 takes kv tiles of 64 (FlashAttention-2's 128 x 64): one barrier
# and one softmax reduction per 64 keys, Q fragments re-read once per 64 keys. Its o (128) + s (64)
# fp32 accumulators fill 255 registers with 0 spills only because the kernel keeps item scalars
# in shared memory and recomputes ldmatrix addresses per tile; 255 x 128 threads fit 2 CTAs per
# SM, 2 x 96 KiB of shared memory too (sm_90; sm_80: 1 CTA; sm_86/89: 96 KiB <= 99 KiB).
# d = 256 / 192: 4 warps x 16 rows keep the o accumulator within 255 registers, and kv tiles
# of 32 keep Q + 2 x (K + V) <= 96 KiB, inside sm_86/89's 99 KiB of shared memory per CTA.
TILE_CONFIG = {64: (4, 2, 64), 128: (4, 2, 64), 192: (4, 1, 32), 256: (4, 1, 32)}


# Narrow tiles (16 rows per warp, 64 per CTA) for d <= 128: "short" batches whose longest
# request packs into <= 64 rows (max_qo_len * group), where a 128-row tile would be mostly
# padding, and custom-mask variants at d = 64. Custom masks at d = 128 take the regular tile:
# since the kernel reads a row's mask bits as one 32-key window (session 31), 128 x 64 tiles ran
# x1.110 against 64 x 64 on a masked L = 4096 prefill on the H200, d = 64 x0.951 (tools/ab_fa2.py,
# prefill_fa2_ab_session31_mask_wide_tiles.json).
NARROW_TILE_CONFIG = {64: (4, 1, 64), 128: (4, 1, 64)}
NARROW_MASK_DIMS = (64,)
SHORT_PACKED_ROWS = 64


def tile_config(head_dim_qk: int, head_dim_vo: int, custom_mask: bool = False,
                short: bool = False) -> tuple[int, int, int]:
    d = max(head_dim_qk, head_dim_vo)
    if (short or (custom_mask and d in NARROW_MASK_DIMS)) and d in NARROW_TILE_CONFIG:
        return NARROW_TILE_CONFIG[d]
    return TILE_CONFIG[d]


def cta_rows(head_dim_qk: int, head_dim_vo: int, custom_mask: bool = False, short: bool = False) -> int:
    warps, m_tiles, _ = tile_config(head_dim_qk, head_dim_vo, custom_mask, short)
    return 16 * warps * m_tiles


def fa2_kv_tile(warps: int, m_tiles: int, kv_tile: int, head_dim: int, arch: Arch, paged: bool,
                alibi: bool, rope: bool) -> int:
    """The kv tile a variant is compiled with. 32 rows per warp at d = 128 with kv tiles of 64
    fills all 255 registers. sm_8x code (ptxas allocates differently; not measured here, no such
    GPU) keeps kv tiles of 32 there, spill-free. sm_90 takes 64 for every variant, some with a
    small declared spill (see KV64_SPILL_BUDGET). The kv tile is invisible to the host (the
    planner only needs the CTA rows)."""
    if head_dim == 128 and m_tiles == 2 and kv_tile == 64 and arch.major < 9:
        return 32
    return kv_tile


# On sm_90a the d = 128 variants at kv tiles of 64 are spill-free with 16-bit KV and no position
# encoding; ALiBi, RoPE and fp8 KV (in some combinations with paging and soft cap) spill 4-64
# bytes, a few local loads per kv tile that stay in L1. Measured in turns on the H200 against
# their spill-free kv tiles of 32 (session 30, tools/ab_fa2.py, 7 rounds): ALiBi x1.163 ragged
# (8 bytes of spill) / x1.146 paged, RoPE x1.058 ragged (64 bytes) / x1.068 paged (60), paged fp8
# x1.129, paged fp8 + soft cap x1.111 (12). So those modules declare a budget for the compile
# check; spill-free rewrites of earlier spilling paged versions that kept the row sums / maxima
# in shared memory were slower than the spill. Custom masks at d = 128 (regular tiles since
# session 31) spill 0-36 bytes there (fa2_spill_audit_session31.txt) and ran x1.110 against the
# spill-free narrow tile (measured with 0-12 bytes, before the range fold, which gained x1.116).
KV64_SPILL_BUDGET = 64


ENTRIES = (Entry("fi_prefill_fa2", ("ptr", "ptr", "stream")), Entry("fi_prefill_fa2_info", ("ptr",)))


@functools.cache
def fa2_spec(dtype: torch.dtype, head_dim_qk: int, head_dim_vo: int, paged: bool, arch: Arch,
             custom_mask: bool = False, softcap: bool = False, alibi: bool = False,
             rope: bool = False, kv_dtype: torch.dtype = None, short: bool = False) -> KernelSpec:
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    fp8 = kv_dtype != dtype
    flags = "".join(f for f, on in (("p", paged), ("m", custom_mask), ("s", softcap), ("a", alibi),
                                    ("r", rope)) if on)
    warps, m_tiles, kv_tile = tile_config(head_dim_qk, head_dim_vo, custom_mask, short)
    kv_tile = fa2_kv_tile(warps, m_tiles, kv_tile, max(head_dim_qk, head_dim_vo), arch, paged, alibi, rope)
    return KernelSpec(
        name=(f"prefill_fa2_{tag(dtype)}{'_kv' + tag(kv_dtype) if fp8 else ''}_d{head_dim_qk}x{head_dim_vo}"
              f"_w{warps}m{m_tiles}n{kv_tile}"
              f"{'_' + flags if flags else ''}"),
        sources=(_HERE / "prefill_fa2.cu",),
        arch=arch,
        defines={
            "FI_T": cuda_type(dtype), "FI_D_QK": head_dim_qk, "FI_D_VO": head_dim_vo,
            "FI_NUM_WARPS": warps, "FI_M_TILES": m_tiles, "FI_KV_TILE": kv_tile,
            "FI_PAGED": int(paged),
            "FI_CUSTOM_MASK": int(custom_mask), "FI_SOFTCAP": int(softcap), "FI_ALIBI": int(alibi),
            "FI_ROPE": int(rope), "FI_KV_FP8": int(fp8), "FI_KV_T": cuda_type(kv_dtype),
        },
        entries=ENTRIES,
        package="fi_attention.prefill",
        spill_budget=(KV64_SPILL_BUDGET if (alibi or rope or fp8 or custom_mask) and kv_tile == 64
                      and m_tiles == 2 and max(head_dim_qk, head_dim_vo) == 128 else 0),
    )
