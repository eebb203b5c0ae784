"""The ctypes mirror of decode_args.h and the launch of the decode module.

run() fills a prebuilt argument block and calls the launcher with its address: two C arguments
instead of thirty keep the host cost of a decode step in the low microseconds.
"""

from __future__ import annotations

import ctypes

_I64 = ("q", "q_stride_b", "q_stride_h",
        "k", "k_stride_page", "k_stride_tok", "k_stride_head",
        "v", "v_stride_page", "v_stride_tok", "v_stride_head",
        "kv_indptr", "kv_indices", "kv_last_page_len",
        "work", "num_work", "merge_indptr",
        "out", "o_stride_b", "o_stride_h", "lse",
        "part_o", "part_lse",
        "num_qo_heads", "num_kv_heads", "page_size", "page_shift", "window_left",
        "grid_items", "merge_batch")
_F64 = ("sm_scale", "k_scale", "v_scale", "logits_soft_cap", "rope_scale", "rope_theta")


class DecodeArgs(ctypes.Structure):
    """Field-for-field copy of ``struct DecodeArgs`` (decode_args.h); all fields 8 bytes."""

    _fields_ = [(n, ctypes.c_int64) for n in _I64] + [(n, ctypes.c_double) for n in _F64]


def page_shift(page_size: int) -> int:
    """log2(page_size) for a power of two (the kernel then shifts instead of dividing), else -1."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
