"""fi-gemm: bf16/fp16, FP8 (per-tensor, block-scaled) and FP4 GEMM, grouped and segment GEMM, on
Hopper and Ampere. flashinfer.gemm re-exports these."""

from .version import __version__
from .dense.api import bmm_bf16, bmm_fp8, mm_bf16
from .segment.api import SegmentGEMMWrapper, grouped_mm_bf16
from .fp8.groupwise import gemm_fp8_nt_groupwise, group_gemm_fp8_nt_groupwise
from .fp8.quant import quantize_fp8_block, quantize_fp8_per_tensor, quantize_fp8_per_token_group
from .fp4.api import mm_fp4
from .fp4.quant import SfLayout, fp4_quantize, mxfp4_quantize, nvfp4_quantize
from .tuning import autotune

__all__: list[str] = [
    "SegmentGEMMWrapper", "SfLayout", "__version__", "autotune", "bmm_bf16", "bmm_fp8",
    "fp4_quantize", "gemm_fp8_nt_groupwise", "group_gemm_fp8_nt_groupwise", "grouped_mm_bf16",
    "mm_bf16", "mm_fp4", "mxfp4_quantize", "nvfp4_quantize", "quantize_fp8_block",
    "quantize_fp8_per_tensor", "quantize_fp8_per_token_group",
]
