"""fi-core: the compile/cache/launch layer, arch detection, dispatch and CLI shared by every fi
kernel family. Importing it makes no CUDA call and imports no family."""

from .version import __version__
from .arch import Arch, DeviceInfo, arch_of, device_info, has_gpu, parse_arch_list
from .errors import (
    CacheError, CompileError, CudaError, FIError, GPUArchitectureError, InputError, InputTypeError,
    KernelUnavailableError, NoGPUError, ReferenceFallbackWarning, UnsupportedError,
)
from .jit import Entry, KernelSpec, Module, build_many, load, load_many
from .launch import current_stream, on_device
from .registry import Backend, OpInfo, register_op

__all__ = [
    "Arch", "Backend", "CacheError", "CompileError", "CudaError", "DeviceInfo", "Entry",
    "FIError", "GPUArchitectureError", "InputError", "InputTypeError", "KernelSpec",
    "KernelUnavailableError", "Module", "NoGPUError", "OpInfo", "ReferenceFallbackWarning",
    "UnsupportedError", "__version__", "arch_of", "build_many", "current_stream", "device_info",
    "has_gpu", "load", "load_many", "on_device", "parse_arch_list", "register_op",
]
