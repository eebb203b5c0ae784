"""KernelSpecs of the gated-activation module: one module per element dtype and arch."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

_HERE = Path(__file__).resolve().parent

# fi_act_and_mul(out, in, rows, d, out_stride, in_stride, act, stream)
ACT_ARGS = ("ptr", "ptr", "i64", "i64", "i64", "i64", "i32", "stream")

# Activation codes of the launcher.
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@functools.cache
def act_and_mul_spec(dtype: torch.dtype, arch: Arch) -> KernelSpec:
    """SiLU / GELU / GELU-tanh gated activations for `dtype` (float16 or bfloat16)."""
    return KernelSpec(
        name=f"act_and_mul_{tag(dtype)}",
        sources=(_HERE / "act_and_mul.cu",),
        arch=arch,
        defines={"FI_T": cuda_type(dtype)},
        entries=(Entry("fi_act_and_mul", ACT_ARGS),),
        package="fi_sampling",
    )
