"""KernelSpecs of the portable fa2 prefill kernel: one module per (dtype, head dims, KV layout,
mask/variant flags, arch)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

_HERE = Path(__file__).resolve().parent

# Warps per CTA by head dim: each warp owns 16 packed query rows, so CTA rows = 16 * warps.
# d <= 128: 8 warps (128 rows) reuse every K/V tile 128 times; d = 256: 4 warps (64 rows) keep
# Q + K + V tiles (64 + 64 + 64 rows x 512 B = 96 KiB) inside the sm_80 shared-memory budget.
def num_warps(head_dim_qk: int, head_dim_vo: int) -> int:
    return 4 if max(head_dim_qk, head_dim_vo) > 128 else 8


def cta_rows(head_dim_qk: int, head_dim_vo: int) -> int:
    return 16 * num_warps(head_dim_qk, head_dim_vo)


def smem_bytes(head_dim_qk: int, head_dim_vo: int) -> int:
    return (cta_rows(head_dim_qk, head_dim_vo) * head_dim_qk + 64 * head_dim_qk + 64 * head_dim_vo) * 2


ENTRIES = (Entry("fi_prefill_fa2", ("ptr", "ptr", "stream")), Entry("fi_prefill_fa2_info", ("ptr",)))


@functools.cache
def fa2_spec(dtype: torch.dtype, head_dim_qk: int, head_dim_vo: int, paged: bool, arch: Arch,
             custom_mask: bool = False, softcap: bool = False, alibi: bool = False) -> KernelSpec:
    flags = "".join(f for f, on in (("p", paged), ("m", custom_mask), ("s", softcap), ("a", alibi)) if on)
    return KernelSpec(
        name=f"prefill_fa2_{tag(dtype)}_d{head_dim_qk}x{head_dim_vo}{'_' + flags if flags else ''}",
        sources=(_HERE / "prefill_fa2.cu",),
        arch=arch,
        defines={
            "FI_T": cuda_type(dtype), "FI_D_QK": head_dim_qk, "FI_D_VO": head_dim_vo,
            "FI_NUM_WARPS": num_warps(head_dim_qk, head_dim_vo), "FI_PAGED": int(paged),
            "FI_CUSTOM_MASK": int(custom_mask), "FI_SOFTCAP": int(softcap), "FI_ALIBI": int(alibi),
        },
        entries=ENTRIES,
        package="fi_attention.prefill",
    )
