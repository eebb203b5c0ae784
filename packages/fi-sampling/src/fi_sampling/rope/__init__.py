"""RoPE (flashinfer.rope): rotary position embedding of q and k in one pass."""

from .api import (
    apply_llama31_rope, apply_llama31_rope_inplace, apply_llama31_rope_pos_ids,
    apply_llama31_rope_pos_ids_inplace, apply_rope, apply_rope_inplace, apply_rope_pos_ids,
    apply_rope_pos_ids_inplace, apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)

__all__ = [
    "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace", "apply_rope", "apply_rope_inplace",
    "apply_rope_pos_ids", "apply_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
]
