"""Host planner of the fa2 prefill kernel: pure numpy, no device work.

The kernel's grid is persistent (a fixed number of CTAs, so CUDA graphs can replay any plan);
the planner cuts every (request, kv head) into work items of ``cta_rows`` packed query rows
(query token x GQA group member) over a kv range, splits long kv ranges when there is too little
work to fill the GPU (short queries over long KV), and hands items to CTAs longest first, each to
the least-loaded CTA (LPT scheduling). Split items write fp32 partial states to workspace slots
that a merge pass combines.

Invariants (tested in tests/prefill/test_plan.py): every (query row, qo head, visible kv token)
is covered by exactly one work item; items of one split share rows and get consecutive slots.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

KV_TILE = 64  # cost unit and split granularity in kv tokens (a multiple of every kernel kv tile)

# Columns of the work and merge tables (prefill_fa2.cu kWorkFields / kMergeFields).
WORK_FIELDS = ("request", "kv_head", "row_start", "kv_start", "kv_end", "slot")
MERGE_FIELDS = ("request", "kv_head", "row_start", "slot0", "num_slots")


@dataclass
class Plan:
    work: np.ndarray          # int32 [num_items, 6]
    work_indptr: np.ndarray   # int32 [num_ctas + 1]
    merge: np.ndarray         # int32 [num_merge, 5]
    num_slots: int            # partial (o, lse) slots of cta_rows rows each
    cta_loads: np.ndarray     # int64 [num_ctas] modelled cost per CTA (kv tiles + 1 per item)
    cta_rows: int = 0         # packed rows per work item
    short: bool = False       # planned for the narrow "short batch" kernel tile (spec.tile_config)

    @property
    def num_ctas(self) -> int:
        return len(self.work_indptr) - 1


def kv_extent(qo_len: int, kv_len: int, row_start: int, cta_rows: int, group: int, causal: bool,
              window_left: int) -> tuple[int, int]:
    """Kv tokens [lo, hi) that rows [row_start, row_start + cta_rows) of a request can see
    (the kernel clips the same way)."""
    off = kv_len - qo_len
    min_qi = row_start // group
    max_qi = min((row_start + cta_rows - 1) // group, qo_len - 1)
    lo, hi = 0, kv_len
    if causal:
        hi = min(hi, max_qi + off + 1)
    if window_left >= 0:
        lo = max(lo, min_qi + off - window_left)
    return lo, max(lo, hi)


def plan_fa2(qo_lens, kv_lens, *, num_kv_heads: int, group: int, cta_rows: int, causal: bool,
             window_left: int, num_ctas: int, max_slots: int, allow_split: bool = True) -> Plan:
    """Plan one batch.

    Parameters
    ----------
    qo_lens, kv_lens : sequence of int
        Per-request query and kv lengths (0 allowed).
    num_kv_heads, group : int
        KV heads and qo heads per kv head.
    cta_rows : int
        Packed rows per work item (the kernel's CTA_M).
    num_ctas : int
        Persistent grid size (SM count x resident CTAs per SM).
    max_slots : int
        Partial-state slots the workspace holds; splitting never needs more.
    """
    qo_lens = np.asarray(qo_lens, dtype=np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    if num_ctas < 1:
        raise ValueError(f"num_ctas must be >= 1, got {num_ctas}")
    # Row tiles of every request (kv heads are added below): (req, row_start, lo, hi).
    tiles = []
    for b in range(len(qo_lens)):
        ql, kl = int(qo_lens[b]), int(kv_lens[b])
        for rs in range(0, ql * group, cta_rows):
            lo, hi = kv_extent(ql, kl, rs, cta_rows, group, causal, window_left)
            tiles.append((b, rs, lo, hi))
    if not tiles:
        return Plan(np.zeros((0, 6), np.int32), np.zeros(num_ctas + 1, np.int32),
                    np.zeros((0, 5), np.int32), 0, np.zeros(num_ctas, np.int64), cta_rows)
    t = np.asarray(tiles, dtype=np.int64)
    ntile = -(-(t[:, 3] - t[:, 2]) // KV_TILE)

    # Split kv ranges into chunks of `chunk` tiles when one item would dominate a CTA.
    chunk = None
    if allow_split and max_slots > 0:
        total = int((ntile + 1).sum()) * num_kv_heads
        ideal = total / num_ctas
        if ntile.max() + 1 > 1.25 * ideal:
            chunk = max(2, math.ceil(ideal))
            while True:
                pieces = -(-ntile // chunk)
                slots = int(pieces[pieces > 1].sum()) * num_kv_heads
                if slots <= max_slots:
                    break
                chunk *= 2

    items, merges, slot = [], [], 0
    for (b, rs, lo, hi), n in zip(t.tolist(), ntile.tolist()):
        pieces = -(-n // chunk) if chunk and n > chunk else 1
        for h in range(num_kv_heads):
            if pieces == 1:
                items.append((b, h, rs, lo, hi, -1))
                continue
            merges.append((b, h, rs, slot, pieces))
            for i in range(pieces):
                a = lo + i * chunk * KV_TILE
                items.append((b, h, rs, a, min(hi, a + chunk * KV_TILE), slot))
                slot += 1
    work = np.asarray(items, dtype=np.int64)
    cost = -(-(work[:, 4] - work[:, 3]) // KV_TILE) + 1

    # LPT: longest item first onto the least-loaded CTA; ties keep submission order.
    order = np.argsort(-cost, kind="stable")
    heap = [(0, c) for c in range(num_ctas)]
    owner = np.empty(len(work), dtype=np.int64)
    for i in order.tolist():
        load, c = heapq.heappop(heap)
        owner[i] = c
        heapq.heappush(heap, (load + int(cost[i]), c))
    by_cta = np.lexsort((-cost, owner))  # grouped by CTA, longest first within a CTA
    work = work[by_cta]
    counts = np.bincount(owner, minlength=num_ctas)
    indptr = np.zeros(num_ctas + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    loads = np.bincount(owner, weights=cost, minlength=num_ctas).astype(np.int64)
    return Plan(work.astype(np.int32), indptr.astype(np.int32),
                np.asarray(merges, dtype=np.int32).reshape(-1, 5), slot, loads, cta_rows)
