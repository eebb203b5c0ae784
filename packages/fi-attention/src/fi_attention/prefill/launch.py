"""The backend seam of prefill: a backend-neutral call description (:class:`PrefillCall`) and the
fa2 runner. Every backend exposes ``run(call) -> None`` writing ``call.out`` (and ``call.lse``);
``fi_attention.prefill.hopper`` (fa3) is expected to expose the same ``run`` plus
``unsupported_reason(facts) -> str | None``.

The fa2 launcher takes two host arrays (int64 / float64) whose layouts are :data:`INT_PARAMS` /
:data:`FLOAT_PARAMS`, in the order of prefill_fa2.cu's ``IntParam`` / ``FloatParam`` enums.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from fi_core import arch_of, current_stream, device_info, load, on_device

from ..reference import alibi_slopes
from .plan import Plan, plan_fa2
from .spec import SHORT_PACKED_ROWS, cta_rows, fa2_spec

INT_PARAMS = (
    "Q", "K", "V", "O", "LSE", "TMP_O", "TMP_LSE", "WORK",
    "QO_INDPTR", "KV_INDPTR", "KV_INDICES", "KV_LAST_PAGE_LEN", "MASK", "MASK_INDPTR",
    "ALIBI", "QO_LEN", "KV_LEN", "PAGE_SIZE",
    "Q_STRIDE_N", "Q_STRIDE_H", "K_STRIDE_P", "K_STRIDE_N", "K_STRIDE_H",
    "V_STRIDE_P", "V_STRIDE_N", "V_STRIDE_H", "O_STRIDE_N", "O_STRIDE_H",
    "NUM_QO_HEADS", "NUM_KV_HEADS", "CAUSAL", "WINDOW_LEFT", "WORK_INDPTR", "NUM_CTAS",
    "MERGE", "MERGE_COUNT", "NUM_MERGE_CTAS",
)
FLOAT_PARAMS = ("SCALE_LOG2", "SOFTCAP_PRE", "SOFTCAP_POST", "SM_SCALE", "ROPE_RCP_SCALE", "ROPE_LOG2_THETA",
                "OUT_SCALE")
_IP = {n: i for i, n in enumerate(INT_PARAMS)}
_FP = {n: i for i, n in enumerate(FLOAT_PARAMS)}
LOG2E = 1.4426950408889634


@dataclass
class PrefillCall:
    """Everything a prefill backend needs for one launch (validated by the public API).

    ``k``/``v``: ragged ``[nnz_kv, H_kv, D]`` tensors, or the two halves of a paged cache (any
    layout) with ``k_strides``/``v_strides`` = element strides (page, token, head). Single
    prefill passes no indptrs and ``qo_len``/``kv_len`` instead.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    k_strides: tuple[int, int, int]
    v_strides: tuple[int, int, int]
    paged: bool = False
    page_size: int = 1
    qo_indptr: Optional[torch.Tensor] = None
    kv_indptr: Optional[torch.Tensor] = None
    kv_indices: Optional[torch.Tensor] = None
    kv_last_page_len: Optional[torch.Tensor] = None
    qo_len: int = 0
    kv_len: int = 0
    max_qo_len: Optional[int] = None             # longest request's queries (host int), for fa3
    causal: bool = False
    window_left: int = -1
    sm_scale: float = 1.0
    v_scale: float = 1.0                         # multiplies the output (in the kernels' epilogues)
    logits_soft_cap: float = 0.0
    pos_encoding_mode: str = "NONE"
    rope_scale: float = 1.0
    rope_theta: float = 1e4
    packed_mask: Optional[torch.Tensor] = None   # uint8, little-endian bits per request
    mask_indptr: Optional[torch.Tensor] = None   # int32 byte offsets per request
    schedule: Optional["Fa2Schedule"] = None
    work_pairs: Optional[int] = None             # visible (query, key) pairs per qo head (plan), for fa3


@dataclass
class Fa2Schedule:
    """A plan copied to the device: work lists and the partial-state workspace views."""

    work: torch.Tensor
    work_indptr: torch.Tensor
    merge: torch.Tensor
    merge_count: torch.Tensor
    num_ctas: int
    num_merge_ctas: int
    tmp_o: Optional[torch.Tensor]
    tmp_lse: Optional[torch.Tensor]
    plan: Plan = field(repr=False, default=None)


def fa2_variant(call_dtype: torch.dtype, head_dim_qk: int, head_dim_vo: int, paged: bool,
                device: torch.device, custom_mask: bool, softcap: bool, alibi: bool, rope: bool,
                kv_dtype: torch.dtype, short: bool = False):
    return fa2_spec(call_dtype, head_dim_qk, head_dim_vo, paged, arch_of(device),
                    custom_mask=custom_mask, softcap=softcap, alibi=alibi, rope=rope, kv_dtype=kv_dtype,
                    short=short)


@functools.cache
def _occupancy(spec) -> int:
    out = (ctypes.c_int * 2)()
    load(spec).fi_prefill_fa2_info(ctypes.addressof(out))
    return max(1, out[0])


def grid_size(device: torch.device, dtype: torch.dtype, head_dim_qk: int, head_dim_vo: int,
              paged: bool, custom_mask: bool = False, kv_dtype: Optional[torch.dtype] = None,
              short: bool = False) -> int:
    """Persistent CTAs: SM count (read from the device) x resident CTAs per SM."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    spec = fa2_spec(dtype, head_dim_qk, head_dim_vo, paged, arch_of(device), custom_mask=custom_mask,
                    kv_dtype=kv_dtype, short=short)
    return device_info(idx).sm_count * _occupancy(spec)


def max_slots_for(workspace_bytes: int, head_dim_qk: int, head_dim_vo: int, custom_mask: bool = False,
                  short: bool = False) -> int:
    return workspace_bytes // (cta_rows(head_dim_qk, head_dim_vo, custom_mask, short) * (head_dim_vo + 1) * 4)


def make_schedule(plan: Plan, device: torch.device, float_workspace: Optional[torch.Tensor],
                  head_dim_qk: int, head_dim_vo: int, int_buffers: Optional[dict] = None,
                  non_blocking: bool = True) -> Fa2Schedule:
    """Copy a plan to the device. ``int_buffers`` (CUDA-graph mode) are preallocated int32
    tensors 'work', 'work_indptr', 'merge', 'merge_count' that are filled in place."""
    rows = plan.cta_rows
    host = {
        "work": torch.from_numpy(np.ascontiguousarray(plan.work.reshape(-1))),
        "work_indptr": torch.from_numpy(np.ascontiguousarray(plan.work_indptr)),
        "merge": torch.from_numpy(np.ascontiguousarray(plan.merge.reshape(-1))),
        "merge_count": torch.tensor([len(plan.merge)], dtype=torch.int32),
    }
    dev = {}
    for name, h in host.items():
        if int_buffers is not None:
            buf = int_buffers[name]
            if h.numel() > buf.numel():
                raise ValueError(f"plan needs {h.numel()} int32 entries for {name}, the CUDA-graph "
                                 f"buffer holds {buf.numel()}")
            if h.numel():
                buf[: h.numel()].copy_(h.pin_memory() if non_blocking else h, non_blocking=non_blocking)
            dev[name] = buf
        else:
            dev[name] = (h.pin_memory() if non_blocking else h).to(device, non_blocking=non_blocking) \
                if h.numel() else torch.zeros(1, dtype=torch.int32, device=device)
    tmp_o = tmp_lse = None
    # CUDA-graph mode: the captured launch keeps the partial-state pointers, so they must not
    # depend on whether this particular plan split anything.
    slots = plan.num_slots
    if int_buffers is not None and float_workspace is not None:
        slots = max(slots, float_workspace.numel() * float_workspace.element_size() // (rows * (head_dim_vo + 1) * 4))
    if slots:
        n_o = slots * rows * head_dim_vo
        n_l = slots * rows
        fws = float_workspace.view(torch.float32) if float_workspace is not None else None
        if fws is None or fws.numel() < n_o + n_l:
            raise ValueError(f"split-KV needs {(n_o + n_l) * 4} workspace bytes, float_workspace_buffer "
                             f"has {0 if fws is None else fws.numel() * 4}")
        tmp_o, tmp_lse = fws[:n_o], fws[n_o:n_o + n_l]
    num_merge_ctas = plan.num_ctas if (len(plan.merge) or int_buffers is not None) else 0
    return Fa2Schedule(dev["work"], dev["work_indptr"], dev["merge"], dev["merge_count"],
                       plan.num_ctas, num_merge_ctas, tmp_o, tmp_lse, plan)


@functools.lru_cache(maxsize=64)
def _alibi_on(num_heads: int, device: torch.device) -> torch.Tensor:
    return alibi_slopes(num_heads).to(device)


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def run_fa2(c: PrefillCall) -> None:
    """Launch the fa2 kernel (+ merge) for a validated call with a schedule."""
    s = c.schedule
    short = bool(s.plan is not None and s.plan.short)
    alibi = c.pos_encoding_mode == "ALIBI"
    softcap = c.logits_soft_cap is not None and c.logits_soft_cap > 0
    spec = fa2_variant(c.q.dtype, c.head_dim_qk, c.head_dim_vo, c.paged, c.q.device,
                       c.packed_mask is not None, softcap, alibi, c.pos_encoding_mode == "ROPE_LLAMA",
                       c.k.dtype, short)
    rows = cta_rows(c.head_dim_qk, c.head_dim_vo, c.packed_mask is not None, short)
    if s.plan is not None and s.plan.cta_rows != rows:
        raise RuntimeError(f"fa2 schedule was planned for {s.plan.cta_rows}-row tiles, the kernel uses {rows}")
    mod = load(spec)
    ip = np.zeros(len(INT_PARAMS), dtype=np.int64)
    fp = np.zeros(len(FLOAT_PARAMS), dtype=np.float64)
    qs, os_ = c.q.stride(), c.out.stride()
    vals = {
        "Q": _ptr(c.q), "K": _ptr(c.k), "V": _ptr(c.v), "O": _ptr(c.out), "LSE": _ptr(c.lse),
        "TMP_O": _ptr(s.tmp_o), "TMP_LSE": _ptr(s.tmp_lse), "WORK": _ptr(s.work),
        "QO_INDPTR": _ptr(c.qo_indptr), "KV_INDPTR": _ptr(c.kv_indptr),
        "KV_INDICES": _ptr(c.kv_indices), "KV_LAST_PAGE_LEN": _ptr(c.kv_last_page_len),
        "MASK": _ptr(c.packed_mask), "MASK_INDPTR": _ptr(c.mask_indptr),
        "ALIBI": _ptr(_alibi_on(c.num_qo_heads, c.q.device)) if alibi else 0,
        "QO_LEN": c.qo_len, "KV_LEN": c.kv_len, "PAGE_SIZE": c.page_size,
        "Q_STRIDE_N": qs[0], "Q_STRIDE_H": qs[1],
        "K_STRIDE_P": c.k_strides[0], "K_STRIDE_N": c.k_strides[1], "K_STRIDE_H": c.k_strides[2],
        "V_STRIDE_P": c.v_strides[0], "V_STRIDE_N": c.v_strides[1], "V_STRIDE_H": c.v_strides[2],
        "O_STRIDE_N": os_[0], "O_STRIDE_H": os_[1],
        "NUM_QO_HEADS": c.num_qo_heads, "NUM_KV_HEADS": c.num_kv_heads, "CAUSAL": int(c.causal),
        "WINDOW_LEFT": c.window_left, "WORK_INDPTR": _ptr(s.work_indptr), "NUM_CTAS": s.num_ctas,
        "MERGE": _ptr(s.merge), "MERGE_COUNT": _ptr(s.merge_count),
        "NUM_MERGE_CTAS": s.num_merge_ctas,
    }
    for k, v in vals.items():
        ip[_IP[k]] = v
    fp[_FP["SM_SCALE"]] = c.sm_scale
    fp[_FP["SCALE_LOG2"]] = c.sm_scale * LOG2E
    fp[_FP["ROPE_RCP_SCALE"]] = 1.0 / c.rope_scale
    fp[_FP["ROPE_LOG2_THETA"]] = math.log2(c.rope_theta)
    fp[_FP["OUT_SCALE"]] = c.v_scale
    if softcap:
        fp[_FP["SOFTCAP_PRE"]] = c.sm_scale / c.logits_soft_cap
        fp[_FP["SOFTCAP_POST"]] = c.logits_soft_cap * LOG2E
    with on_device(c.q.device):
        mod.fi_prefill_fa2(ip.ctypes.data, fp.ctypes.data, current_stream(c.q.device))


def plan_for_call(qo_lens, kv_lens, *, device, dtype, num_kv_heads, group, head_dim_qk,
                  head_dim_vo, paged, causal, window_left, workspace_bytes, custom_mask=False,
                  allow_split=True, num_ctas=None, kv_dtype=None) -> Plan:
    short = is_short(qo_lens, group)
    rows = cta_rows(head_dim_qk, head_dim_vo, custom_mask, short)
    if num_ctas is None:
        num_ctas = grid_size(device, dtype, head_dim_qk, head_dim_vo, paged, custom_mask, kv_dtype, short)
    plan = plan_fa2(qo_lens, kv_lens, num_kv_heads=num_kv_heads, group=group, cta_rows=rows,
                    causal=causal, window_left=window_left, num_ctas=num_ctas,
                    max_slots=max_slots_for(workspace_bytes, head_dim_qk, head_dim_vo, custom_mask, short),
                    allow_split=allow_split)
    plan.short = short
    return plan


def is_short(qo_lens, group: int) -> bool:
    """Whether every request packs into one narrow tile (the planner then uses that kernel)."""
    return len(qo_lens) > 0 and int(max(qo_lens)) * group <= SHORT_PACKED_ROWS
