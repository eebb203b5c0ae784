"""Split-KV planning for batch decode: pure Python/numpy, no device access.

Decode reads every K/V row once, so its time is bytes / bandwidth only if every SM streams. A
batch with fewer (request x kv-head) CTAs than the GPU holds at once leaves SMs idle; the planner
then cuts long requests into chunks of at most ``chunk`` tokens (equal sizes, the last one
shorter) so that the number of CTAs reaches one full wave of resident CTAs. Each chunk writes a
partial (o, lse) into the float workspace; a merge kernel combines a request's partials.

A work item is ``(request, token_begin, token_end, slot)``; ``slot`` is -1 for a request that is
not split (the decode kernel writes the output directly) and otherwise indexes the partial
buffers. ``merge_indptr[b]:merge_indptr[b+1]`` are request b's slots (empty when not split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

# Below this many tokens a chunk costs more in merge traffic and launch tail than it saves.
MIN_CHUNK_TOKENS = 256
# Chunk sizes are multiples of this, so a CTA's last tile is rarely a partial one.
CHUNK_ALIGN = 16


@dataclass(frozen=True)
class DecodePlan:
    work: np.ndarray          # int32 [n_items, 4]
    merge_indptr: np.ndarray  # int32 [batch + 1]
    num_items: int
    num_slots: int            # partial states needed (0 when nothing is split)
    chunk: int                # tokens per chunk (0: no split)
    split: bool


def kv_lengths(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    """Token count of each request: ``(pages - 1) * page_size + last_page_len`` (0 without pages)."""
    pages = np.diff(indptr.astype(np.int64))
    return np.where(pages > 0, (pages - 1) * page_size + last_page_len.astype(np.int64), 0)


def max_items(batch: int, kv_units: int, sm_count: int, ctas_per_sm: int) -> int:
    """Upper bound on work items the planner can produce for a batch (CUDA-graph capacity)."""
    target = max(1, (sm_count * ctas_per_sm) // max(kv_units, 1))
    return batch + target


def plan_decode(kv_lens: np.ndarray, *, kv_units: int, sm_count: int, ctas_per_sm: int,
                disable_split_kv: bool = False, fixed_split_size: Optional[int] = None,
                capacity: Optional[int] = None) -> DecodePlan:
    """Choose chunks for a batch of requests of ``kv_lens`` tokens.

    Parameters
    ----------
    kv_lens : np.ndarray
        int64 ``[batch]`` token counts.
    kv_units : int
        CTAs per work item (kv heads x query-head subgroups).
    sm_count, ctas_per_sm : int
        SMs of the GPU and resident decode CTAs per SM: one wave holds their product.
    disable_split_kv : bool
        One work item per request.
    fixed_split_size : int, optional
        Chunk size in tokens (> 0) instead of the automatic choice (the wrapper converts
        FlashInfer's page count to tokens).
    capacity : int, optional
        Most work items allowed (CUDA-graph mode); the automatic chunk grows to respect it.
    """
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    batch = int(kv_lens.shape[0])
    total = int(kv_lens.sum())
    longest = int(kv_lens.max()) if batch else 0
    wave_items = max(1, (sm_count * ctas_per_sm) // max(kv_units, 1))
    chunk = 0
    if fixed_split_size is not None and fixed_split_size > 0 and not disable_split_kv:
        chunk = int(fixed_split_size)
    elif not disable_split_kv and batch < wave_items and longest > MIN_CHUNK_TOKENS:
        chunk = -(-total // wave_items)
        chunk = max(MIN_CHUNK_TOKENS, -(-chunk // CHUNK_ALIGN) * CHUNK_ALIGN)
        if capacity is not None:
            while int(np.sum(np.maximum(1, -(-kv_lens // chunk)))) > capacity:
                chunk *= 2
    if chunk and chunk >= longest:
        chunk = 0
    if chunk:
        nchunks = np.maximum(1, -(-kv_lens // chunk))
    else:
        nchunks = np.ones(batch, dtype=np.int64)
    n_items = int(nchunks.sum())
    if capacity is not None and n_items > capacity:
        raise ValueError(f"the plan needs {n_items} work items but the CUDA-graph buffers hold "
                         f"{capacity}; use a larger fixed_split_size or disable_split_kv")
    req = np.repeat(np.arange(batch, dtype=np.int64), nchunks)
    first = np.concatenate([[0], np.cumsum(nchunks)[:-1]]) if batch else np.zeros(0, np.int64)
    idx_in_req = np.arange(n_items, dtype=np.int64) - np.repeat(first, nchunks)
    split_req = nchunks > 1
    if chunk:
        begin = idx_in_req * chunk
        end = np.minimum(begin + chunk, kv_lens[req])
    else:
        begin = np.zeros(n_items, dtype=np.int64)
        end = kv_lens[req] if batch else np.zeros(0, np.int64)
    slots_per_req = np.where(split_req, nchunks, 0)
    merge_indptr = np.concatenate([[0], np.cumsum(slots_per_req)]).astype(np.int32)
    slot = np.where(split_req[req], merge_indptr[:-1][req] + idx_in_req, -1) if batch else begin
    work = np.stack([req, begin, end, slot], axis=1).astype(np.int32) if batch else \
        np.zeros((0, 4), np.int32)
    return DecodePlan(work=work, merge_indptr=merge_indptr, num_items=n_items,
                      num_slots=int(merge_indptr[-1]), chunk=chunk, split=bool(split_req.any()))
