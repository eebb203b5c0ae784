"""Pure-torch references of the gated activations: fp32 math, one rounding at the end."""

from __future__ import annotations

import math

import torch


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    raise ValueError(f"unknown activation {name!r}; expected silu, gelu or gelu_tanh")


def act_and_mul_reference(input: torch.Tensor, act: str) -> torch.Tensor:
    """``act(input[..., :d]) * input[..., d:]`` with ``d = input.shape[-1] // 2``."""
    d = input.shape[-1] // 2
    x = input.float()
    return (_act(act, x[..., :d]) * x[..., d:]).to(input.dtype)
