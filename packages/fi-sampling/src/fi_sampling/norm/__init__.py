"""RMSNorm / fused add + RMSNorm (plain and Gemma) and LayerNorm (``flashinfer.norm``)."""

from .api import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, layernorm, rmsnorm

__all__ = ["fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "layernorm", "rmsnorm"]
