"""Pure-torch references of the norms: fp32 math, one rounding to the input dtype at the end.

These are the CPU backend, the test oracle and the benchmark's correctness check. Rounding points
match the kernels (and FlashInfer): fused-add rounds the residual sum to the dtype before the norm.
"""

from __future__ import annotations

import torch


def rmsnorm_reference(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      weight_offset: float = 0.0) -> torch.Tensor:
    """``input * rsqrt(mean(input^2, -1) + eps) * (weight + weight_offset)`` over the last dim.

    weight_offset is 0 for RMSNorm and 1 for Gemma's ``(1 + w)``.
    """
    x = input.float()
    rrms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x * rrms * (weight.float() + weight_offset)).to(input.dtype)


def fused_add_rmsnorm_reference(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float = 1e-6, weight_offset: float = 0.0
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(normed, new_residual)`` with ``new_residual = round(input + residual)`` and
    ``normed = rmsnorm(new_residual)`` (the op writes them to input and residual)."""
    r = (input.float() + residual.float()).to(residual.dtype)
    return rmsnorm_reference(r, weight, eps, weight_offset), r


def layernorm_reference(input: torch.Tensor, gemma: torch.Tensor, beta: torch.Tensor,
                        eps: float = 1e-6) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * gemma + beta`` over the last dim (biased variance)."""
    x = input.float()
    mean = x.mean(dim=-1, keepdim=True)
    var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
    return ((x - mean) * torch.rsqrt(var + eps) * gemma.float() + beta.float()).to(input.dtype)
