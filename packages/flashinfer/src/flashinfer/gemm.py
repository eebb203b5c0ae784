"""flashinfer.gemm: GEMM: bf16/fp16, FP8, grouped and segment (from the fi-gemm package)."""

from ._family import reexport

reexport(globals(), "fi-gemm", "fi_gemm")
