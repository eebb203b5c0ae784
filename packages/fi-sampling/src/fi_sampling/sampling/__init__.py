"""Sorting-free sampling (flashinfer.sampling): top-k / top-p / min-p by exact rejection sampling
with a rising pivot, renorm / mask by an exact threshold search, softmax, speculative sampling."""

from .api import (
    min_p_sampling_from_probs, sampling_from_logits, sampling_from_probs, softmax,
    top_k_mask_logits, top_k_renorm_probs, top_k_sampling_from_probs,
    top_k_top_p_sampling_from_logits, top_k_top_p_sampling_from_probs, top_p_renorm_probs,
    top_p_sampling_from_probs,
)
from .speculative import chain_speculative_sampling

__all__ = [
    "chain_speculative_sampling", "min_p_sampling_from_probs", "sampling_from_logits",
    "sampling_from_probs", "softmax", "top_k_mask_logits", "top_k_renorm_probs",
    "top_k_sampling_from_probs", "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs", "top_p_renorm_probs", "top_p_sampling_from_probs",
]
