"""KernelSpecs for RoPE: one module per element type; style (NeoX/GPT-J) and access width are
template instantiations inside it, the position source and angle mode are runtime arguments."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

_HERE = Path(__file__).resolve().parent

# fi_rope(q_out, k_out, q, k, nnz, hq, hk, head_dim, rotary_dim, 8 strides, pos, pos64, indptr,
#         indptr64, batch, cos_sin, max_pos, interleave, theta, rcp_scale, llama, smooth_a,
#         smooth_b, stream)
ROPE_ARGS = ("ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i64",
             "i64", "i64", "i64", "i64", "i64", "i64", "i64", "i64",
             "ptr", "i64", "ptr", "i64", "i64", "ptr", "i64", "i64",
             "f64", "f64", "i64", "f64", "f64", "stream")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# Shape of the cos/sin-cache kernel (FI_ROPE_CACHE_VARIANT in rope.cu, which lists the variants),
# None = the source's default. Changed only by the apply_rope_with_cos_sin_cache_inplace bench
# routine (option variant=N) for A/B runs; not a user setting.
CACHE_VARIANT = None


@functools.cache
def rope_spec(dtype: torch.dtype, arch: Arch) -> KernelSpec:
    variant = {} if CACHE_VARIANT is None else {"FI_ROPE_CACHE_VARIANT": CACHE_VARIANT}
    return KernelSpec(
        name=f"rope_{tag(dtype)}{'' if CACHE_VARIANT is None else f'_cv{CACHE_VARIANT}'}",
        sources=(_HERE / "rope.cu",),
        arch=arch,
        defines={"FI_T": cuda_type(dtype), **variant},
        entries=(Entry("fi_rope", ROPE_ARGS),),
        package="fi_sampling",
    )
