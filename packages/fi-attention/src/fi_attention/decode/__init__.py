"""Decode attention: one query token per request over a paged (batch) or contiguous (single) KV
cache. CUDA-core kernel that reads each K/V row once for a whole GQA group, split-KV for short
batches; see decode.cu for the design."""

from .batch import BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper
from .single import single_decode_with_kv_cache

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
           "single_decode_with_kv_cache"]
