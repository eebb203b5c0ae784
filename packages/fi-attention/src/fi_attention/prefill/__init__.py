"""Prefill attention: single request, ragged and paged batches (FlashInfer's flashinfer.prefill).

Backends: ``fa2`` (portable mma.sync kernel, sm_80+, prefill_fa2.cu), ``fa3`` (Hopper kernel in
``hopper/``), ``reference`` (CPU). See backends.py for dispatch and launch.py for the seam.
"""

from .api import single_prefill_with_kv_cache, single_prefill_with_kv_cache_return_lse
from .packbits import packbits, segment_packbits
from .wrappers import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

__all__ = [
    "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
    "packbits", "segment_packbits",
    "BatchPrefillWithRaggedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
]
