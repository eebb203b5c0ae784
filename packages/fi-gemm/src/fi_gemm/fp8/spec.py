"""KernelSpecs of the block-scaled FP8 kernels (the decode kernel lives in dense/spec.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import tag

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
# accumulator registers per thread (128x256 would need 2 x 128 and spill).
BLOCKWISE_CONFIGS = {
    "default": BlockwiseConfig(128, 128),
    # A/B candidates for M > 256 (not used unless BLOCKWISE_LARGE names one): a 2-CTA cluster
    # multicasting W (2x1) or A (1x2), and a swizzled tile order that keeps one wave's A and W rows
    # in L2 (unswizzled, a wave of 132 CTAs sweeps all 64 N tiles: 64 MB of W at N = K = 8192).
    "t128x128_c2x1": BlockwiseConfig(128, 128, 2, 1),
    "t128x128_c1x2": BlockwiseConfig(128, 128, 1, 2),
    "t128x128_c1x1_sw8": BlockwiseConfig(128, 128, 1, 1, swizzle=8),
    "t128x128_c2x1_sw8": BlockwiseConfig(128, 128, 2, 1, swizzle=8),
}
# Config used for M > 256. A module attribute read on every call, so an A/B run
# (`flashinfer bench --routine gemm_fp8_nt_groupwise --option blockwise_large=NAME`, or a test)
# can switch it; smaller M keeps "default".
BLOCKWISE_LARGE = "default"


def is_large(m: int) -> bool:
    """The calls whose unit BLOCKWISE_LARGE decides: M > 256 (over two 128-row tiles)."""
    return m > 256


def blockwise_config(m: int, n: int) -> str:
    """Name of the blockwise unit for an [m, k] x [n, k] call."""
    return BLOCKWISE_LARGE if is_large(m) else "default"


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
        entries=(Entry("fi_gemm_blockwise_sm90", ("ptr",) * 5 + ("i64",) * 6 + ("ptr", "i64", "stream")),
                 Entry("fi_gemm_blockwise_sm90_workspace", ("ptr", "i64", "i64", "i64"))),
        cutlass=True,
        package="fi_gemm",
    )


def blockwise_candidate_specs(arch: Arch) -> list[KernelSpec]:
    """e4m3 -> bf16 units of every non-default blockwise config (the A/B candidates), for
    prebuilding and for their GPU test."""
    e4m3 = torch.float8_e4m3fn
    return [blockwise_sm90_spec(e4m3, e4m3, torch.bfloat16, c, arch) for c in BLOCKWISE_CONFIGS
            if c != "default"]
