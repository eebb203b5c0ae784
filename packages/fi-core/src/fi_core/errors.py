"""The exceptions every fi package raises.

Input errors subclass the builtin ValueError/TypeError so that callers catching those keep working.
"""

from __future__ import annotations


class FIError(Exception):
    """Base of every error raised by fi."""


class InputError(FIError, ValueError):
    """A tensor or argument has the wrong shape, value, device or layout."""


class InputTypeError(FIError, TypeError):
    """A tensor or argument has the wrong dtype or Python type."""


class UnsupportedError(FIError, RuntimeError):
    """No backend can run this case; the message lists each backend's reason."""


class ReferenceFallbackWarning(UserWarning):
    """No kernel of an op can run a call on this GPU, so ``backend="auto"`` runs the pure-torch
    reference there: correct, but far slower than a kernel. Warned once per op, device and reason."""


class GPUArchitectureError(UnsupportedError):
    """The GPU's architecture does not support the requested feature (FlashInfer's name)."""


class NoGPUError(FIError, RuntimeError):
    """No CUDA driver or no CUDA device is available."""


class CompileError(FIError, RuntimeError):
    """nvcc failed. Carries the command line and the full compiler log."""

    def __init__(self, message: str, command: str = "", log: str = ""):
        self.command = command
        self.log = log
        text = message
        if command:
            text += f"\ncommand: {command}"
        if log:
            text += f"\n--- compiler output ---\n{log.rstrip()}"
        super().__init__(text)


class KernelUnavailableError(FIError, RuntimeError):
    """A kernel is neither prebuilt nor cached, and it cannot be compiled here."""


class CacheError(FIError, RuntimeError):
    """The kernel cache is unusable (unsafe permissions, unwritable)."""


class CudaError(FIError, RuntimeError):
    """A CUDA call returned an error. ``code`` is the cudaError_t value, ``name`` its enum name."""

    def __init__(self, code: int, name: str, message: str, where: str = ""):
        self.code = code
        self.name = name
        loc = f" in {where}" if where else ""
        super().__init__(f"CUDA error {code} ({name}){loc}: {message}")
