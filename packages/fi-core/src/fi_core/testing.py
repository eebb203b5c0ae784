"""Test helpers shared by every package: tolerances, random inputs, comparisons, GPU markers.

Tolerances live in one table per output dtype. Attention and GEMM tests may instead compare
against a same-precision torch run (:func:`assert_close_to_reference_run`): the kernel's error must
stay within ``factor`` times torch's own error at that precision plus a small atol.
"""

from __future__ import annotations

from typing import Optional
from collections.abc import Sequence

import torch

# (atol, rtol) by output dtype: the result of fp32 math rounded once to the output type.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2),
    torch.float8_e4m3fn: (6.25e-2, 1.25e-1),
    torch.float8_e5m2: (1.25e-1, 2.5e-1),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance declared for {dtype}; add it to fi_core.testing.TOLERANCES") from None


def has_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def generator(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape: Sequence[int], dtype=torch.float32, device="cpu", seed: int = 0,
          scale: float = 1.0) -> torch.Tensor:
    """N(0, scale^2) values drawn in fp32 on the CPU (so the same seed gives the same data on any
    device) and then cast. Never zeros."""
    g = generator(seed)
    t = torch.randn(tuple(shape), generator=g, dtype=torch.float32) * scale
    return t.to(device=device, dtype=dtype)


def rand(shape: Sequence[int], dtype=torch.float32, device="cpu", seed: int = 0,
         low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    g = generator(seed)
    t = torch.rand(tuple(shape), generator=g, dtype=torch.float32) * (high - low) + low
    return t.to(device=device, dtype=dtype)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (floats) or a sentinel (ints) so unwritten elements show."""
    if t.is_floating_point():
        if t.dtype in (torch.float8_e4m3fn,):
            t.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        elif t.dtype == torch.float8_e5m2:
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))
    else:
        t.fill_(-0x5A5A5A5A if t.dtype in (torch.int32, torch.int64) else 0x5A)
    return t


def empty_poisoned(shape, dtype, device) -> torch.Tensor:
    return poison_(torch.empty(tuple(shape), dtype=dtype, device=device))


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64 (inf if a has NaN/inf where e does not)."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    if not torch.isfinite(a).all() and torch.isfinite(e).all():
        return float("inf")
    den = e.norm().item()
    return (a - e).norm().item() / (den if den > 0 else 1.0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: Optional[torch.dtype] = None,
                 atol: Optional[float] = None, rtol: Optional[float] = None, msg: str = "") -> None:
    """Elementwise |a - e| <= atol + rtol * |e| with the tolerance of `dtype` (default: actual's
    dtype). NaN anywhere in `actual` where `expected` is finite fails. Reports the worst element."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{msg}shape mismatch: got {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    d_atol, d_rtol = tolerance(dtype or actual.dtype)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    both_nan = torch.isnan(a) & torch.isnan(e)
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = (a - e).abs()
    bad = ~(both_nan | same_inf) & ~(diff <= atol + rtol * e.abs())
    if bad.any():
        n_bad = int(bad.sum())
        idx = int(torch.nonzero(bad.flatten())[0])
        flat_diff = torch.where(bad, diff.nan_to_num(float("inf")), torch.zeros_like(diff)).flatten()
        worst = int(flat_diff.argmax())
        coords = tuple(int(c) for c in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
        raise AssertionError(
            f"{msg}{n_bad}/{a.numel()} elements outside atol={atol:g} rtol={rtol:g}; "
            f"first bad flat index {idx}; worst at {coords}: got {a.flatten()[worst].item()!r}, "
            f"expected {e.flatten()[worst].item()!r}; rel. error (2-norm) {rel_error(a, e):.3e}")


def assert_close_to_reference_run(actual: torch.Tensor, same_precision: torch.Tensor,
                                  exact: torch.Tensor, *, factor: float = 2.0,
                                  atol: float = 1e-5, msg: str = "") -> None:
    """FA3-style bound: max|actual - exact| <= factor * max|same_precision - exact| + atol, where
    `same_precision` is torch's own computation at the kernel's precision and `exact` fp32/fp64."""
    ex = exact.detach().double().cpu()
    err = (actual.detach().double().cpu() - ex).abs().max().item()
    base = (same_precision.detach().double().cpu() - ex).abs().max().item()
    if not err <= factor * base + atol:
        raise AssertionError(
            f"{msg}max error {err:.3e} > {factor} x torch's same-precision error {base:.3e} + {atol:g}")


def gpu_only():
    """pytest marks for a GPU test: `pytestmark = fi_core.testing.gpu_only()`."""
    import pytest  # noqa: PLC0415

    return [pytest.mark.gpu, pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")]


def require_cc(cc: int, why: str, device="cuda"):
    """Skip the calling test (or fixture) unless `device` has compute capability `cc` (90 for
    sm_90 kernels built as sm_90a); returns the device's Arch. `why` is the skip reason."""
    import pytest  # noqa: PLC0415

    from .arch import arch_of  # noqa: PLC0415

    arch = arch_of(torch.device(device))
    if arch.cc != cc:
        pytest.skip(why)
    return arch
