"""KernelSpecs of the dense GEMM kernels: CUTLASS 3.x Hopper units (one tile config each) and the
weight-streaming decode kernel (sm_80+, fp8 on sm_89+)."""

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


# Shape classes. "large": 128x256 cooperative with a 2x1 cluster multicasting W across the two
# M-tiles (the classic Hopper peak config). "mid": 128x128 cooperative, 1x1, stream-K, for
# M <= 256 where the problem is W-streaming bound: with N = 4096 there are only 32-64 output
# tiles, so stream-K splits K to put every SM on the weights.
CONFIGS_16BIT = {
    "large": TileConfig("large", 128, 256, 64, 2, 1),
    "mid": TileConfig("mid", 128, 128, 64, 1, 1, streamk=True),
}
# fp8 keeps a second fp32 accumulator set (the mainloop promotes wgmma's partial sums every few
# K steps, as torch._scaled_mm's default does), so a 128x256 tile needs 2 x 128 accumulator
# registers per thread and spills (measured: 1.4 KB/thread); 128x128 fits in 168.
CONFIGS_FP8 = {
    "large": TileConfig("large", 128, 128, 128, 2, 1),
    "mid": TileConfig("mid", 128, 128, 128, 1, 1, streamk=True),
}

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
        },
        entries=(Entry("fi_gemm_sm90", GEMM_SM90_ARGS),
                 Entry("fi_gemm_sm90_workspace", ("ptr", "i64", "i64", "i64", "i64"))),
        cutlass=True,
        package="fi_gemm",
    )


@functools.cache
def gemv_spec(a_dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype,
              arch: Arch) -> KernelSpec:
    bias_dtype = a_dtype if a_dtype not in FP8 else out_dtype
    return KernelSpec(
        name=f"gemv_{tag(a_dtype)}_{tag(w_dtype)}_{tag(out_dtype)}",
        sources=(_HERE / "gemv.cu",),
        arch=arch,
        defines={"FI_TA": cuda_type(a_dtype), "FI_TW": cuda_type(w_dtype),
                 "FI_TD": cuda_type(out_dtype), "FI_TBIAS": cuda_type(bias_dtype)},
        entries=(Entry("fi_gemv", GEMV_ARGS), Entry("fi_gemv_segment", GEMV_SEGMENT_ARGS),
                 Entry("fi_gemv_blockscaled", GEMV_BLOCKSCALED_ARGS)),
        package="fi_gemm",
    )
