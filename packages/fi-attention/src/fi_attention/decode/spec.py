"""Kernel specs of batch/single decode: one module per (q dtype, kv dtype, head_dim, query heads
per CTA, position encoding, soft cap)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

_HERE = Path(__file__).resolve().parent

POS_CODES = {"NONE": 0, "ROPE_LLAMA": 1, "ALIBI": 2}
HEAD_DIMS = (64, 128, 256)


def heads_per_cta(group: int) -> int:
    """Largest divisor of the GQA group that is <= 8: every query head of a CTA shares each K/V
    row it loads; more than 8 would need more than 255 registers for q and o."""
    for gh in range(min(group, 8), 0, -1):
        if group % gh == 0:
            return gh
    return 1


@functools.cache
def decode_spec(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, gh: int,
                pos_encoding_mode: str, soft_cap: bool, arch: Arch) -> KernelSpec:
    pos = POS_CODES[pos_encoding_mode]
    return KernelSpec(
        name=f"batch_decode_{tag(q_dtype)}_{tag(kv_dtype)}_d{head_dim}_gh{gh}_p{pos}_c{int(soft_cap)}",
        sources=(_HERE / "decode.cu",),
        arch=arch,
        defines={"FI_Q": cuda_type(q_dtype), "FI_KV": cuda_type(kv_dtype), "FI_HEAD_DIM": head_dim,
                 "FI_GH": gh, "FI_POS": pos, "FI_SOFTCAP": int(soft_cap)},
        entries=(Entry("fi_batch_decode", ("ptr", "stream")),
                 Entry("fi_batch_decode_occupancy", ("ptr",))),
        package="fi_attention",
    )


def representative_specs(arch: Arch) -> list[KernelSpec]:
    return [decode_spec(torch.bfloat16, torch.bfloat16, 128, 4, "NONE", False, arch),
            decode_spec(torch.bfloat16, torch.float8_e4m3fn, 128, 4, "NONE", False, arch)]
