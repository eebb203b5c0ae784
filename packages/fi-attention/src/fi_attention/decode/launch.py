"""The ctypes mirror of decode_args.h and the launch of the decode module.

run() fills a prebuilt argument block, the stream included, and calls the launcher with its
address: one C argument instead of thirty keeps the host cost of a decode step in the low
microseconds (each ctypes argument costs ~60 ns). It writes runs of
adjacent fields with one struct.pack_into each (about 70 ns for up to eight fields, where a
ctypes attribute write costs about 35 ns per field).
"""

from __future__ import annotations

import ctypes
import struct

import torch

from fi_core.launch import CAPTURE_REFUSED, capturing, current_stream  # noqa: F401  (re-exported for run())

try:  # the raw cudaStream_t of torch's current stream, without building a Stream object
    raw_stream = torch._C._cuda_getCurrentRawStream  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - CPU-only torch builds
    raw_stream = current_stream

_I, _D = ctypes.c_int64, ctypes.c_double
# struct DecodeArgs (decode_args.h), field for field: what run() sets, the cache, what plan() sets.
_FIELDS = ([(n, _I) for n in ("q", "q_stride_b", "q_stride_h", "out", "o_stride_b", "o_stride_h", "lse")]
           + [("k_scale", _D), ("v_scale", _D), ("stream", _I)]
           + [(n, _I) for n in ("k", "k_stride_page", "k_stride_tok", "k_stride_head",
                                "v", "v_stride_page", "v_stride_tok", "v_stride_head",
                                "kv_indptr", "kv_indices", "kv_last_page_len", "work", "num_work", "merge_indptr",
                                "part_o", "part_lse", "num_qo_heads", "num_kv_heads", "page_size", "page_shift",
                                "window_left", "grid_items", "merge_batch")]
           + [(n, _D) for n in ("sm_scale", "logits_soft_cap", "rope_scale", "rope_theta")]
           + [("flags", _I), ("merge_count", _I), ("sched", _I), ("device", _I)])

# DecodeArgs.flags (decode_args.h, DecodeFlag): which page tables plan() wrote itself (the kernel
# may read those before it waits for the previous grid) and whether the grid launches with
# programmatic dependent launch.
TABLES_EARLY = 1   # kv_indptr and kv_last_page_len
INDICES_EARLY = 2  # kv_indices
PDL = 4
GRID_MERGE = 8  # split requests merged by their last work item: no merge kernel
# A wrapper built without use_cuda_graph: the launcher refuses a stream that is being captured
# (returns fi_core.launch.CAPTURE_REFUSED, queues nothing).
REFUSE_CAPTURE = 16


class DecodeArgs(ctypes.Structure):
    """Field-for-field copy of ``struct DecodeArgs`` (decode_args.h); all fields 8 bytes."""

    _fields_ = _FIELDS


def _fields(first: str, count: int) -> tuple:
    """(pack_into, byte offset) that write ``count`` consecutive fields of DecodeArgs from
    ``first``: ``pack(args, offset, *values)``."""
    i = [name for name, _ in DecodeArgs._fields_].index(first)
    fmt = "".join("q" if t is ctypes.c_int64 else "d" for _, t in DecodeArgs._fields_[i: i + count])
    return struct.Struct("=" + fmt).pack_into, getattr(DecodeArgs, first).offset


# q, q_stride_b, q_stride_h, out, o_stride_b, o_stride_h, lse, k_scale, v_scale, stream: one run()
PACK_RUN, OFF_RUN = _fields("q", 10)
PACK_KV, OFF_KV = _fields("k", 8)  # k, its page/token/head strides, v, its strides
# window_left, grid_items, merge_batch, sm_scale: written by plan(), and by a run() that overrides
# window_left or q_scale (which puts plan()'s values back after its launch)
PACK_TAIL, OFF_TAIL = _fields("window_left", 4)
# plan-time fields: kv_indptr, kv_indices, kv_last_page_len, work, num_work, merge_indptr; part_o,
# part_lse, num_qo_heads, num_kv_heads, page_size, page_shift; logits_soft_cap, rope_scale, rope_theta
PACK_TABLES, OFF_TABLES = _fields("kv_indptr", 6)
PACK_SHAPE, OFF_SHAPE = _fields("part_o", 6)
PACK_OPTS, OFF_OPTS = _fields("logits_soft_cap", 3)


def page_shift(page_size: int) -> int:
    """log2(page_size) for a power of two (the kernel then shifts instead of dividing), else -1."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
