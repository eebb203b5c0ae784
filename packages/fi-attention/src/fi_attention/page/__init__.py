"""Paged KV cache management (flashinfer.page)."""

from .api import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens

__all__ = ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"]
