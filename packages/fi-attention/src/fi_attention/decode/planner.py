"""Split-KV planning for batch decode: host code only, no device access.

Decode reads every K/V row once, so its time is bytes / bandwidth only if every SM streams until
the end. Two things break that: a batch with fewer (request x kv-head) CTAs than the GPU holds at
once leaves SMs idle, and the last CTAs of a larger grid run while other SMs have nothing left
(1024 CTAs of 8192 tokens on 396 slots: b128 x 8192 unsplit, 1004-1013 us on the H200 against
958-981 in 2 chunks).

The planner therefore cuts requests into chunks of at most ``chunk`` tokens (equal sizes, the
last one shorter) and picks the chunk with the smallest modelled time (see :func:`_model_time`).
A grid that fits in one resident wave lasts as long as the larger of its share of the HBM
bandwidth and its busiest SM's streaming (an SM with one CTA streams slower than its share, two
or more faster), plus a prologue per CTA on the busiest SM. A larger grid is modelled as greedy
list scheduling: the work over the CTA slots, the tail of the longest CTA, and a cost per CTA
that the other CTAs of its SM only partly hide. Either way a split adds the merge: each chunk
writes a partial (o, lse) into the float workspace, and the request's last chunk to finish
combines them (inside the decode grid; a merge kernel where the grid does not merge).

This module is the specification, used for a wrapper's first plan of a uniform batch (whose plans
are cached) and on CPU; plan() of a non-uniform batch, and of any host page table from a wrapper's
second plan on, runs the same search in native code (:class:`NativePlanner`, decode_planner.h),
which the tests hold to bit-identical plans.

A work item is ``(request, token_begin, token_end, slot)``; ``slot`` is -1 for a request that is
not split (the decode kernel writes the output directly) and otherwise indexes the partial
buffers. ``merge_indptr[b]:merge_indptr[b+1]`` are request b's slots (empty when not split).

Equal chunks leave a batch of unequal requests unbalanced: its CTAs end at different times, and
in a multi-wave grid the last ones run while other slots idle. On kernels that run piece chains
(sm_90+: ``pieces``), such a batch may instead take a plan of balanced pieces (:func:`plan_pieces`):
one equal share of the batch's tokens per CTA of a wave, a share crossing request boundaries as a
chain of items run one after the other by one CTA (flags PIECE_NEXT / PIECE_CONT in the request
word). The choice compares a greedy-dispatch model of both plans (see PIECE_GAIN_PCT).
"""

from __future__ import annotations

import ctypes
import functools
import heapq
from typing import NamedTuple, Optional

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
# Since the one-pass merge (session 5, decode_split_sweep_merge_v2.txt) a single CTA per SM is
# taken at 0.75 of the share: b1 kv8192 then runs 256 CTAs of 256 tokens (16.6 us) instead of 128
# of 512 (18.7 us in the same sweep). The 6 other swept shapes (batch 1-32) keep their choices;
# of 704 uniform (kv heads 4-32, batch 1-512, kv 512-65536) batches, the 22 that change all move
# from one CTA per SM (or fewer) to two, as b1 kv8192 did.
# Session 17 (the ring kernel at 2 CTAs per SM, launched with PDL, split requests merged in the
# grid): one CTA per SM now streams at nearly its full share. A sweep of 11 small batches (batch
# 1-32, 32-268 MB of K/V; decode_split_sweep_small_session17.json, tests/decode/test_planner.py's
# H200_SMALL_SWEEPS) was fastest at 128 CTAs (one per SM) on 9 of them, by 2.8-15.5 % over the
# 248-256 CTAs the rate of 0.75 picked (b1 kv32768: 39.3 against 40.4 us in 2048-token chunks; b2
# kv4096: 12.7 against 14.6). Rates of 0.95-0.99 pick the fastest measured split of every small
# batch and keep every choice on the earlier sweeps; 1.0 would leave b16 kv8192 unsplit on the
# register tiles (31 % slower there).
ONE_CTA_RATE = 0.97
MULTI_CTA_RATE = 1.1
CTA_COST_TOKENS = 175
MERGE_COST_TOKENS = 135
# Grids of several waves, in "tokens one CTA streams" (the unit above times CTAs per SM). CTAs
# start as others finish, so the grid lasts about as long as greedy list scheduling predicts: the
# work over the CTA slots, plus WAVE_TAIL of the longest CTA (the expected tail: the last CTA to
# finish started some time before the work ran out; less when the last wave is nearly full, none
# for whole waves of equal CTAs), plus a prologue and epilogue per CTA that the other CTAs of its
# SM only partly hide, plus the merge. Fitted (session 10) to split sweeps of 16 uniform batches
# on the H200 (batch 16-512, kv 512-16384; decode_split_sweep_*session10*.txt, also
# tests/decode/test_planner.py's H200_SWEEPS): among the measured splits of each shape the model
# picks one within 1.8 % of the fastest (5.5 % summed over the shapes), where the previous model,
# which charged a partial last wave as a whole one and 24 tokens per CTA, was up to 6.1 % off
# (37.8 % summed): it cut large batches into more and shorter CTAs than pays. b256 x 2048 now runs
# unsplit (481 us against 507 in 3 chunks), b128 x 4096 in 2 chunks (489 against 498), b128 x 8192
# in 3 (975 against 972 in 5; 2 chunks measured 958); the fastest grids hold 1536-2048 CTAs (4-5
# waves) wherever the batch allows.
# A second round on 13 larger shapes (decode_split_sweep_round2_session10.txt) compared these
# choices with a variant that charges a smaller tail when the last wave holds at most one CTA per
# SM: each won on four shapes by 1-3 % and tied on the rest, so the simpler model stays; its
# choices there are within 1.8 % of the fastest measured split (b256 x 6144: 1468 against 1442
# unsplit).
WAVE_TAIL = 0.3
WAVE_CTA_COST_TOKENS = 160
WAVE_MERGE_COST_TOKENS = 64
# Balanced pieces (plan_pieces): a cut that would leave a piece shorter than this many tokens moves to
# the request boundary.
MIN_PIECE_TOKENS = 128
# The automatic planner takes a piece plan for a batch of unequal requests whose chunk plan (the
# search's choice) has more CTAs than SMs, when the chunk plan's modelled makespan (_chunk_load) is
# over PIECE_GAIN_PCT % of the piece plan's, where a chain's pieces after its first cost
# PIECE_COST_TOKENS each (a restart: prologue, pipeline fill, partial-state store). Fitted to
# tools/ab_decode.py on the H200 (decode_ab_pieces_session19.json: 13 batches, a piece plan against
# the planner's choice in turns): ragged batches (lengths uniform in 1 .. 2 x mean) x1.007-1.045,
# where this model puts the chunk plan's makespan 5-18 % over the pieces'; equal-length batches
# x0.95-0.996 at 0.93-1.006 (b128 x 8192: 1.006, x0.996 measured), and b16 x 4096 (128 CTAs, one
# per SM) x0.951.
PIECE_COST_TOKENS = 200
PIECE_GAIN_PCT = 104
MAX_PIECE_GROUPS = 1024  # decode_planner.h's heap and share counts are bounded by it
# Work-item flags of a piece plan (decode_common.cuh's kPieceNext / kPieceCont): the item's CTA runs
# the next item too / the item is run by the previous item's CTA.
PIECE_NEXT, PIECE_CONT = 1 << 30, 1 << 29
# A/B timing and tests only: plan every batch in pieces over this many waves; 0: never in pieces;
# None: the automatic choice. Set, it routes the native planner's calls to this module.
PIECE_WAVES: Optional[int] = None
# Most waves the automatic split goes to; bounds the work items (CUDA-graph capacity).
MAX_WAVES = 12
# Candidate chunk counts of the longest request (its chunks decide the critical path).
MAX_PIECES = 32


class DecodePlan(NamedTuple):
    """A split-KV plan (a named tuple: built on every plan() of a non-uniform batch, where a
    frozen dataclass costs a microsecond more)."""

    work: np.ndarray          # int32 [n_items, 4], a view of packed
    merge_indptr: np.ndarray  # int32 [batch + 1], a view of packed
    num_items: int
    num_slots: int            # partial states needed (0 when nothing is split)
    chunk: int                # tokens per chunk (0: no split)
    split: bool
    # int32 [n_items * 4 + 4 + batch + 1]: work | num_items, 0, 0, 0 | merge_indptr, the device
    # metadata layout when the grid has exactly n_items items: the wrapper stages it in one copy.
    packed: np.ndarray
    longest: int = 0          # tokens of the longest request
    pieces: bool = False      # balanced pieces (plan_pieces): items chained by flags in the request word


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


def _model_time(items, chunks, total: int, longest: int, kv_units: int, sm_count: int,
                ctas_per_sm: int) -> list:
    """Modelled kernel time (in the unit of the module constants) of candidate chunks given their
    item counts: sequences of floats (at most ``longest``) and ints, equal chunks next to each
    other (the search's candidates are sorted: each is computed once); returns a list.

    A Python loop: for the ~40 candidates of a search it costs less than the ~25 numpy calls of the
    same arithmetic on candidate arrays (~0.5 us each whatever their size)."""
    slots = max(1, sm_count * ctas_per_sm)
    sm_round = sm_count - 1
    one_floor = total * kv_units / sm_count
    one_speed, multi_speed = 1.0 / ONE_CTA_RATE, 1.0 / MULTI_CTA_RATE
    wave_share, wave_total = WAVE_CTA_COST_TOKENS / slots, total * kv_units / slots
    wave_scale, first_wave = slots / sm_count, ctas_per_sm * CTA_COST_TOKENS
    times = []
    prev = t = None
    for n, chunk in zip(items, chunks):
        if chunk != prev:
            prev = chunk
            ctas = n * kv_units
            if ctas <= slots:
                # One wave: every CTA is resident from the start.
                per_sm = (ctas + sm_round) // sm_count
                t = per_sm * chunk * (one_speed if per_sm <= 1 else multi_speed)
                if t < one_floor:
                    t = one_floor
                t += per_sm * CTA_COST_TOKENS
                if chunk < longest:
                    t += MERGE_COST_TOKENS
            else:
                # Several waves, as greedy list scheduling: the work over the slots, the expected
                # tail of the longest CTA (no more than the last wave's empty share: whole waves of
                # equal CTAs end together), the CTAs' own costs, the merge; then the first wave's
                # prologues, which nothing hides (as in a one-wave grid).
                tail = -(-ctas // slots) - ctas / slots
                if tail > WAVE_TAIL:
                    tail = WAVE_TAIL
                t = wave_total + tail * chunk + ctas * wave_share
                if chunk < longest:
                    t += WAVE_MERGE_COST_TOKENS
                t = t * wave_scale + first_wave
        times.append(t)
    return times


class PlanConfig(ctypes.Structure):
    """decode_planner.h's DecodePlanConfig: the cost model's constants, then a kernel's fixed
    values (8-byte fields in order)."""

    _fields_ = [(n, ctypes.c_double) for n in ("one_cta_rate", "multi_cta_rate", "cta_cost", "merge_cost",
                                               "wave_tail", "wave_cta_cost", "wave_merge_cost")] + \
               [(n, ctypes.c_int64) for n in ("min_chunk", "chunk_align", "max_waves", "max_pieces", "kv_units",
                                              "sm_count", "ctas_per_sm", "limit_extra", "page_size", "min_piece",
                                              "piece_cost", "piece_gain_pct", "pieces")]


# decode_planner.h's candidate lists hold 64 entries each.
_NATIVE_CANDIDATES = 64


def plan_config(kv_units: int, sm_count: int, ctas_per_sm: int, page_size: int,
                pieces: bool = False) -> Optional[PlanConfig]:
    """This module's constants and a kernel's values for the native planner; None where it cannot
    follow them (a list of candidates longer than it holds, a cut of 0 tokens)."""
    if MAX_PIECES > _NATIVE_CANDIDATES or MAX_WAVES + 2 > _NATIVE_CANDIDATES or MIN_PIECE_TOKENS < 1:
        return None
    return PlanConfig(ONE_CTA_RATE, MULTI_CTA_RATE, CTA_COST_TOKENS, MERGE_COST_TOKENS, WAVE_TAIL,
                      WAVE_CTA_COST_TOKENS, WAVE_MERGE_COST_TOKENS, MIN_CHUNK_TOKENS, CHUNK_ALIGN, MAX_WAVES,
                      MAX_PIECES, kv_units, sm_count, ctas_per_sm, max_items(0, kv_units, sm_count, ctas_per_sm),
                      page_size, MIN_PIECE_TOKENS, PIECE_COST_TOKENS, PIECE_GAIN_PCT, int(pieces))


def _address(a: np.ndarray) -> int:
    """The data address of a C-contiguous array (0.3 us; ``a.ctypes.data`` costs 1 us)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):  # read-only or empty
        return a.ctypes.data


class NativePlanner:
    """:func:`plan_decode` of a batch given by its page table, through ``fi_plan_decode``
    (decode_planner.h, exported by every decode module): the same plans without numpy's per-call
    costs. One per (module, GPU, head configuration, page size); not for concurrent use. A plan's
    arrays are views of the planner's own buffer: valid until its next call (the wrapper copies
    them into its staging buffer at once).

    Parameters
    ----------
    fn : ctypes function or None
        The module's raw ``fi_plan_decode``; None: plan_decode itself.
    kv_units, sm_count, ctas_per_sm : int
        As for plan_decode.
    page_size : int
        Tokens per page of the tables passed to calls.
    staged_fn : ctypes function, optional
        The module's raw ``fi_plan_decode_staged`` (:meth:`plan_staged`; ``staged`` is None
        without it or without ``fn``).
    pieces : bool
        The kernel runs piece chains (plan_decode's ``pieces``).
    """

    def __init__(self, fn, kv_units: int, sm_count: int, ctas_per_sm: int, page_size: int, staged_fn=None,
                 pieces: bool = False):
        self._config = plan_config(kv_units, sm_count, ctas_per_sm, page_size, pieces)
        self._pieces = pieces
        self._fn = fn if self._config is not None else None
        self.staged = staged_fn if self._fn is not None else None
        self._config_addr = ctypes.addressof(self._config) if self._config is not None else 0
        self._info = (ctypes.c_int64 * 5)()  # chunk, items, slots, longest (+ page count: staged)
        self._info_addr = ctypes.addressof(self._info)
        self._args = (kv_units, sm_count, ctas_per_sm, page_size)
        self._extra = max_items(0, kv_units, sm_count, ctas_per_sm)
        self._out = np.empty(0, dtype=np.int32)
        self._out_addr = 0

    def __call__(self, indptr: np.ndarray, last_page_len: np.ndarray, disable_split_kv: bool = False,
                 fixed_split_size: Optional[int] = None, capacity: Optional[int] = None) -> DecodePlan:
        """plan_decode of the requests of a page table that tables.request_lengths accepted (int32,
        at least one request)."""
        if self._fn is None:  # no native planner (a host-path simulation without a compiler)
            units, sm, ctas, ps = self._args
            return plan_decode(kv_lengths(indptr, last_page_len, ps), kv_units=units, sm_count=sm,
                               ctas_per_sm=ctas, disable_split_kv=disable_split_kv,
                               fixed_split_size=fixed_split_size, capacity=capacity, pieces=self._pieces)
        if not (indptr.flags.c_contiguous and last_page_len.flags.c_contiguous):
            indptr, last_page_len = np.ascontiguousarray(indptr), np.ascontiguousarray(last_page_len)
        return self.plan_at(_address(indptr), _address(last_page_len), last_page_len.shape[0], disable_split_kv,
                            fixed_split_size, capacity)

    def plan_staged(self, indptr_addr: int, last_addr: int, batch: int, num_indices: int, indices_addr: int,
                    disable_split_kv: bool, fixed_split_size: Optional[int], capacity: Optional[int],
                    out: np.ndarray, out_addr: int):
        """``fi_plan_decode_staged``: check the host page table (int32 data at the given
        addresses, ``batch`` >= 1 requests), plan it into ``out`` (int32, ``out_addr`` its data
        address) and copy indptr, last_page_len and, with ``indices_addr`` != 0, the used page ids
        behind the plan. With ``capacity`` (CUDA-graph mode) the plan has at most that many items
        and the grid's layout: num_work and merge_indptr at 4 * capacity. Returns (plan, offset of
        the tables in ``out``, page count): the plan's arrays are views of ``out``; or (None, 0,
        entries needed) when ``out`` is too small; (None, 0, -1) when the table fails a check
        (tables.request_lengths raises its error)."""
        if PIECE_WAVES is not None:  # A/B timing and tests: plan() takes the Python path (plan_at)
            return None, 0, -1
        fixed = fixed_split_size if fixed_split_size is not None and fixed_split_size > 0 else 0
        cap = -1 if capacity is None else capacity
        info = self._info
        rc = self.staged(self._config_addr, indptr_addr, last_addr, batch, num_indices, indices_addr, fixed,
                         int(disable_split_kv), cap, out_addr, out.shape[0], info)
        n_items = info[1]
        head = n_items * 4 if cap < 0 else cap * 4
        if rc:
            if rc == 2:
                return None, 0, head + 5 + 3 * batch + 1 + (info[4] if indices_addr else 0)
            if rc == 4:
                return None, 0, -1
            if rc == 1:
                raise ValueError(f"the plan needs {n_items} work items but the CUDA-graph buffers hold "
                                 f"{capacity}; use a larger fixed_split_size or disable_split_kv")
            raise RuntimeError(f"fi_plan_decode_staged returned {rc} for a batch of {batch}")
        n4 = n_items * 4
        packed = out[: head + 5 + batch]
        chunk = info[0]
        return (DecodePlan(out[:n4].reshape(n_items, 4), packed[head + 4:], n_items, info[2], max(chunk, 0),
                           n_items > batch, packed, info[3], chunk < 0), head + 5 + batch, info[4])

    def plan_at(self, indptr_addr: int, last_addr: int, batch: int, disable_split_kv: bool = False,
                fixed_split_size: Optional[int] = None, capacity: Optional[int] = None) -> DecodePlan:
        """:meth:`__call__` of tables given by the addresses of their contiguous int32 data (the
        wrapper passes its CPU tensors' ``data_ptr()``: cheaper than a numpy array's address)."""
        if PIECE_WAVES is not None:  # A/B timing: the Python planner forces or forbids piece plans
            ip = np.ctypeslib.as_array((ctypes.c_int32 * (batch + 1)).from_address(indptr_addr))
            lp = np.ctypeslib.as_array((ctypes.c_int32 * batch).from_address(last_addr))
            units, sm, ctas, ps = self._args
            return plan_decode(kv_lengths(ip, lp, ps), kv_units=units, sm_count=sm, ctas_per_sm=ctas,
                               disable_split_kv=disable_split_kv, fixed_split_size=fixed_split_size,
                               capacity=capacity, pieces=self._pieces)
        fixed = fixed_split_size if fixed_split_size is not None and fixed_split_size > 0 else 0
        cap = -1 if capacity is None else capacity
        info = self._info
        while True:
            rc = self._fn(self._config_addr, indptr_addr, last_addr, batch, fixed, int(disable_split_kv), cap,
                          self._out_addr, self._out.shape[0], self._info_addr)
            if rc != 2:
                break
            # the buffer is too small: room for the search's limit (or this fixed chunk's items)
            need = max(info[1], batch + self._extra) * 4 + 5 + batch
            self._out = np.empty(need + need // 4, dtype=np.int32)
            self._out_addr = self._out.ctypes.data
        chunk, n_items, n_slots = info[0], info[1], info[2]
        if rc == 1:
            if chunk == 0:
                raise ValueError(f"the plan needs {batch} work items but the CUDA-graph buffers hold {capacity}")
            raise ValueError(f"the plan needs {n_items} work items but the CUDA-graph buffers hold "
                             f"{capacity}; use a larger fixed_split_size or disable_split_kv")
        if rc:
            raise RuntimeError(f"fi_plan_decode returned {rc} for a batch of {batch}")
        n4 = n_items * 4
        packed = self._out[: n4 + 5 + batch]
        return DecodePlan(packed[:n4].reshape(n_items, 4), packed[n4 + 4:], n_items, n_slots, max(chunk, 0),
                          n_items > batch, packed, info[3], chunk < 0)


def plan_decode(kv_lens: np.ndarray, *, kv_units: int, sm_count: int, ctas_per_sm: int,
                disable_split_kv: bool = False, fixed_split_size: Optional[int] = None,
                capacity: Optional[int] = None, pieces: bool = False) -> DecodePlan:
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
    pieces : bool
        The kernel runs chains of pieces (sm_90+): a batch of unequal requests may take a plan of
        balanced pieces (plan_pieces) where the model puts it ahead of the chunk plan.

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
    longest = int(np.maximum.reduce(kv_lens)) if batch else 0
    shortest = int(np.minimum.reduce(kv_lens)) if batch else 0
    if batch and shortest == longest:  # uniform batches (benchmarks, padded serving)
        return plan_uniform(batch, longest, kv_units, sm_count, ctas_per_sm, disable_split_kv,
                            fixed_split_size, capacity)
    return _plan(kv_lens, batch, longest, kv_units, sm_count, ctas_per_sm, disable_split_kv,
                 fixed_split_size, capacity, shortest, pieces=pieces)


@functools.lru_cache(maxsize=1024)
def plan_uniform(batch: int, length: int, kv_units: int, sm_count: int, ctas_per_sm: int,
                 disable_split_kv: bool = False, fixed_split_size: Optional[int] = None,
                 capacity: Optional[int] = None) -> DecodePlan:
    """:func:`plan_decode` of ``batch`` requests of ``length`` tokens each. It depends on scalars
    only, so it is computed once per argument tuple (pass them positionally: that is the cache
    key) and its arrays are read-only."""
    plan = _plan(np.full(batch, length, dtype=np.int64), batch, length, kv_units, sm_count,
                 ctas_per_sm, disable_split_kv, fixed_split_size, capacity, length, uniform=True)
    for a in (plan.packed, plan.work, plan.merge_indptr):
        a.flags.writeable = False
    return plan


def const_i64(value: int) -> np.ndarray:
    """``value`` as a read-only 0-d int64 array. numpy converts a Python scalar operand on every
    call, which costs about as much as the rest of a ufunc call on a small array (~0.25 us); a 0-d
    array costs nothing, so the host path's numpy constants (the chunk search's, tables.py's page
    size) are kept in this form."""
    a = np.array(value, dtype=np.int64)
    a.flags.writeable = False
    return a


_ONE = const_i64(1)
_CHUNK_ALIGN = const_i64(CHUNK_ALIGN)
_MIN_CHUNK = const_i64(MIN_CHUNK_TOKENS)


@functools.lru_cache(maxsize=64)
def _search_setup(kv_units: int, sm_count: int, ctas_per_sm: int) -> tuple:
    """(extra items allowed over one per request, candidate divisors times CHUNK_ALIGN) of a GPU
    and head configuration. The divisors: the longest request in k = 1..MAX_PIECES equal pieces,
    then the whole batch in one or two CTAs per SM or in w = 1..MAX_WAVES whole waves (work-item
    counts that put j CTAs on every SM); times CHUNK_ALIGN because ceil(x / d) rounded up to
    CHUNK_ALIGN is ((x - 1) // (d * CHUNK_ALIGN) + 1) * CHUNK_ALIGN. Read-only."""
    j = np.unique(np.concatenate((np.array([1, 2], dtype=np.int64),
                                  max(ctas_per_sm, 1) * np.arange(1, MAX_WAVES + 1, dtype=np.int64))))
    per_batch = np.maximum(np.floor(j * (sm_count / max(kv_units, 1))), 1).astype(np.int64)
    d = np.concatenate((np.arange(1, MAX_PIECES + 1, dtype=np.int64), per_batch)) * CHUNK_ALIGN
    d.flags.writeable = False
    return MAX_WAVES * _wave_items(kv_units, sm_count, ctas_per_sm), d


def _choose_chunk(kv_lens, batch, longest, shortest, kv_units, sm_count, ctas_per_sm, capacity, uniform):
    """The candidate chunk with the smallest modelled time (ties: the larger chunk, for fewer
    items and less merge traffic; ``longest`` means no split), and for a non-uniform batch the
    chunk count of each request for it (int64), which the search computes anyway. Written for
    numpy's per-call cost (~0.5 us whatever the array size): about 20 calls on whole arrays of
    candidates, and the cost model in Python (see _model_time)."""
    extra, divisors = _search_setup(kv_units, sm_count, ctas_per_sm)
    limit = batch + extra
    if capacity is not None:
        limit = min(limit, capacity)
    # The longest chunk (k = 1, which rounds and clamps to longest) has one item per request and
    # every other candidate more: if even it does not fit, take it anyway (only reachable with a
    # tiny capacity) and let the caller report the overflow.
    if batch > limit:
        return longest, None
    total = batch * longest if uniform else int(np.add.reduce(kv_lens))
    cands = np.empty(len(divisors), dtype=np.int64)
    cands[:MAX_PIECES] = longest - 1
    cands[MAX_PIECES:] = total - 1
    cands //= divisors
    cands += _ONE
    cands *= _CHUNK_ALIGN
    np.maximum(cands, _MIN_CHUNK, out=cands)
    np.minimum(cands, longest, out=cands)
    cands.sort()  # duplicates stay: they have equal costs and do not change the choice below
    # A chunk cuts the batch into at least total / chunk items: the candidates below total / limit
    # (the first ones; none when that is below the smallest chunk) are over the limit, whatever the
    # lengths.
    if total > MIN_CHUNK_TOKENS * limit:
        cands = cands[cands.searchsorted(-(-total // limit)):]
    cta = cands.astype(np.float64)
    if uniform:
        items = batch * ((longest - 1) // cands + 1)
        counts = None
    else:  # float64 division of integers < 2^53 is exact where it matters (multiples)
        counts = np.divide(kv_lens if shortest > 0 else np.maximum(kv_lens, _ONE), cta[:, None])
        np.ceil(counts, out=counts)
        # sums of integers, exact in any order: the cheapest reduction of the rows
        items = counts.dot(np.ones(batch)).astype(np.int64)
    items = items.tolist()
    # The item counts do not increase along the candidates: those over the limit come first.
    first = 0
    while items[first] > limit:
        first += 1
    cost = _model_time(items[first:], cta[first:].tolist(), total, longest, kv_units, sm_count, ctas_per_sm)
    best = first + len(cost) - 1 - cost[::-1].index(min(cost))  # the last (largest) of the cheapest
    return int(cands[best]), None if counts is None else counts[best].astype(np.int64)


def plan_pieces(kv_lens, kv_units: int, sm_count: int, ctas_per_sm: int, waves: int = 1) -> tuple:
    """(plan, load): a plan of balanced pieces and its modelled makespan. The batch's tokens,
    requests one after the other, are cut into ``waves`` x (CTA slots / kv_units) equal shares, one
    chain of items per CTA: share g starts at token ``g * total // shares``. A cut lands inside a
    request at a multiple of CHUNK_ALIGN from its start, or on the request's boundary when it is
    within MIN_PIECE_TOKENS of it (a share then ends there). A request cut into pieces is split, a
    slot per piece. The items of one share follow each other: every one but the last has PIECE_NEXT,
    every one but the first PIECE_CONT (decode_common.cuh runs the chain in its first item's CTA).
    A request without tokens is a piece of the share it falls in. ``load`` is the longest chain's
    tokens plus PIECE_COST_TOKENS per item after its first (decode_planner.h's build_pieces does the
    same)."""
    kv_lens = [int(x) for x in kv_lens]
    batch = len(kv_lens)
    shares = max(1, waves * _wave_items(kv_units, sm_count, ctas_per_sm))
    total = sum(kv_lens)
    # The cuts, in order: (request, local position) inside requests; boundary[r]: a share starts
    # with request r.
    cuts: list = [[] for _ in range(batch)]
    boundary = [False] * (batch + 1)
    boundary[0] = True
    r, end = 0, kv_lens[0] if batch else 0
    start = 0
    for g in range(1, shares):
        c = g * total // shares
        while r < batch and end <= c:
            r += 1
            start = end
            end += kv_lens[r] if r < batch else 0
        if r >= batch:
            break
        local = (c - start) // CHUNK_ALIGN * CHUNK_ALIGN
        if local < MIN_PIECE_TOKENS:
            boundary[r] = True
        elif kv_lens[r] - local < MIN_PIECE_TOKENS:
            boundary[r + 1] = True
        elif not cuts[r] or cuts[r][-1] != local:
            cuts[r].append(local)
    rows, merge, slot = [], [0], 0
    load = chain = 0
    for r, n in enumerate(kv_lens):
        ends = cuts[r] + [n]
        split = len(ends) > 1
        lo = 0
        for j, hi in enumerate(ends):
            flags = 0
            if j > 0 or boundary[r]:  # a share starts here
                load = max(load, chain)
                chain = 0
            else:                     # the previous item's share goes on
                rows[-1][0] |= PIECE_NEXT
                flags = PIECE_CONT
            chain += hi - lo + (PIECE_COST_TOKENS if flags else 0)
            rows.append([r | flags, lo, hi, slot + j if split else -1])
            lo = hi
        if split:
            slot += len(ends)
        merge.append(slot)
    load = max(load, chain)
    n_items = len(rows)
    packed = np.zeros(n_items * 4 + 4 + batch + 1, dtype=np.int32)
    n4 = n_items * 4
    packed[:n4] = np.array(rows, dtype=np.int64).reshape(-1)
    packed[n4] = n_items
    packed[n4 + 4:] = merge
    plan = DecodePlan(work=packed[:n4].reshape(n_items, 4), merge_indptr=packed[n4 + 4:], num_items=n_items,
                      num_slots=slot, chunk=0, split=n_items > batch, packed=packed,
                      longest=max(kv_lens, default=0), pieces=True)
    return plan, load


def _chunk_load(kv_lens, chunk: int, groups: int) -> int:
    """Modelled makespan of a chunk plan, in tokens as plan_pieces' load: the items in order, each
    on the least loaded of ``groups`` groups of kv_units CTA slots (the block scheduler starts CTAs
    in blockIdx order as slots free up)."""
    heap = [0] * groups
    for n in kv_lens:
        n = int(n)
        k = (n - 1) // chunk + 1 if chunk and n > 0 else 1
        for j in range(k):
            heapq.heapreplace(heap, heap[0] + (min(chunk, n - j * chunk) if chunk else n))
    return max(heap)


def _pieces_instead(kv_lens, chunk: int, n_items: int, kv_units: int, sm_count: int, ctas_per_sm: int,
                    capacity) -> Optional[DecodePlan]:
    """The piece plan of a batch of unequal requests when it beats the search's chunk plan of
    ``n_items`` items (see PIECE_GAIN_PCT); else None."""
    groups = _wave_items(kv_units, sm_count, ctas_per_sm)
    if n_items * kv_units <= sm_count or groups > MAX_PIECE_GROUPS:  # one CTA per SM streams faster
        return None
    plan, load = plan_pieces(kv_lens, kv_units, sm_count, ctas_per_sm)
    if 100 * _chunk_load(kv_lens, chunk, groups) <= PIECE_GAIN_PCT * load:
        return None
    return plan if capacity is None or plan.num_items <= capacity else None


def _plan(kv_lens, batch, longest, kv_units, sm_count, ctas_per_sm, disable_split_kv,
          fixed_split_size, capacity, shortest, uniform=False, pieces=False) -> DecodePlan:
    if PIECE_WAVES and not disable_split_kv and not fixed_split_size:
        plan = plan_pieces(kv_lens, kv_units, sm_count, ctas_per_sm, PIECE_WAVES)[0]
        if capacity is None or plan.num_items <= capacity:
            return plan
    pieces = pieces and PIECE_WAVES != 0
    chunk = 0
    nchunks = None
    if fixed_split_size is not None and fixed_split_size > 0 and not disable_split_kv:
        chunk = int(fixed_split_size)
    elif not disable_split_kv and longest > MIN_CHUNK_TOKENS:
        chunk, nchunks = _choose_chunk(kv_lens, batch, longest, shortest, kv_units, sm_count, ctas_per_sm,
                                       capacity, uniform)
        if chunk >= longest:
            chunk = 0
        if pieces and not uniform:
            alt = _pieces_instead(kv_lens, chunk, int(np.add.reduce(nchunks)) if chunk else batch, kv_units,
                                  sm_count, ctas_per_sm, capacity)
            if alt is not None:
                return alt
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
                          chunk=0, split=False, packed=packed, longest=longest)
    if nchunks is None:  # a fixed chunk, or a uniform batch (whose plan is cached as a whole)
        nchunks = (np.maximum(kv_lens, 1) - 1) // chunk + 1
        n_items = int(np.add.reduce(nchunks))
        if capacity is not None and n_items > capacity:
            raise ValueError(f"the plan needs {n_items} work items but the CUDA-graph buffers hold "
                             f"{capacity}; use a larger fixed_split_size or disable_split_kv")
        layout = _split_layout(chunk, nchunks.tobytes())
    else:  # the search's choice, within its item limit (and so the capacity): small enough to keep
        layout = _recent_split_layout(chunk, nchunks.tobytes())
    template, last_ends, n_items, n_slots = layout
    packed = template.copy()
    packed[last_ends] = kv_lens
    n4 = n_items * 4
    return DecodePlan(work=packed[:n4].reshape(n_items, 4), merge_indptr=packed[n4 + 4:], num_items=n_items,
                      num_slots=n_slots, chunk=chunk, split=n_items > batch, packed=packed, longest=longest)


def _split_layout(chunk: int, nchunks: bytes) -> tuple:
    """(packed, last_ends, n_items, n_slots) of a split plan whose requests have ``nchunks``
    chunks (int64 bytes): its packed metadata, except that each request's last item ends at a
    whole chunk, and the indices in it of those ends, where the plan writes the requests' lengths.
    The arrays are read-only."""
    nchunks = np.frombuffer(nchunks, dtype=np.int64)
    batch = len(nchunks)
    ends = np.add.accumulate(nchunks)
    n_items = int(ends[-1])
    n4 = n_items * 4
    packed = np.empty(n4 + 4 + batch + 1, dtype=np.int32)
    packed[n4: n4 + 5] = (n_items, 0, 0, 0, 0)
    split_req = nchunks > 1
    slots = np.add.accumulate(nchunks * split_req)
    packed[n4 + 5:] = slots  # merge_indptr[1:]
    # Item i of request r (items ends[r] - nchunks[r] .. ends[r] - 1) is (r, piece * chunk,
    # (piece + 1) * chunk, slot) with piece = i - ends[r] + nchunks[r] and slot = i - ends[r] +
    # merge_indptr[r + 1], or -1 for an unsplit request's only item (i = ends[r] - 1): rows of
    # per-request values, repeated once per item, plus i (a few numpy calls on whole arrays).
    rows = np.empty((4, batch), dtype=np.int64)
    rows[0] = np.arange(batch)
    np.subtract(nchunks, ends, out=rows[1])
    np.add(rows[1], 1, out=rows[2])
    np.multiply(slots, split_req, out=rows[3])
    rows[3] -= ends
    rows = rows.repeat(nchunks, axis=1)
    rows[1:] += np.arange(n_items)
    rows[1:3] *= chunk
    packed[:n4].reshape(n_items, 4)[...] = rows.T
    last_ends = 4 * ends - 2  # work[ends - 1, 2]
    for a in (packed, last_ends):
        a.flags.writeable = False
    return packed, last_ends, n_items, int(slots[-1])


# The layouts of the searches' recent plans: from one decode step to the next a batch usually
# keeps its chunk and every request its chunk count (a request gains a chunk every ``chunk``
# tokens), so the plan only writes the new lengths into a copy.
_recent_split_layout = functools.lru_cache(maxsize=16)(_split_layout)
