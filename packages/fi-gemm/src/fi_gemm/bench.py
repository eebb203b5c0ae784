"""Benchmark routines of fi-gemm (imported by `flashinfer bench`): mm_bf16, bmm_fp8,
segment_gemm."""

from .dense import bench as _dense_bench  # noqa: F401
from .segment import bench as _segment_bench  # noqa: F401
