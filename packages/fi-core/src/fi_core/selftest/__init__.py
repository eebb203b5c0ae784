"""fi-core's self-test kernel: y = a * x + b, plus an empty kernel for launch-overhead probes."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..arch import Arch, arch_of
from ..jit import Entry, KernelSpec, load
from ..launch import current_stream, on_device

_HERE = Path(__file__).resolve().parent


@functools.cache
def selftest_spec(arch: Arch) -> KernelSpec:
    return KernelSpec(
        name="fi_selftest",
        sources=(_HERE / "selftest.cu",),
        arch=arch,
        entries=(
            Entry("fi_selftest_axpb", ("ptr", "ptr", "f32", "f32", "i64", "stream")),
            Entry("fi_selftest_noop", ("stream",)),
        ),
        package="fi_core.selftest",
    )


def axpb_reference(x: torch.Tensor, a: float, b: float) -> torch.Tensor:
    return (a * x.double() + b).float()


def axpb(x: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """y = a * x + b on a float32 CUDA tensor (or the reference on CPU)."""
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if x.device.type != "cuda":
        return axpb_reference(x, a, b)
    x = x.contiguous()
    y = torch.empty_like(x)
    mod = load(selftest_spec(arch_of(x.device)))
    with on_device(x.device):
        mod.fi_selftest_axpb(y.data_ptr(), x.data_ptr(), a, b, x.numel(), current_stream(x.device))
    return y


def run_check(n: int = 1_000_003) -> str:
    """End-to-end check on the current GPU; returns a one-line report or raises."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=g)
    y = axpb(x, 1.5, -0.25)
    ref = axpb_reference(x, 1.5, -0.25)
    err = (y - ref).abs().max().item()
    if not err <= 1e-6:
        raise RuntimeError(f"self-test kernel is wrong: max abs error {err}")
    return f"self-test kernel OK on {torch.cuda.get_device_name()} (n={n}, max abs err {err:.1e})"
