"""KernelSpecs of the block-scaled FP8 kernels (the decode kernel lives in dense/spec.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import tag

from ..dense.spec import _CUTLASS_TYPE

_HERE = Path(__file__).resolve().parent

# 128x128 (K tile 128 = one scale block) cooperative: two consumer warpgroups of 64 rows.
BLOCKWISE_CONFIGS = {"default": (128, 128, 1, 1)}


@functools.cache
def blockwise_sm90_spec(a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                        config: str, arch: Arch) -> KernelSpec:
    tm, tn, cm, cn = BLOCKWISE_CONFIGS[config]
    return KernelSpec(
        name=f"gemm_blockwise_sm90_{tag(a_dtype)}_{tag(b_dtype)}_{tag(out_dtype)}_{config}",
        sources=(_HERE / "gemm_blockwise_sm90.cu",),
        arch=arch,
        defines={"FI_TA": _CUTLASS_TYPE[a_dtype], "FI_TB": _CUTLASS_TYPE[b_dtype],
                 "FI_TD": _CUTLASS_TYPE[out_dtype], "FI_TILE_M": tm, "FI_TILE_N": tn,
                 "FI_CLUSTER_M": cm, "FI_CLUSTER_N": cn},
        entries=(Entry("fi_gemm_blockwise_sm90", ("ptr",) * 5 + ("i64",) * 6 + ("ptr", "i64", "stream")),
                 Entry("fi_gemm_blockwise_sm90_workspace", ("ptr", "i64", "i64", "i64"))),
        cutlass=True,
        package="fi_gemm",
    )
