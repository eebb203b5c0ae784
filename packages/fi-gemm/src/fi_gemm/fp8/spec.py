"""KernelSpecs of the block-scaled FP8 kernels (the decode kernel lives in dense/spec.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

from ..dense.spec import _CUTLASS_TYPE

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class BlockwiseConfig:
    """One CUTLASS blockwise unit. TileK is always 128 (one scale block); TileN must be a
    multiple of 128 (one weight scale per N tile), so 128x192 is not possible here."""

    tile_m: int
    tile_n: int
    cluster_m: int = 1
    cluster_n: int = 1
    swizzle: int = 1  # persistent scheduler's max swizzle size: 1, 2, 4 or 8
    raster: int = 0   # tile order: 0 CUTLASS's heuristic, 1 along M, 2 along N


# 128x128 cooperative: two consumer warpgroups of 64 rows, each with 64 wgmma + 64 promoted fp32
# accumulator registers per thread (128x256 would need 2 x 128 and spill). Weights larger than
# the L2 (N x K fp8 bytes over 32 MiB) take the swizzled tile order: unswizzled, one wave of 132
# CTAs sweeps all N tiles, i.e. all of W (64 MB at N = K = 8192). H200 A/B
# (gemm_fp8_nt_groupwise_ab_tiles*.json): M = N = K = 8192 in 967.6-975.5 us swizzled vs 1043.5
# plain; at N = K = 4096 (16 MB of W) the two orders are within the run-to-run spread (plain 111.8
# and 121.4 us in two calls, swizzled 115.0 and 115.1), so small weights keep the plain order.
# 2-CTA clusters (2x1 / 1x2, with or without swizzle) and swizzle 4 were not faster, nor was
# CUTLASS's ping-pong schedule (64x128 tile per consumer warpgroup, swizzle 8): 1377.4 / 156.7 us
# at M = N = K = 8192 / 4096 against 989.8 / 114.2 for the cooperative swizzled unit in the same
# run (gemm_fp8_nt_groupwise_ab_pingpong.json).
# Session 10: CUTLASS's stream-K scheduler (heuristic decomposition, deterministic reduction; the
# remainder of the last wave split over K) was slower at M = N = K = 8192: 983.9-984.8 us swizzled,
# 1061.8-1068.8 plain, against 968.1-969.4 for this unit in the same runs; at M = 4096 the three
# were within that run's spread (113-125 us) (gemm_fp8_nt_groupwise_ab_streamk_session10_*.json).
BLOCKWISE_CONFIGS = {
    "default": BlockwiseConfig(128, 128),
    "swizzled": BlockwiseConfig(128, 128, swizzle=8),
}
# W bytes (fp8: N x K) above which the swizzled order is used.
SWIZZLE_W_BYTES = 32 << 20
# A/B override for M > 256 (`flashinfer bench --routine gemm_fp8_nt_groupwise --option
# blockwise_large=NAME`, or a test): a module attribute read on every call; None = by shape.
BLOCKWISE_LARGE = None


def is_large(m: int) -> bool:
    """The calls whose unit BLOCKWISE_LARGE overrides: M > 256 (over two 128-row tiles)."""
    return m > 256


def blockwise_config(m: int, n: int, k: int) -> str:
    """Name of the blockwise unit for an [m, k] x [n, k] call."""
    if BLOCKWISE_LARGE is not None and is_large(m):
        return BLOCKWISE_LARGE
    return "swizzled" if is_large(m) and n * k > SWIZZLE_W_BYTES else "default"


@functools.cache
def blockwise_sm90_spec(a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                        config: str, arch: Arch) -> KernelSpec:
    c = BLOCKWISE_CONFIGS[config]
    return KernelSpec(
        name=f"gemm_blockwise_sm90_{tag(a_dtype)}_{tag(b_dtype)}_{tag(out_dtype)}_{config}",
        sources=(_HERE / "gemm_blockwise_sm90.cu",),
        arch=arch,
        defines={"FI_TA": _CUTLASS_TYPE[a_dtype], "FI_TB": _CUTLASS_TYPE[b_dtype],
                 "FI_TD": _CUTLASS_TYPE[out_dtype], "FI_TILE_M": c.tile_m, "FI_TILE_N": c.tile_n,
                 "FI_CLUSTER_M": c.cluster_m, "FI_CLUSTER_N": c.cluster_n,
                 "FI_SWIZZLE": c.swizzle, "FI_RASTER": c.raster},
        entries=(Entry("fi_gemm_blockwise_sm90", ("ptr",) * 5 + ("i64",) * 7 + ("ptr", "i64", "stream")),
                 Entry("fi_gemm_blockwise_sm90_workspace", ("ptr", "i64", "i64", "i64"))),
        cutlass=True,
        package="fi_gemm",
    )


def blockwise_candidate_specs(arch: Arch) -> list[KernelSpec]:
    """e4m3 -> bf16 units of every blockwise config but "default" (the swizzled unit and any A/B
    candidate added to BLOCKWISE_CONFIGS), for prebuilding and for their GPU test at a residue
    shape."""
    e4m3 = torch.float8_e4m3fn
    return [blockwise_sm90_spec(e4m3, e4m3, torch.bfloat16, c, arch) for c in BLOCKWISE_CONFIGS
            if c != "default"]


# The mma.sync unit of gemm_blockwise_sm89.cu (M > 16 off Hopper; on Hopper by name only); its
# launcher takes the decode kernel's block-scale arguments.
BLOCKWISE_SM89_ARGS = ("ptr",) * 5 + ("i64",) * 10 + ("stream",)


@functools.cache
def blockwise_sm89_spec(a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                        arch: Arch) -> KernelSpec:
    return KernelSpec(
        name=f"gemm_blockwise_sm89_{tag(a_dtype)}_{tag(b_dtype)}_{tag(out_dtype)}",
        sources=(_HERE / "gemm_blockwise_sm89.cu",),
        arch=arch,
        defines={"FI_TA": cuda_type(a_dtype), "FI_TW": cuda_type(b_dtype), "FI_TD": cuda_type(out_dtype)},
        entries=(Entry("fi_gemm_blockwise_sm89", BLOCKWISE_SM89_ARGS),),
        package="fi_gemm",
    )
