"""Split-KV planning for batch decode: pure Python/numpy, no device access.

Decode reads every K/V row once, so its time is bytes / bandwidth only if every SM streams until
the end. Two things break that: a batch with fewer (request x kv-head) CTAs than the GPU holds at
once leaves SMs idle, and a grid of equal long CTAs that is not a whole number of waves leaves
the GPU partly idle during its last wave (1024 CTAs on 396 slots = 2.59 waves: the third wave
runs 59 % full and the kernel reaches 86 % of the bandwidth, which is what the H200 measured).

The planner therefore cuts requests into chunks of at most ``chunk`` tokens (equal sizes, the
last one shorter) and picks the chunk with the smallest modelled time (see :func:`_model_time`).
A grid that fits in one resident wave lasts as long as the larger of its share of the HBM
bandwidth and its busiest SM's streaming (an SM with one CTA streams slower than its share, two
or more faster), plus a prologue per CTA on the busiest SM. A larger grid runs in waves of the
longest CTA (or a greedy bound for unequal CTAs), where later CTAs' prologues hide behind other
CTAs' streaming. Either way a split adds the merge: each chunk writes a partial (o, lse) into the
float workspace, and a merge kernel combines a request's partials.

A work item is ``(request, token_begin, token_end, slot)``; ``slot`` is -1 for a request that is
not split (the decode kernel writes the output directly) and otherwise indexes the partial
buffers. ``merge_indptr[b]:merge_indptr[b+1]`` are request b's slots (empty when not split).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

# Below this many tokens a chunk costs more in merge traffic and launch tail than it saves.
MIN_CHUNK_TOKENS = 256
# Chunk sizes are multiples of this, so a CTA's last tile is rarely a partial one.
CHUNK_ALIGN = 16
# The model's time unit: one token (of one kv head) streamed at an SM's share of the HBM bandwidth
# (~67 tokens/us per SM on the H200 at 4.5 TB/s, bf16 head_dim 128). One-wave grids, fitted to
# split sweeps on the H200 (benchmarks/results/h200/decode_split_sweep_*.txt, batch 1-32, kv
# 4096-32768): an SM with a single resident CTA streams at ~0.8 of its share (b1 kv32768 as 128
# CTAs of 2048 tokens: 51.5 us); with two or more it can take more than its share while other SMs
# idle (~1.35 measured; 1.1 here, so that grids balanced to within one CTA per SM win); each CTA
# on the busiest SM costs ~2.6 us of prologue (dependent loads work -> indptr -> page -> first K
# row) and epilogue (b1 kv32768: 256 CTAs 43.5 us, 392 CTAs 46.1); the merge kernel ~2 us.
ONE_CTA_RATE = 0.8
MULTI_CTA_RATE = 1.1
CTA_COST_TOKENS = 175
MERGE_COST_TOKENS = 135
# Grids of several waves, in "tokens one CTA streams" (the unit above times CTAs per SM): the
# prologue and epilogue of a CTA after the first wave, mostly hidden by the other CTAs of its SM;
# the merge. These reproduce the H200's large-batch results (b128 kv8192: 5 chunks per request,
# 12.9 waves, 970 us; whole requests, 2.59 waves, 86 % of the bandwidth).
WAVE_CTA_COST_TOKENS = 24
WAVE_MERGE_COST_TOKENS = 64
# Most waves the automatic split goes to; bounds the work items (CUDA-graph capacity).
MAX_WAVES = 12
# Candidate chunk counts of the longest request (its chunks decide the critical path).
MAX_PIECES = 32


@dataclass(frozen=True)
class DecodePlan:
    work: np.ndarray          # int32 [n_items, 4], a view of packed
    merge_indptr: np.ndarray  # int32 [batch + 1], a view of packed
    num_items: int
    num_slots: int            # partial states needed (0 when nothing is split)
    chunk: int                # tokens per chunk (0: no split)
    split: bool
    # int32 [n_items * 4 + 4 + batch + 1]: work | num_items, 0, 0, 0 | merge_indptr, the device
    # metadata layout when the grid has exactly n_items items: the wrapper stages it in one copy.
    packed: np.ndarray = field(repr=False)


def kv_lengths(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    """Token count of each request: ``(pages - 1) * page_size + last_page_len`` (0 without pages)."""
    pages = np.diff(indptr.astype(np.int64))
    return np.where(pages > 0, (pages - 1) * page_size + last_page_len.astype(np.int64), 0)


def max_items(batch: int, kv_units: int, sm_count: int, ctas_per_sm: int) -> int:
    """Upper bound on work items the automatic planner produces for a batch (CUDA-graph
    capacity): one per request, plus at most MAX_WAVES waves of chunks."""
    return batch + MAX_WAVES * _wave_items(kv_units, sm_count, ctas_per_sm)


def _wave_items(kv_units: int, sm_count: int, ctas_per_sm: int) -> int:
    return max(1, (sm_count * ctas_per_sm) // max(kv_units, 1))


def _model_time(items: np.ndarray, chunks: np.ndarray, total: int, longest: int, kv_units: int,
                sm_count: int, ctas_per_sm: int) -> np.ndarray:
    """Modelled kernel time (in the unit of the module constants) of candidate chunks given their
    item counts."""
    slots = max(1, sm_count * ctas_per_sm)
    ctas = items * kv_units
    cta = np.minimum(chunks, longest).astype(np.float64)
    split = np.where(chunks < longest, 1.0, 0.0)
    # One wave: every CTA is resident from the start. (In-place numpy: this runs on every
    # non-uniform plan(), where each numpy call is ~1 us of host time.)
    per_sm = (ctas + (sm_count - 1)) // sm_count
    one = per_sm * cta
    one *= np.where(per_sm <= 1, 1.0 / ONE_CTA_RATE, 1.0 / MULTI_CTA_RATE)
    np.maximum(one, total * kv_units / sm_count, out=one)
    one += per_sm * CTA_COST_TOKENS
    one += split * MERGE_COST_TOKENS
    # Several waves: equal CTAs take ceil(ctas / slots) waves of the longest; unequal ones are
    # bounded by greedy list scheduling (total / slots + longest CTA). Both are upper bounds.
    c = cta + WAVE_CTA_COST_TOKENS
    many = (ctas + (slots - 1)) // slots * c
    greedy = ctas * (WAVE_CTA_COST_TOKENS / slots)
    greedy += c
    greedy += total * kv_units / slots
    np.minimum(many, greedy, out=many)
    many += split * WAVE_MERGE_COST_TOKENS
    many *= slots / sm_count
    # ... plus the first wave's prologues, which nothing hides (as in a one-wave grid).
    many += ctas_per_sm * CTA_COST_TOKENS
    return np.where(ctas <= slots, one, many)


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

    Examples
    --------
    >>> p = plan_decode(np.full(128, 8192), kv_units=8, sm_count=132, ctas_per_sm=3)
    >>> p.split, p.num_items   # 1024 CTAs = 2.59 waves -> 5 chunks each: 5120 CTAs = 12.9 waves
    (True, 640)

    See Also
    --------
    plan_uniform : the same for a batch whose requests all have one length, without the array.
    """
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    batch = int(kv_lens.shape[0])
    longest = int(kv_lens.max()) if batch else 0
    if batch and int(kv_lens.min()) == longest:  # uniform batches (benchmarks, padded serving)
        return plan_uniform(batch, longest, kv_units, sm_count, ctas_per_sm, disable_split_kv,
                            fixed_split_size, capacity)
    return _plan(kv_lens, batch, longest, kv_units, sm_count, ctas_per_sm, disable_split_kv,
                 fixed_split_size, capacity)


@functools.lru_cache(maxsize=1024)
def plan_uniform(batch: int, length: int, kv_units: int, sm_count: int, ctas_per_sm: int,
                 disable_split_kv: bool = False, fixed_split_size: Optional[int] = None,
                 capacity: Optional[int] = None) -> DecodePlan:
    """:func:`plan_decode` of ``batch`` requests of ``length`` tokens each. It depends on scalars
    only, so it is computed once per argument tuple (pass them positionally: that is the cache
    key) and its arrays are read-only."""
    plan = _plan(np.full(batch, length, dtype=np.int64), batch, length, kv_units, sm_count,
                 ctas_per_sm, disable_split_kv, fixed_split_size, capacity, uniform=True)
    for a in (plan.packed, plan.work, plan.merge_indptr):
        a.flags.writeable = False
    return plan


# Candidate divisors: the longest request in k = 1..MAX_PIECES equal pieces, the whole batch in
# one or two CTAs per SM or in w = 1..MAX_WAVES whole waves (few candidates: each costs a share of
# the ~1 us per numpy call of a non-uniform batch's search).
_PIECES = np.arange(1, MAX_PIECES + 1, dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _batch_divisors(kv_units: int, sm_count: int, ctas_per_sm: int) -> np.ndarray:
    """Work-item counts that put j CTAs on every SM, for the candidate j (read-only)."""
    j = np.unique(np.concatenate((np.array([1, 2], dtype=np.int64),
                                  ctas_per_sm * np.arange(1, MAX_WAVES + 1, dtype=np.int64))))
    d = np.maximum(np.floor(j * (sm_count / max(kv_units, 1))), 1).astype(np.int64)
    d.flags.writeable = False
    return d


def _choose_chunk(kv_lens, batch, longest, kv_units, sm_count, ctas_per_sm, capacity, uniform) -> int:
    """The candidate chunk with the smallest modelled time (ties: the larger chunk, for fewer
    items and less merge traffic); ``longest`` means no split. About 30 numpy calls on arrays of
    MAX_PIECES + MAX_WAVES + 2 candidates: each costs about a microsecond, whatever the batch."""
    limit = batch + MAX_WAVES * _wave_items(kv_units, sm_count, ctas_per_sm)
    if capacity is not None:
        limit = min(limit, capacity)
    # The longest chunk (k = 1, which rounds and clamps to longest) has one item per request and
    # every other candidate more: if even it does not fit, take it anyway (only reachable with a
    # tiny capacity) and let the caller report the overflow.
    if batch > limit:
        return longest
    total = batch * longest if uniform else int(kv_lens.sum())
    # ceil(x / d) - 1 = (x - 1) // d; rounding ceil(x / d) up to CHUNK_ALIGN is then (q + A) // A * A
    q = np.concatenate(((longest - 1) // _PIECES,
                        (total - 1) // _batch_divisors(kv_units, sm_count, max(ctas_per_sm, 1))))
    cands = (q + CHUNK_ALIGN) // CHUNK_ALIGN * CHUNK_ALIGN
    np.maximum(cands, MIN_CHUNK_TOKENS, out=cands)
    np.minimum(cands, longest, out=cands)
    cands.sort()  # duplicates stay: they have equal costs and do not change the choice below
    if uniform:
        items = batch * ((longest - 1) // cands + 1)
    else:  # float64 division of integers < 2^53 is exact where it matters (multiples)
        m = np.divide(np.maximum(kv_lens, 1).astype(np.float64), cands[:, None])
        np.ceil(m, out=m)
        items = m.sum(axis=1).astype(np.int64)
    cost = _model_time(items, cands, total, longest, kv_units, sm_count, ctas_per_sm)
    cost[items > limit] = np.inf
    return int(cands[len(cands) - 1 - int(np.argmin(cost[::-1]))])


def _plan(kv_lens, batch, longest, kv_units, sm_count, ctas_per_sm, disable_split_kv,
          fixed_split_size, capacity, uniform=False) -> DecodePlan:
    chunk = 0
    if fixed_split_size is not None and fixed_split_size > 0 and not disable_split_kv:
        chunk = int(fixed_split_size)
    elif not disable_split_kv and longest > MIN_CHUNK_TOKENS:
        chunk = _choose_chunk(kv_lens, batch, longest, kv_units, sm_count, ctas_per_sm, capacity, uniform)
    if chunk and chunk >= longest:
        chunk = 0
    if not chunk:  # the common large-batch case: one item per request, written directly
        if capacity is not None and batch > capacity:
            raise ValueError(f"the plan needs {batch} work items but the CUDA-graph buffers hold {capacity}")
        packed = np.zeros(batch * 4 + 4 + batch + 1, dtype=np.int32)
        work = packed[: batch * 4].reshape(batch, 4)
        work[:, 0] = np.arange(batch)
        work[:, 2] = kv_lens
        work[:, 3] = -1
        packed[batch * 4] = batch
        return DecodePlan(work=work, merge_indptr=packed[batch * 4 + 4:], num_items=batch, num_slots=0,
                          chunk=0, split=False, packed=packed)
    nchunks = (np.maximum(kv_lens, 1) - 1) // chunk + 1
    ends = np.cumsum(nchunks)
    n_items = int(ends[-1])
    if capacity is not None and n_items > capacity:
        raise ValueError(f"the plan needs {n_items} work items but the CUDA-graph buffers hold "
                         f"{capacity}; use a larger fixed_split_size or disable_split_kv")
    packed = np.empty(n_items * 4 + 4 + batch + 1, dtype=np.int32)
    packed[n_items * 4: n_items * 4 + 5] = (n_items, 0, 0, 0, 0)
    merge_indptr = packed[n_items * 4 + 4:]
    split_req = nchunks > 1
    np.cumsum(nchunks * split_req, out=merge_indptr[1:])
    # Per request: index, length, first item, first partial slot (-1 when not split: its single
    # item writes the output), repeated once per item in one call.
    per_req = np.empty((batch, 4), dtype=np.int64)
    per_req[:, 0] = np.arange(batch)
    per_req[:, 1] = kv_lens
    per_req[:, 2] = ends - nchunks
    per_req[:, 3] = np.where(split_req, merge_indptr[:-1], -1)
    rows = np.repeat(per_req, nchunks, axis=0)
    piece = np.arange(n_items) - rows[:, 2]  # chunk index within its request
    begin = piece * chunk
    work = packed[: n_items * 4].reshape(n_items, 4)
    work[:, 0] = rows[:, 0]
    work[:, 1] = begin
    work[:, 2] = np.minimum(begin + chunk, rows[:, 1])
    work[:, 3] = rows[:, 3] + piece  # an unsplit request's only item: -1 + 0
    return DecodePlan(work=work, merge_indptr=merge_indptr, num_items=n_items,
                      num_slots=int(merge_indptr[-1]), chunk=chunk, split=n_items > batch, packed=packed)
