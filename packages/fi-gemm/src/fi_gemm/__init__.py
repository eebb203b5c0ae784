"""fi-gemm: bf16/fp16 and FP8 (per-tensor, block-scaled) GEMM, grouped and segment GEMM, on Hopper
and Ampere. flashinfer.gemm re-exports these."""

from .version import __version__

__all__: list[str] = ["__version__"]
