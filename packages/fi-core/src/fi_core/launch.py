"""Host-side launch helpers: the current torch stream as a raw handle, tensor pointers.

These sit on every op's hot path, so they avoid torch's Python-level stream objects.
"""

from __future__ import annotations

import contextlib

import torch

try:  # the raw-handle accessor costs ~0.2 us; torch.cuda.current_stream() builds an object
    _raw_stream = torch._C._cuda_getCurrentRawStream  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - CPU-only torch builds
    _raw_stream = None

# raw_stream(device_index) -> cudaStream_t of torch's current stream on that device, as an int,
# without current_stream()'s device resolution; None on torch builds without CUDA. For launch
# paths that already hold the device index.
raw_stream = _raw_stream


class CallMemo(dict):
    """Bounded memo of the call signatures an op's checked path served, each mapped to what a
    repeat call needs for its launch (the ops' fast paths: fi_gemm's dense, block-scaled and
    segment GEMMs). A plain dict for lookups (``get`` stays the C method on the hot path); ``put``
    forgets everything before a new signature once ``limit`` are held, so a stream of one-off
    shapes cannot grow it without bound."""

    __slots__ = ("limit",)

    def __init__(self, limit: int = 1024) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        if len(self) >= self.limit and key not in self:
            self.clear()
        self[key] = value


def current_stream(device: torch.device | int | None = None) -> int:
    """cudaStream_t of torch's current stream on `device`, as an int for ctypes."""
    if isinstance(device, torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
    elif device is None:
        idx = torch.cuda.current_device()
    else:
        idx = int(device)
    if _raw_stream is not None:
        return _raw_stream(idx)
    return torch.cuda.current_stream(idx).cuda_stream  # pragma: no cover


# current_device() -> torch's current CUDA device index, without torch.cuda.current_device()'s
# lazy-init test (launch paths hold CUDA tensors, so CUDA is initialised): for fast paths that
# compare it with the device they were planned for. -1 on torch builds without CUDA.
current_device = torch._C._cuda_getDevice if torch.version.cuda else (-1).__int__
_SAME_DEVICE = contextlib.nullcontext()


def on_device(device: torch.device | int) -> contextlib.AbstractContextManager:
    """``with on_device(t.device): launch(...)``: make the tensors' GPU torch's current device for
    a launch, and restore the caller's afterwards.

    A launcher enqueues its kernels on the current device's context, so tensors on another GPU
    (cuda:1 while cuda:0 is current) would be read by a kernel on the wrong GPU: an illegal
    address or a stream from another context. Every launch of a kernel module sits in this
    context, except the batch decode launcher's, which switches devices itself (DecodeArgs.device)
    to keep run()'s host time. When the device is already current (the common case) it returns a
    shared no-op context after one device query (0.3-0.4 us on the lent GPU machines' hosts);
    else torch.cuda.device(index).
    """
    idx = device.index if isinstance(device, torch.device) else device
    if idx is None or idx < 0:  # a CPU or meta device, or the host simulation's -1
        return _SAME_DEVICE
    cur = current_device()
    if idx == cur or cur < 0:  # cur < 0: a torch without CUDA, where nothing can launch
        return _SAME_DEVICE
    return torch.cuda.device(idx)


def ptr(t: torch.Tensor | None) -> int | None:
    """data_ptr() of a tensor, None (NULL) for None."""
    return None if t is None else t.data_ptr()


# What a launcher returns when it refuses a stream that is being captured (fi::refuse_capture in
# fi/common.cuh): cudaErrorStreamCaptureUnsupported.
CAPTURE_REFUSED = 900


def is_capturing() -> bool:
    """Whether the current stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# is_capturing() for launch paths on a CUDA device: torch.cuda.is_current_stream_capturing()
# minus its Python frame and the availability test (torch.compile must not trace it: traced calls
# take a checked path). CPU-only builds carry a placeholder of the C function that raises, hence
# the version test; on a machine without a GPU call is_capturing() instead.
capturing = torch._C._cuda_isCurrentStreamCapturing if torch.version.cuda else is_capturing
