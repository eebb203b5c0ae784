"""KernelSpecs of the FP4 path: the quantiser, the dequantiser (both operands, M > 16) and the
FP4 weight-streaming kernel (M <= 16, both operands read packed)."""

from __future__ import annotations

from pathlib import Path

import torch

from fi_core import Arch, Entry, KernelSpec
from fi_core.dtypes import cuda_type, tag

_HERE = Path(__file__).resolve().parent

DEQUANT_ARGS = ("ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i64", "i64", "i64", "stream")


def dequant_spec(arch: Arch) -> KernelSpec:
    """One module for both formats and every scale layout (runtime parameters: the kernel is
    bandwidth-bound, a branch per 8-byte group costs nothing measurable)."""
    return KernelSpec(name="fp4_dequant", sources=(_HERE / "dequant.cu",), arch=arch,
                      entries=(Entry("fi_fp4_dequant", DEQUANT_ARGS),), package="fi_gemm")


QUANT_ARGS = ("ptr",) * 4 + ("i64",) * 9 + ("stream",)


# A/B builds of the quantiser: {"EPT": 2} -> FI_FP4_QUANT_EPT=2 and a name suffix (tools/ab_quant.py;
# the switches live in experiment patches, benchmarks/experiments/session44_*); empty for users.
QUANT_AB: dict = {}


def quant_spec(arch: Arch) -> KernelSpec:
    """fp4_quantize's kernel: one module for the three input dtypes, both block sizes and scale
    kinds (template instances picked at launch)."""
    ab = sorted(QUANT_AB.items())
    return KernelSpec(name="fp4_quantize" + "".join(f"_{k.lower()}{v}" for k, v in ab),
                      sources=(_HERE / "quant.cu",), arch=arch,
                      defines={f"FI_FP4_QUANT_{k}": v for k, v in ab},
                      entries=(Entry("fi_fp4_quantize", QUANT_ARGS),), package="fi_gemm")


GEMV_FP4_ARGS = ("ptr",) * 6 + ("i64",) * 9 + ("stream",)


# A/B builds: {"U1": 4, ...} -> FI_GEMV_FP4_U1=4 and a name suffix (tools, tests); empty for users.
GEMV_FP4_AB: dict = {}


def gemv_fp4_spec(out_dtype: torch.dtype, arch: Arch) -> KernelSpec:
    """The M <= 16 kernel for one output dtype; NVFP4 and MXFP4 units are both in the module."""
    ab = sorted(GEMV_FP4_AB.items())
    return KernelSpec(name=f"gemv_fp4_{tag(out_dtype)}" + "".join(f"_{k.lower()}{v}" for k, v in ab),
                      sources=(_HERE / "gemv_fp4.cu",), arch=arch,
                      defines={"FI_TD": cuda_type(out_dtype), **{f"FI_GEMV_FP4_{k}": v for k, v in ab}},
                      entries=(Entry("fi_gemv_fp4", GEMV_FP4_ARGS),), package="fi_gemm")
