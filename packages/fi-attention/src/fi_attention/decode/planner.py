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
        # The smallest chunk whose items fit in one wave: every CTA then runs concurrently and
        # the kernel takes one chunk's time. (Rounding a balanced chunk down and letting the
        # per-request ceil spill into a second, mostly empty wave would double the time.)
        limit = wave_items if capacity is None else min(wave_items, capacity)

        def items(c: int) -> int:
            return int(np.sum(np.maximum(1, -(-kv_lens // c))))

        def align(c: int) -> int:
            return max(MIN_CHUNK_TOKENS, -(-c // CHUNK_ALIGN) * CHUNK_ALIGN)

        # hi_c always fits: no request needs more than limit // batch chunks of it.
        hi_c = align(-(-longest // max(1, limit // batch)))
        lo_c = align(-(-total // limit))  # no chunk below this can fit
        if items(lo_c) <= limit:
            hi_c = lo_c
        # A few bisection steps (plan() must stay cheap); within ~6 % of the best is enough.
        for _ in range(8):
            if hi_c - lo_c <= max(CHUNK_ALIGN, lo_c // 16):
                break
            mid = align((lo_c + hi_c) // 2)
            if items(mid) <= limit:
                hi_c = mid
            else:
                lo_c = mid
        chunk = hi_c
    if chunk and chunk >= longest:
        chunk = 0
    if not chunk:  # the common large-batch case: one item per request, written directly
        work = np.empty((batch, 4), dtype=np.int32)
        work[:, 0] = np.arange(batch)
        work[:, 1] = 0
        work[:, 2] = kv_lens
        work[:, 3] = -1
        if capacity is not None and batch > capacity:
            raise ValueError(f"the plan needs {batch} work items but the CUDA-graph buffers hold {capacity}")
        return DecodePlan(work=work, merge_indptr=np.zeros(batch + 1, dtype=np.int32), num_items=batch,
                          num_slots=0, chunk=0, split=False)
    nchunks = np.maximum(1, -(-kv_lens // chunk))
    n_items = int(nchunks.sum())
    if capacity is not None and n_items > capacity:
        raise ValueError(f"the plan needs {n_items} work items but the CUDA-graph buffers hold "
                         f"{capacity}; use a larger fixed_split_size or disable_split_kv")
    req = np.repeat(np.arange(batch), nchunks)
    idx_in_req = np.arange(n_items) - (np.cumsum(nchunks) - nchunks)[req]
    split_req = nchunks > 1
    merge_indptr = np.zeros(batch + 1, dtype=np.int32)
    np.cumsum(np.where(split_req, nchunks, 0), out=merge_indptr[1:])
    work = np.empty((n_items, 4), dtype=np.int32)
    work[:, 0] = req
    work[:, 1] = idx_in_req * chunk
    work[:, 2] = np.minimum(work[:, 1] + chunk, kv_lens[req])
    work[:, 3] = np.where(split_req[req], merge_indptr[req] + idx_in_req, -1)
    return DecodePlan(work=work, merge_indptr=merge_indptr, num_items=n_items,
                      num_slots=int(merge_indptr[-1]), chunk=chunk, split=bool(split_req.any()))
