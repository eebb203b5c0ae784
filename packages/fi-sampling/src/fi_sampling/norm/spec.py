"""KernelSpecs of the norm module: one module per element dtype (fp16 / bf16) and arch."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

_HERE = Path(__file__).resolve().parent

# Vectors per thread the fused register kernel starts from, 0 = the source's default (2). Changed
# only by the fused_add_rmsnorm bench routine (option fused_nv=N) for A/B runs; not a user setting.
FUSED_NV = 0

# fi_rmsnorm(out, in, residual|NULL, weight, rows, cols, inner, out_s0, out_s1, in_s0, in_s1,
#            res_s0, res_s1, eps, weight_offset, stream)
RMSNORM_ARGS = ("ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i64", "i64", "i64",
                "i64", "i64", "f32", "f32", "stream")
# fi_layernorm(out, in, gemma, beta, rows, cols, out_s0, in_s0, eps, stream)
LAYERNORM_ARGS = ("ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "f32", "stream")


@functools.cache
def norm_spec(dtype: torch.dtype, arch: Arch) -> KernelSpec:
    """RMSNorm (plain, fused-add, Gemma) and LayerNorm for `dtype` (float16 or bfloat16)."""
    return KernelSpec(
        name=f"norm_{tag(dtype)}{f'_fnv{FUSED_NV}' if FUSED_NV else ''}",
        sources=(_HERE / "norm.cu",),
        arch=arch,
        defines={"FI_T": cuda_type(dtype), **({"FI_FUSED_NV": FUSED_NV} if FUSED_NV else {})},
        entries=(Entry("fi_rmsnorm", RMSNORM_ARGS), Entry("fi_layernorm", LAYERNORM_ARGS)),
        package="fi_sampling",
    )
