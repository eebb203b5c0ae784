"""KernelSpec of the FP4 dequantiser (the FP4 path's only kernel of its own; the GEMM after it is
fi-gemm's bf16 GEMM, dense/spec.py)."""

from __future__ import annotations

from pathlib import Path

from fi_core import Arch, Entry, KernelSpec

_HERE = Path(__file__).resolve().parent

DEQUANT_ARGS = ("ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i64", "i64", "i64", "stream")


def dequant_spec(arch: Arch) -> KernelSpec:
    """One module for both formats and every scale layout (runtime parameters: the kernel is
    bandwidth-bound, a branch per 8-byte group costs nothing measurable)."""
    return KernelSpec(name="fp4_dequant", sources=(_HERE / "dequant.cu",), arch=arch,
                      entries=(Entry("fi_fp4_dequant", DEQUANT_ARGS),), package="fi_gemm")
