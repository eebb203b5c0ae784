"""Compile, cache, load: KernelSpec -> content hash -> ninja/nvcc build -> ctypes module."""

from .spec import Entry, KernelSpec, cutlass_include_dir, fi_include_dir
from .loader import Module, bind_entry, load, load_many
from .build import build_many

__all__ = [
    "Entry", "KernelSpec", "Module", "bind_entry", "build_many", "cutlass_include_dir", "fi_include_dir",
    "load", "load_many",
]
