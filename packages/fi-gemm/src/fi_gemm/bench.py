"""Benchmark routines of fi-gemm (imported by `flashinfer bench`)."""

from .dense import bench as _dense_bench  # noqa: F401  (registers mm_bf16, bmm_fp8)
