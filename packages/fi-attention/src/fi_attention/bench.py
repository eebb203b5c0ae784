"""Benchmark routines of fi-attention: importing this module registers them (one import line per
routine module)."""

from . import bench_prefill  # noqa: F401
from . import bench_decode  # noqa: F401
from .prefill.hopper import bench as _fa3_bench  # noqa: F401
