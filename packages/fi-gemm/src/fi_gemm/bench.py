"""Benchmark routines of fi-gemm (imported by `flashinfer bench`): mm_bf16, bmm_fp8,
gemm_fp8_nt_groupwise, mm_fp4, segment_gemm."""

from .dense import bench as _dense_bench  # noqa: F401
from .fp4 import bench as _fp4_bench  # noqa: F401
from .fp8 import bench as _fp8_bench  # noqa: F401
from .segment import bench as _segment_bench  # noqa: F401
