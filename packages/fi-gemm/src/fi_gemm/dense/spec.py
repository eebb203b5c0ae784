"""KernelSpecs of the dense GEMM kernels: CUTLASS 3.x Hopper units (one tile config each), the
CUTLASS 2.x unit for Ampere / Ada (sm_80+, fp8 on sm_89+) and the weight-streaming decode kernel
(sm_80+, fp8 on sm_89+)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

_HERE = Path(__file__).resolve().parent

_CUTLASS_TYPE = {
    torch.bfloat16: "cutlass::bfloat16_t",
    torch.float16: "cutlass::half_t",
    torch.float8_e4m3fn: "cutlass::float_e4m3_t",
    torch.float8_e5m2: "cutlass::float_e5m2_t",
}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class TileConfig:
    """One CUTLASS tile configuration (one translation unit)."""

    name: str
    tile_m: int
    tile_n: int
    tile_k: int  # in elements; 128 B of K per stage row for both 16-bit (64) and fp8 (128)
    cluster_m: int = 1
    cluster_n: int = 1
    pingpong: bool = False
    streamk: bool = False
    swizzle: int = 1    # persistent scheduler's max swizzle size: 1, 2, 4 or 8
    raster: int = 0     # tile order: 0 CUTLASS's heuristic, 1 along M, 2 along N
    promotion: int = 4  # fp8 only: wgmma K-steps (32 deep) between fp32 promotions


# Shape classes. "large": 128x256 cooperative with a 2x1 cluster multicasting W across the two
# M-tiles (the classic Hopper peak config). "mid": 128x128 cooperative, 1x1, stream-K, for
# M <= 256 where the problem is W-streaming bound: with N = 4096 there are only 32-64 output
# tiles, so stream-K splits K to put every SM on the weights.
# "pingpong": a candidate the shape classes do not pick, timed by the autotuner (fi_gemm.autotune)
# with the rest of the table: 128x128 tiles, the two consumer warpgroups on alternate tiles, so one
# warpgroup's epilogue runs under the other's MMAs. H200, the autotuner's own timings
# (tools/autotune_table.py, gemm_autotune_table_session14.json): never the fastest of the three;
# within 0.2 % of "large" at 1024 x 4096 x 4096, 2-8 % behind the fastest unit at (128 / 2048,
# 14336, 4096) and 4096^3, 33 % at 8192^3.
CONFIGS_16BIT = {
    "large": TileConfig("large", 128, 256, 64, 2, 1),
    "mid": TileConfig("mid", 128, 128, 64, 1, 1, streamk=True),
    "pingpong": TileConfig("pingpong", 128, 128, 64, 1, 1, pingpong=True),
}
# fp8 keeps a second fp32 accumulator set: CUTLASS's fp8 mainloop lets wgmma accumulate
# `promotion` K-steps (32 deep each) and then adds the partial sums into fp32 registers, because
# the tensor cores' fp8 accumulation is not full fp32 (never promoting broke bf16 tolerance at
# K = 8192). A 128x256 tile needs 2 x 128 accumulator registers per thread and spills; 128x192
# takes 96 + 96 of the consumers' 232. H200 A/B at 8192^3 (benchmarks/results/h200/
# bmm_fp8_ab_tiles.json, each row against torch._scaled_mm timed right after it):
#   128x128 2x1 cluster, promote every 4 (the round-1 unit)   1013.5 TFLOP/s  0.82x
#   128x192 2x1, every 4                                        1163.2          0.92x
#   128x128 2x1, every 8                                        1136.8          0.90x
#   128x192 2x1, every 8 ("large")                              1204.0          0.95x
# Promoting every 4 steps waits for all wgmmas in flight at every 128-deep K tile; every 8 halves
# those waits. 128x144 with a 1x2 cluster (cuBLAS's tile for this shape; it needs CuTe's extended
# wgmma shapes) reached 1040.8 / 1132.3, 128x128 swizzled 1071.9. The GPU tests check every unit
# at K = 8192.
CONFIGS_FP8 = {
    "large": TileConfig("large", 128, 192, 128, 2, 1, promotion=8),
    "mid": TileConfig("mid", 128, 128, 128, 1, 1, streamk=True),
    # The round-1 unit, kept as the reference point of A/B runs (used only when FP8_LARGE names it).
    # Candidates measured in the second A/B call and removed (bmm_fp8_ab_tiles_round2.json, 0.97x
    # for "large" in the same call): the large unit with a 1x2 cluster 0.95x, with swizzle 4 0.97x
    # (no gain), with swizzle 8 0.91x.
    "t128x128_c2x1": TileConfig("t128x128_c2x1", 128, 128, 128, 2, 1),
}
# Config of the fp8 "large" shape class. A module attribute read on every call, so an A/B run
# (`flashinfer bench --routine bmm_fp8 --option fp8_large=NAME`, or a test) can switch it; the
# dispatch memo is keyed by the resolved config name, so a switch never reuses another unit.
FP8_LARGE = "large"

GEMM_SM90_ARGS = ("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i64",
                  "i64", "i64", "i64", "i64", "i64", "ptr", "i64", "stream")
GEMV_ARGS = ("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i64", "i64",
             "i64", "i64", "i64", "i64", "stream")

GEMV_SEGMENT_ARGS = ("ptr",) * 7 + ("i64",) * 13 + ("stream",)
GEMV_BLOCKSCALED_ARGS = ("ptr",) * 5 + ("i64",) * 10 + ("stream",)


def shape_class(m: int, n: int, batch: int = 1) -> str:
    """Tile config per shape class: M <= 256 is W-streaming bound, more smaller tiles fill the
    SMs; above that the 128x256 tile has the best MMA-to-load ratio."""
    return "mid" if m <= 256 else "large"


def sm90_config(a_dtype: torch.dtype, m: int, n: int, batch: int = 1) -> str:
    """Name of the CUTLASS unit for this call: the shape class, with fp8's large class resolved
    through FP8_LARGE."""
    cls = shape_class(m, n, batch)
    return FP8_LARGE if cls == "large" and a_dtype in FP8 else cls


def fp8_candidate_specs(arch: Arch, out_dtype: torch.dtype = torch.bfloat16) -> list[KernelSpec]:
    """e4m3 units of every fp8 config that is not a default (the A/B candidates), for
    prebuilding and for their GPU test."""
    e4m3 = torch.float8_e4m3fn
    return [gemm_sm90_spec(e4m3, e4m3, out_dtype, c, arch) for c in CONFIGS_FP8
            if c not in ("large", "mid")]


@functools.cache
def gemm_sm90_spec(a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                   config: str, arch: Arch) -> KernelSpec:
    cfgs = CONFIGS_FP8 if a_dtype in FP8 else CONFIGS_16BIT
    c = cfgs[config]
    bias_dtype = a_dtype if a_dtype not in FP8 else out_dtype
    return KernelSpec(
        name=f"gemm_sm90_{tag(a_dtype)}_{tag(b_dtype)}_{tag(out_dtype)}_{c.name}",
        sources=(_HERE / "gemm_sm90.cu",),
        arch=arch,
        defines={
            "FI_TA": _CUTLASS_TYPE[a_dtype], "FI_TB": _CUTLASS_TYPE[b_dtype],
            "FI_TD": _CUTLASS_TYPE[out_dtype], "FI_TBIAS": _CUTLASS_TYPE[bias_dtype],
            "FI_TILE_M": c.tile_m, "FI_TILE_N": c.tile_n, "FI_TILE_K": c.tile_k,
            "FI_CLUSTER_M": c.cluster_m, "FI_CLUSTER_N": c.cluster_n,
            "FI_PINGPONG": int(c.pingpong), "FI_STREAMK": int(c.streamk),
            "FI_SWIZZLE": c.swizzle, "FI_RASTER": c.raster,
            "FI_PROMOTION": c.promotion if a_dtype in FP8 else 0,
            # wgmma N widths that are not multiples of 64 (144, ...) are behind this CuTe switch;
            # without it the builder falls back to a 16-wide atom repeated across the tile.
            **({"CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED": 1} if c.tile_n % 64 else {}),
        },
        entries=(Entry("fi_gemm_sm90", GEMM_SM90_ARGS),
                 Entry("fi_gemm_sm90_workspace", ("ptr", "i64", "i64", "i64", "i64"))),
        cutlass=True,
        package="fi_gemm",
    )


# The CUTLASS 2.x unit of Ampere / Ada (gemm_sm80.cu) for M > 16: (tile M, N, K, warp M, N,
# stages). 16-bit: 128x128x32 tiles of four 64x64 warps, 4 stages (64 KB of shared memory, under
# the 99 KB an sm_86 / sm_89 block may take; 234 registers, no spills). fp8: 128x64x128 tiles of
# eight 32x32 warps, 4 stages (96 KB; 162 registers on sm_89, 149 on sm_90a). Every larger fp8
# warp tile tried reached 255 registers and spilled on sm_90a (128x128x64 with 64x32 / 32x64
# warps: 24-40 B; 64x64 warps: 1-1.5 KB), where ptxas has no fp8 mma.sync of its own; 64x32
# warps are clean on sm_89 (198 registers) but not on the sm_90a build the H200 tests run.
SM80_TILES = {"16bit": (128, 128, 32, 64, 64, 4), "fp8": (128, 64, 128, 32, 32, 4)}
GEMM_SM80_ARGS = ("ptr",) * 6 + ("i64",) * 10 + ("stream",)


@functools.cache
def gemm_sm80_spec(a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                   arch: Arch) -> KernelSpec:
    tm, tn, tk, wm, wn, stages = SM80_TILES["fp8" if a_dtype in FP8 else "16bit"]
    return KernelSpec(
        name=f"gemm_sm80_{tag(a_dtype)}_{tag(b_dtype)}_{tag(out_dtype)}",
        sources=(_HERE / "gemm_sm80.cu",),
        arch=arch,
        defines={"FI_TA": _CUTLASS_TYPE[a_dtype], "FI_TB": _CUTLASS_TYPE[b_dtype],
                 "FI_TD": _CUTLASS_TYPE[out_dtype], "FI_TILE_M": tm, "FI_TILE_N": tn,
                 "FI_TILE_K": tk, "FI_WARP_M": wm, "FI_WARP_N": wn, "FI_STAGES": stages},
        entries=(Entry("fi_gemm_sm80", GEMM_SM80_ARGS),),
        cutlass=True,
        package="fi_gemm",
    )


# A/B tuning of the weight-streaming kernel (mm_bf16 bench option u8=N): U, the K steps whose
# loads a thread issues before its first MMA, of the one-slab M <= 8 unit (FI_GEMV_U8 in gemv.cu);
# 0 = the source's default.
GEMV_U8 = 0
# A/B of its M = 9..16 unit (mm_bf16 bench option m16=N, FI_GEMV_M16 in gemv.cu): 0 = the
# source's default, 1 = one CTA per 16 W rows, 2 = K split across a 2-CTA cluster (sm_90).
GEMV_M16 = 0
# A/B of its segment unit for N <= 16 (segment_gemm bench option seg=N, FI_GEMV_SEG): 0 = the
# source's default, 1 = 16-row tiles, 2 = 32-row tiles split over K by a 2-CTA cluster (sm_90).
GEMV_SEG = 0
# Any other compile-time switch of gemv.cu for A/B runs (tools/ab_gemv.py): {"PDL": 0} builds the
# module with -DFI_GEMV_PDL=0 (plain launches), under a name that says so.
GEMV_AB: dict[str, int] = {}


@functools.cache
def gemv_spec(a_dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype,
              arch: Arch) -> KernelSpec:
    bias_dtype = a_dtype if a_dtype not in FP8 else out_dtype
    tuning = {"FI_GEMV_U8": GEMV_U8} if GEMV_U8 else {}
    suffix = f"_u{GEMV_U8}" if GEMV_U8 else ""
    if GEMV_M16:
        tuning["FI_GEMV_M16"] = GEMV_M16
        suffix += f"_m16v{GEMV_M16}"
    if GEMV_SEG:
        tuning["FI_GEMV_SEG"] = GEMV_SEG
        suffix += f"_seg{GEMV_SEG}"
    for key, val in sorted(GEMV_AB.items()):
        tuning[f"FI_GEMV_{key}"] = val
        suffix += f"_{key.lower()}{val}"
    return KernelSpec(
        name=f"gemv_{tag(a_dtype)}_{tag(w_dtype)}_{tag(out_dtype)}{suffix}",
        sources=(_HERE / "gemv.cu",),
        arch=arch,
        defines={"FI_TA": cuda_type(a_dtype), "FI_TW": cuda_type(w_dtype),
                 "FI_TD": cuda_type(out_dtype), "FI_TBIAS": cuda_type(bias_dtype), **tuning},
        entries=(Entry("fi_gemv", GEMV_ARGS), Entry("fi_gemv_segment", GEMV_SEGMENT_ARGS),
                 Entry("fi_gemv_blockscaled", GEMV_BLOCKSCALED_ARGS)),
        package="fi_gemm",
    )
