"""Gated activations (``flashinfer.activation``): act(x[..., :d]) * x[..., d:]."""

from .api import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul

__all__ = ["gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul"]
