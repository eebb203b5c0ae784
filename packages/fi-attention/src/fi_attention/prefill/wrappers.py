"""Batch prefill wrappers (FlashInfer's plan/run classes) over ragged and paged KV.

``plan()`` reads the batch's lengths on the host (it may synchronise), builds the fa2 work list
(plan.py) and copies it to the device; ``run()`` only launches, so it is CUDA-graph safe. With
``use_cuda_graph=True`` every device array lives in fixed buffers (the user's index buffers and
our work-list buffers), so a captured ``run()`` replays correctly after a later ``plan()`` of the
same batch size whose options match the capture's and, on the fa3 kernel, whose longest request
has no more queries than every plan before the capture (its grid walks that many 128-row query
blocks per request, a kernel argument the graph keeps). A re-plan that breaks either warns that the
graphs captured before must be captured again; ``run()`` of a wrapper built without
``use_cuda_graph`` refuses to be captured.
"""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch

from fi_core import checks, knobs
from fi_core.errors import InputError, InputTypeError, UnsupportedError
from fi_core.launch import capturing, is_capturing

from ..kv import check_kv_layout, check_last_page_len, unpack_paged_kv_cache
from ..reference import attention_reference, gather_paged_kv
from .backends import PAGED_PREFILL, RAGGED_PREFILL, RUNNERS
from .common import (Q_DTYPES, check_heads, check_indptr, check_options, check_rows, check_tensor,
                     dtype_name, host_lengths, to_float_scale, unpack_mask)
from .. import options
from .launch import (PrefillCall, grid_size, is_short, make_schedule, max_slots_for,
                     plan_fa2)
from .hopper.spec import batch_visible_pairs
from .packbits import segment_packbits
from .spec import cta_rows

__all__ = ["BatchPrefillWithRaggedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"]

# int32 entries of each work-list buffer in CUDA-graph mode (6 per work item, 5 per merge).
_GRAPH_WORK_ITEMS = 1 << 16


_KV_DTYPES = Q_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)


class _BatchPrefillBase:
    _paged = False
    _op = RAGGED_PREFILL

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, backend: str = "auto", jit_args=None):
        check_tensor("float_workspace_buffer", float_workspace_buffer, 1)  # viewed as float32 rows
        checks.workspace(float_workspace_buffer)
        check_kv_layout(kv_layout)
        if backend not in ("auto", "fa2", "fa3"):
            raise InputError(f"backend must be 'auto', 'fa2' or 'fa3', got {backend!r}")
        if jit_args is not None:
            raise UnsupportedError("jit_args (custom JIT variants) are not supported")
        self._ws = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._backend = backend
        self._graph_bufs: Optional[dict] = None
        # CUDA-graph mode: the largest max_qo_len of any plan so far (what fa3 launches walk), and
        # the options and that bound when run() was last captured (see _check_graph_replan).
        self._graph_qo_bound = 0
        self._graph_capture: Optional[tuple] = None
        self._planned = False

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        check_tensor("float_workspace_buffer", float_workspace_buffer, 1)
        checks.workspace(float_workspace_buffer, self.device)
        self._ws = float_workspace_buffer

    # ---- plan ---------------------------------------------------------------------------
    def _to_dev(self, name: str, t: torch.Tensor, buf: Optional[torch.Tensor], non_blocking: bool):
        if self._use_cuda_graph:
            if buf is None:
                raise InputError(f"use_cuda_graph=True needs the {name} buffer passed to the constructor")
            if t.numel() > buf.numel():
                raise InputError(f"{name} has {t.numel()} entries, its CUDA-graph buffer holds {buf.numel()}")
            buf[: t.numel()].copy_(t, non_blocking=non_blocking)
            return buf
        return t.to(self.device, non_blocking=non_blocking)

    def _plan_common(self, qo_indptr, qo_lens, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk,
                     head_dim_vo, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                     window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type,
                     kv_data_type, non_blocking):
        num_qo_heads = checks.int_value("num_qo_heads", num_qo_heads, 1)
        num_kv_heads = checks.int_value("num_kv_heads", num_kv_heads, 1)
        head_dim_qk = checks.int_value("head_dim_qk", head_dim_qk, 1)
        head_dim_vo = head_dim_qk if head_dim_vo is None else checks.int_value("head_dim_vo", head_dim_vo, 1)
        if self._paged and head_dim_vo != head_dim_qk:
            raise InputError(f"a paged cache holds K and V of one head_dim: head_dim_vo must be None or "
                             f"head_dim_qk = {head_dim_qk}, got {head_dim_vo}")
        group = check_heads(num_qo_heads, num_kv_heads)
        check_options(pos_encoding_mode, window_left)
        self._q_dtype = checks.dtype_value("q_data_type", q_data_type, Q_DTYPES)
        self._kv_dtype = self._q_dtype if kv_data_type is None else \
            checks.dtype_value("kv_data_type", kv_data_type, _KV_DTYPES)
        self._num_qo_heads, self._num_kv_heads = num_qo_heads, num_kv_heads
        self._dqk, self._dvo = head_dim_qk, head_dim_vo
        self._qo_lens, self._kv_lens = qo_lens, kv_lens
        self._nnz_qo = int(qo_lens.sum())
        self._max_qo_len = int(qo_lens.max()) if len(qo_lens) else 0
        self._pos_encoding_mode = pos_encoding_mode
        self._window_left = int(window_left)
        self._soft_cap = options.soft_cap(logits_soft_cap)
        self._rope_scale, self._rope_theta = options.rope_options(rope_scale, rope_theta)
        self._sm_scale = options.softmax_scale(sm_scale, head_dim_qk)
        # Custom masks: flattened [sum qo_len_i * kv_len_i] bool, packed little-endian per request.
        mask_lens = qo_lens * kv_lens
        self._mask = self._mask_indptr = None
        if custom_mask is not None or packed_custom_mask is not None:
            if packed_custom_mask is None:
                check_tensor("custom_mask", custom_mask, 1, (torch.bool,))
                if custom_mask.numel() != int(mask_lens.sum()):
                    raise InputError(f"custom_mask must hold sum(qo_len * kv_len) = {int(mask_lens.sum())} "
                                     f"entries, got {custom_mask.numel()}")
                ind = torch.zeros(len(mask_lens) + 1, dtype=torch.int32)
                ind[1:] = torch.cumsum(mask_lens, 0)
                packed_custom_mask, mask_indptr = segment_packbits(custom_mask, ind.to(custom_mask.device),
                                                                   bitorder="little")
            else:
                check_tensor("packed_custom_mask", packed_custom_mask, 1, (torch.uint8,))
                mask_indptr = torch.zeros(len(mask_lens) + 1, dtype=torch.int32)
                mask_indptr[1:] = torch.cumsum((mask_lens + 7) // 8, 0)
                if packed_custom_mask.numel() < int(mask_indptr[-1]):
                    raise InputError(f"packed_custom_mask must hold sum(ceil(qo_len * kv_len / 8)) = "
                                     f"{int(mask_indptr[-1])} bytes, got {packed_custom_mask.numel()}")
            causal = False  # FlashInfer: a custom mask replaces the causal mask
            self._mask_host = (packed_custom_mask, mask_indptr.cpu())
            self._mask = self._to_dev("custom_mask", packed_custom_mask, self._custom_mask_buf, non_blocking)
            self._mask_indptr = self._to_dev("mask_indptr", mask_indptr.to(torch.int32).cpu(),
                                             self._mask_indptr_buf, non_blocking)
        self._causal = bool(causal)
        self._qo_indptr_dev = self._to_dev("qo_indptr", qo_indptr, self._qo_indptr_buf, non_blocking)

        self._choice = self._work_pairs = None
        if self.device.type == "cuda":
            self._choice = self._op.choose(
                device=self.device, dtype=self._q_dtype, requested=self._backend, head_dim_qk=head_dim_qk,
                head_dim_vo=head_dim_vo, kv_dtype=self._kv_dtype, pos_encoding_mode=pos_encoding_mode,
                causal=self._causal, paged=self._paged, custom_mask=self._mask is not None,
                window_left=window_left, logits_soft_cap=self._soft_cap,
                page_size=getattr(self, "_page_size", 1))
            if self._choice.name == "fa2":
                self._plan_fa2(group, non_blocking)
            # The batch's attention work picks the fa3 module (K/V multicast for long launches).
            self._work_pairs = (batch_visible_pairs(qo_lens, kv_lens, self._causal, window_left)
                                if self._choice.name == "fa3" else None)
        if self._use_cuda_graph:
            self._graph_qo_bound = max(self._graph_qo_bound, self._max_qo_len)
            self._check_graph_replan()
        self._planned = True

    def _graph_options(self) -> tuple:
        """What a captured run() keeps of its plan: the kernel and its scalar arguments."""
        return (None if self._choice is None else self._choice.name, self._causal, self._window_left,
                self._soft_cap, self._sm_scale, self._pos_encoding_mode, self._rope_scale, self._rope_theta,
                self._mask is not None, self._q_dtype, self._kv_dtype, self._dqk, self._dvo,
                getattr(self, "_page_size", None))

    def _check_graph_replan(self) -> None:
        """A re-plan after a capture: warn where the captured graphs would replay another kernel or
        options, or (fa3) walk fewer query blocks than this plan's longest request needs."""
        cap = self._graph_capture
        if cap is None:
            return
        opts, bound = cap
        now = self._graph_options()
        problems = []
        if now != opts:
            problems.append("other options (kernel, causal, window, scale, soft cap, RoPE, mask, dtypes or "
                            "page size)")
        if now[0] == "fa3" and self._max_qo_len > bound:
            problems.append(f"a longest request of {self._max_qo_len} queries where the capture's launch "
                            f"covers {bound}")
        if problems:
            warnings.warn("CUDA-graph prefill wrapper re-planned with " + " and ".join(problems) +
                          ": graphs captured before this plan() would replay the old launch; capture them "
                          "again (or plan the longest batch before capturing)", stacklevel=4)

    def _note_capture(self) -> None:
        """run() is being captured: a wrapper without fixed buffers refuses, a CUDA-graph one
        remembers what the graph keeps."""
        if not (capturing() if self.device.type == "cuda" else is_capturing()):
            return
        if not self._use_cuda_graph:
            raise InputError("run() is being captured into a CUDA graph but this wrapper was built with "
                             "use_cuda_graph=False: its plan() buffers may move. Build it with "
                             "use_cuda_graph=True and the index buffers")
        self._graph_capture = (self._graph_options(), self._graph_qo_bound)

    def _max_qo_for_launch(self) -> int:
        """max_qo_len of a launch: in CUDA-graph mode the bound over every plan so far, so that a
        graph captured after the longest plan covers the later ones."""
        return self._graph_qo_bound if self._use_cuda_graph else self._max_qo_len

    def _plan_fa2(self, group, non_blocking):
        masked = self._mask is not None
        # CUDA-graph mode freezes the kernel variant (the grid and the module are captured), so it
        # always takes the general tile; otherwise batches of short requests take the narrow one.
        short = not self._use_cuda_graph and is_short(self._qo_lens.tolist(), group)
        num_ctas = grid_size(self.device, self._q_dtype, self._dqk, self._dvo, self._paged, masked,
                             self._kv_dtype, short)
        ws_bytes = self._ws.numel() * self._ws.element_size()
        plan = plan_fa2(self._qo_lens.numpy(), self._kv_lens.numpy(), num_kv_heads=self._num_kv_heads,
                        group=group, cta_rows=cta_rows(self._dqk, self._dvo, masked, short), causal=self._causal,
                        window_left=self._window_left, num_ctas=num_ctas,
                        max_slots=max_slots_for(ws_bytes, self._dqk, self._dvo, masked, short))
        plan.short = short
        bufs = None
        if self._use_cuda_graph:
            if self._graph_bufs is None:
                n = _GRAPH_WORK_ITEMS
                self._graph_bufs = {
                    "work": torch.zeros(6 * n, dtype=torch.int32, device=self.device),
                    "work_indptr": torch.zeros(num_ctas + 1, dtype=torch.int32, device=self.device),
                    "merge": torch.zeros(5 * n, dtype=torch.int32, device=self.device),
                    "merge_count": torch.zeros(1, dtype=torch.int32, device=self.device),
                }
            bufs = self._graph_bufs
        self._schedule = make_schedule(plan, self.device, self._ws, self._dqk, self._dvo,
                                       int_buffers=bufs, non_blocking=non_blocking)

    begin_forward = None  # set below (legacy alias of plan)

    def _check_forward_options(self, causal, pos_encoding_mode, sm_scale, logits_soft_cap, rope_scale,
                               rope_theta) -> None:
        if not self._planned:
            raise InputError("call plan() before run() (a plan() that raised leaves the wrapper unplanned)")
        options.check_forward_options(
            {"causal": self._causal, "pos_encoding_mode": self._pos_encoding_mode, "sm_scale": self._sm_scale,
             "logits_soft_cap": self._soft_cap, "rope_scale": self._rope_scale, "rope_theta": self._rope_theta},
            self._dqk, causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta)

    def end_forward(self) -> None:
        """Legacy no-op."""

    # ---- run ----------------------------------------------------------------------------
    def _check_q_out(self, q, out, lse, return_lse, enable_pdl):
        if not self._planned:
            raise InputError("call plan() before run() (a plan() that raised leaves the wrapper unplanned)")
        if enable_pdl is not None and not isinstance(enable_pdl, bool):
            raise InputError(f"enable_pdl must be None or a bool, got {enable_pdl!r}")
        check_tensor("q", q, 3, Q_DTYPES)
        if tuple(q.shape) != (self._nnz_qo, self._num_qo_heads, self._dqk):
            raise InputError(f"q must be [qo_indptr[-1], num_qo_heads, head_dim_qk] = "
                             f"[{self._nnz_qo}, {self._num_qo_heads}, {self._dqk}], got {tuple(q.shape)}")
        if q.dtype != self._q_dtype:
            raise InputTypeError(f"q dtype {dtype_name(q.dtype)} differs from "
                             f"plan(q_data_type={dtype_name(self._q_dtype)})")
        if q.device != self.device:
            raise InputError(f"q is on {q.device}, the workspace on {self.device}")
        check_rows("q", q)
        shape = (self._nnz_qo, self._num_qo_heads, self._dvo)
        if out is None:
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
        else:
            check_tensor("out", out, 3, (q.dtype,))
            if tuple(out.shape) != shape:
                raise InputError(f"out must be {list(shape)}, got {tuple(out.shape)}")
            if out.device != q.device:
                raise InputError(f"out must be on {q.device} (q's device), got {out.device}")
            check_rows("out", out)
        if return_lse or lse is not None:
            if lse is None:
                lse = torch.empty(shape[:2], dtype=torch.float32, device=q.device)
            elif (tuple(checks.tensor("lse", lse).shape) != shape[:2] or lse.dtype != torch.float32
                  or not lse.is_contiguous() or lse.device != q.device):
                raise InputError(f"lse must be contiguous float32 {list(shape[:2])} on {q.device}, got "
                                 f"{dtype_name(lse.dtype)} {tuple(lse.shape)} on {lse.device}")
        return out, lse

    def _launch(self, call: PrefillCall) -> None:
        if self._nnz_qo == 0:
            return
        if self._choice.name == "fa2":
            call.schedule = self._schedule
        RUNNERS[self._choice.name](call)

    def _reference_rows(self, q, get_kv, out, lse, k_scale=1.0, v_scale=1.0):
        qo_ind = np.concatenate([[0], np.cumsum(self._qo_lens.numpy())])
        for b in range(len(self._qo_lens)):
            a, e = int(qo_ind[b]), int(qo_ind[b + 1])
            if a == e:
                continue
            kk, vv = get_kv(b)
            mask = None
            if self._mask is not None:
                packed, ind = self._mask_host
                mask = unpack_mask(packed.cpu(), int(ind[b]), e - a, kk.shape[0])
            o, ref_lse = attention_reference(q[a:e], kk, vv, causal=self._causal, sm_scale=self._sm_scale * k_scale,
                                             logits_soft_cap=self._soft_cap or None, window_left=self._window_left,
                                             pos_encoding_mode=self._pos_encoding_mode, rope_scale=self._rope_scale,
                                             rope_theta=self._rope_theta, custom_mask=mask,
                                             v_scale=v_scale if v_scale != 1.0 else None, return_lse=True)
            out[a:e] = o
            if lse is not None:
                lse[a:e] = ref_lse


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillBase):
    """Prefill attention for a batch whose K/V are ragged tensors (CSR by ``kv_indptr``).

    Examples
    --------
    >>> import torch
    >>> ws = torch.empty(1 << 20, dtype=torch.uint8)
    >>> w = BatchPrefillWithRaggedKVCacheWrapper(ws)
    >>> qo = torch.tensor([0, 3, 8], dtype=torch.int32); kv = torch.tensor([0, 5, 12], dtype=torch.int32)
    >>> w.plan(qo, kv, 4, 2, 64, causal=True, q_data_type=torch.bfloat16)
    >>> q = torch.randn(8, 4, 64, dtype=torch.bfloat16)
    >>> k = torch.randn(12, 2, 64, dtype=torch.bfloat16); v = torch.randn(12, 2, 64, dtype=torch.bfloat16)
    >>> w.run(q, k, v).shape
    torch.Size([8, 4, 64])
    """

    _paged = False
    _op = RAGGED_PREFILL

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: Optional[torch.Tensor] = None,
                 kv_indptr_buf: Optional[torch.Tensor] = None, custom_mask_buf: Optional[torch.Tensor] = None,
                 mask_indptr_buf: Optional[torch.Tensor] = None, backend: str = "auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr_buf, kv_indptr_buf
        self._custom_mask_buf, self._mask_indptr_buf = custom_mask_buf, mask_indptr_buf

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, head_dim_vo: Optional[int] = None,
             custom_mask: Optional[torch.Tensor] = None, packed_custom_mask: Optional[torch.Tensor] = None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             window_left: int = -1, logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             q_data_type="float16", kv_data_type=None, non_blocking: bool = True) -> None:
        """Schedule a batch: ``qo_indptr``/``kv_indptr`` int32 ``[batch + 1]`` (CSR rows of q and
        k/v). Options as :func:`single_prefill_with_kv_cache`; ``custom_mask`` is the
        concatenation of every request's flattened ``[qo_len, kv_len]`` bool mask."""
        self._planned = False  # until this plan is complete: a failed one leaves no stale state
        check_indptr("qo_indptr", qo_indptr)
        check_indptr("kv_indptr", kv_indptr, qo_indptr.numel())
        qo_h, kv_h = qo_indptr.cpu(), kv_indptr.cpu()
        qo_lens, kv_lens = host_lengths("qo_indptr", qo_h), host_lengths("kv_indptr", kv_h)
        self._nnz_kv = int(kv_h[-1])
        self._kv_indptr_dev = self._to_dev("kv_indptr", kv_h, self._kv_indptr_buf, non_blocking)
        self._kv_indptr_host = kv_h
        self._plan_common(qo_h, qo_lens, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                          custom_mask, packed_custom_mask, causal, pos_encoding_mode, window_left,
                          logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type, kv_data_type,
                          non_blocking)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, return_lse: bool = False, enable_pdl=None):
        """``q [nnz_qo, H_qo, D_qk]``, ``k [nnz_kv, H_kv, D_qk]``, ``v [nnz_kv, H_kv, D_vo]``
        (HND: heads first) -> ``out [nnz_qo, H_qo, D_vo]`` (+ base-2 ``lse [nnz_qo, H_qo]``)."""
        out, lse = self._check_q_out(q, out, lse, return_lse, enable_pdl)
        self._note_capture()
        check_tensor("k", k, 3)
        check_tensor("v", v, 3)
        kn = k if self._kv_layout == "NHD" else k.transpose(0, 1)
        vn = v if self._kv_layout == "NHD" else v.transpose(0, 1)
        if kn.shape[0] < self._nnz_kv or tuple(kn.shape[1:]) != (self._num_kv_heads, self._dqk):
            raise InputError(f"k must be [>= {self._nnz_kv}, {self._num_kv_heads}, {self._dqk}] (NHD view), "
                             f"got {tuple(kn.shape)}")
        if vn.shape[0] != kn.shape[0] or tuple(vn.shape[1:]) != (self._num_kv_heads, self._dvo):
            raise InputError(f"v must be [{kn.shape[0]}, {self._num_kv_heads}, {self._dvo}] (NHD view), "
                             f"got {tuple(vn.shape)}")
        if k.dtype != self._kv_dtype or v.dtype != self._kv_dtype:
            raise InputTypeError(f"k/v dtype must be {dtype_name(self._kv_dtype)} (plan), "
                             f"got {dtype_name(k.dtype)}/{dtype_name(v.dtype)}")
        if k.device != q.device or v.device != q.device:
            raise InputError(f"k and v must be on q's device {q.device}, got {k.device} and {v.device}")
        check_rows("k", k)
        check_rows("v", v)
        if q.device.type == "cpu":
            kvi = self._kv_indptr_host
            self._reference_rows(q, lambda b: (kn[int(kvi[b]):int(kvi[b + 1])], vn[int(kvi[b]):int(kvi[b + 1])]),
                                 out, lse)
        else:
            self._launch(PrefillCall(
                q=q, k=kn, v=vn, out=out, lse=lse, num_qo_heads=self._num_qo_heads,
                max_qo_len=self._max_qo_for_launch(), num_kv_heads=self._num_kv_heads, head_dim_qk=self._dqk,
                head_dim_vo=self._dvo,
                k_strides=(0, kn.stride(0), kn.stride(1)), v_strides=(0, vn.stride(0), vn.stride(1)),
                qo_indptr=self._qo_indptr_dev, kv_indptr=self._kv_indptr_dev, causal=self._causal,
                window_left=self._window_left, sm_scale=self._sm_scale, logits_soft_cap=self._soft_cap,
                pos_encoding_mode=self._pos_encoding_mode, rope_scale=self._rope_scale,
                rope_theta=self._rope_theta, packed_mask=self._mask, mask_indptr=self._mask_indptr,
                work_pairs=self._work_pairs))
        return (out, lse) if return_lse else out

    def run_return_lse(self, q, k, v, **kw):
        return self.run(q, k, v, return_lse=True, **kw)

    def forward(self, q, k, v, causal=None, pos_encoding_mode=None, use_fp16_qk_reduction=False,
                sm_scale=None, logits_soft_cap=None, rope_scale=None, rope_theta=None, return_lse=False):
        """Legacy alias of run(). The attention options are begin_forward's / plan()'s: one given
        here must equal the planned one (InputError otherwise)."""
        self._check_forward_options(causal, pos_encoding_mode, sm_scale, logits_soft_cap, rope_scale, rope_theta)
        return self.run(q, k, v, return_lse=return_lse)

    def forward_return_lse(self, q, k, v, **kw):
        return self.forward(q, k, v, return_lse=True, **kw)

    begin_forward = plan


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillBase):
    """Prefill attention for a batch whose K/V live in a paged cache.

    Request i owns pages ``paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]]``; its kv
    length is ``(num_pages_i - 1) * page_size + paged_kv_last_page_len[i]``.

    Examples
    --------
    >>> import torch
    >>> ws = torch.empty(1 << 20, dtype=torch.uint8)
    >>> w = BatchPrefillWithPagedKVCacheWrapper(ws)
    >>> i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    >>> w.plan(i32([0, 3]), i32([0, 2]), i32([1, 0]), i32([5]), 4, 2, 64, 16, causal=True,
    ...        q_data_type=torch.bfloat16)
    >>> cache = torch.randn(2, 2, 16, 2, 64, dtype=torch.bfloat16)
    >>> w.run(torch.randn(3, 4, 64, dtype=torch.bfloat16), cache).shape
    torch.Size([3, 4, 64])
    """

    _paged = True
    _op = PAGED_PREFILL

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: Optional[torch.Tensor] = None,
                 paged_kv_indptr_buf: Optional[torch.Tensor] = None,
                 paged_kv_indices_buf: Optional[torch.Tensor] = None,
                 paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
                 custom_mask_buf: Optional[torch.Tensor] = None, mask_indptr_buf: Optional[torch.Tensor] = None,
                 backend: str = "auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr_buf, paged_kv_indptr_buf
        self._kv_indices_buf, self._last_buf = paged_kv_indices_buf, paged_kv_last_page_len_buf
        self._custom_mask_buf, self._mask_indptr_buf = custom_mask_buf, mask_indptr_buf

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: Optional[int] = None, custom_mask: Optional[torch.Tensor] = None,
             packed_custom_mask: Optional[torch.Tensor] = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1, logits_soft_cap: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             q_data_type="float16", kv_data_type=None, non_blocking: bool = True) -> None:
        """Schedule a batch over a paged cache (see the class docstring for the index format)."""
        self._planned = False  # until this plan is complete: a failed one leaves no stale state
        check_indptr("qo_indptr", qo_indptr)
        check_indptr("paged_kv_indptr", paged_kv_indptr, qo_indptr.numel())
        checks.int32_vector("paged_kv_last_page_len", paged_kv_last_page_len)
        if paged_kv_last_page_len.numel() != qo_indptr.numel() - 1:
            raise InputError(f"paged_kv_last_page_len must have batch = {qo_indptr.numel() - 1} entries, got "
                             f"{paged_kv_last_page_len.numel()}")
        checks.int32_vector("paged_kv_indices", paged_kv_indices)
        page_size = checks.int_value("page_size", page_size, 1)
        qo_h, kv_h, last_h = qo_indptr.cpu(), paged_kv_indptr.cpu(), paged_kv_last_page_len.cpu().to(torch.int64)
        qo_lens = host_lengths("qo_indptr", qo_h)
        pages = host_lengths("paged_kv_indptr", kv_h)
        check_last_page_len("paged_kv_last_page_len", last_h, pages, page_size)
        kv_lens = torch.where(pages > 0, (pages - 1) * page_size + last_h, torch.zeros_like(pages))
        if paged_kv_indices.numel() < int(kv_h[-1]):
            raise InputError(f"paged_kv_indices has {paged_kv_indices.numel()} entries, "
                             f"paged_kv_indptr[-1] = {int(kv_h[-1])}")
        self._page_size = page_size
        self._kv_indptr_host, self._last_host = kv_h, last_h
        self._kv_indices_host = paged_kv_indices
        self._kv_indptr_dev = self._to_dev("paged_kv_indptr", kv_h, self._kv_indptr_buf, non_blocking)
        self._kv_indices_dev = self._to_dev("paged_kv_indices", paged_kv_indices, self._kv_indices_buf, non_blocking)
        self._last_dev = self._to_dev("paged_kv_last_page_len", paged_kv_last_page_len.cpu(), self._last_buf,
                                      non_blocking)
        self._plan_common(qo_h, qo_lens, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                          custom_mask, packed_custom_mask, causal, pos_encoding_mode, window_left,
                          logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type, kv_data_type,
                          non_blocking)

    def run(self, q: torch.Tensor, paged_kv_cache, *, k_scale=None, v_scale=None,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            return_lse: bool = False, enable_pdl=None):
        """``q [nnz_qo, H_qo, D_qk]`` over the cache -> ``out [nnz_qo, H_qo, D_vo]`` (+ ``lse``).
        ``k_scale`` folds into the softmax scale, ``v_scale`` multiplies the output (in the kernel's
        epilogue: no extra pass over ``out``)."""
        out, lse = self._check_q_out(q, out, lse, return_lse, enable_pdl)
        self._note_capture()
        kv = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        if kv.page_size != self._page_size or kv.num_kv_heads != self._num_kv_heads or kv.head_dim != self._dqk:
            raise InputError(f"paged_kv_cache has page_size {kv.page_size}, {kv.num_kv_heads} kv heads, head_dim "
                             f"{kv.head_dim}; plan() was given {self._page_size}, {self._num_kv_heads}, {self._dqk}")
        if kv.dtype != self._kv_dtype:
            raise InputTypeError(f"paged_kv_cache dtype {dtype_name(kv.dtype)} differs from "
                             f"plan ({dtype_name(self._kv_dtype)})")
        if kv.device != q.device:
            raise InputError(f"paged_kv_cache must be on q's device {q.device}, got {kv.device}")
        ks, vs = to_float_scale("k_scale", k_scale), to_float_scale("v_scale", v_scale)
        if q.device.type == "cpu" or knobs.check_inputs():  # reads the page ids (on a GPU: a sync)
            checks.index_values("paged_kv_indices", self._kv_indices_dev[: int(self._kv_indptr_host[-1])],
                                kv.num_pages, " (the cache's page count)")
        if q.device.type == "cpu":
            self._reference_rows(
                q, lambda b: gather_paged_kv(paged_kv_cache, self._kv_indptr_host, self._kv_indices_host,
                                             self._last_host, b, self._kv_layout), out, lse, k_scale=ks,
                v_scale=vs)
        else:
            self._launch(PrefillCall(
                q=q, k=kv.k, v=kv.v, out=out, lse=lse, num_qo_heads=self._num_qo_heads,
                max_qo_len=self._max_qo_for_launch(), num_kv_heads=self._num_kv_heads, head_dim_qk=self._dqk,
                head_dim_vo=self._dvo,
                k_strides=kv.k_strides, v_strides=kv.v_strides, paged=True, page_size=self._page_size,
                qo_indptr=self._qo_indptr_dev, kv_indptr=self._kv_indptr_dev, kv_indices=self._kv_indices_dev,
                kv_last_page_len=self._last_dev, causal=self._causal, window_left=self._window_left,
                sm_scale=self._sm_scale * ks, v_scale=vs, logits_soft_cap=self._soft_cap,
                pos_encoding_mode=self._pos_encoding_mode, rope_scale=self._rope_scale,
                rope_theta=self._rope_theta, packed_mask=self._mask, mask_indptr=self._mask_indptr,
                work_pairs=self._work_pairs))
        return (out, lse) if return_lse else out

    def run_return_lse(self, q, paged_kv_cache, **kw):
        return self.run(q, paged_kv_cache, return_lse=True, **kw)

    def forward(self, q, paged_kv_cache, causal=None, pos_encoding_mode=None, use_fp16_qk_reduction=False,
                k_scale=None, v_scale=None, sm_scale=None, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                return_lse=False):
        """Legacy alias of run(). The attention options are begin_forward's / plan()'s: one given
        here must equal the planned one (InputError otherwise)."""
        self._check_forward_options(causal, pos_encoding_mode, sm_scale, logits_soft_cap, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    def forward_return_lse(self, q, paged_kv_cache, **kw):
        return self.forward(q, paged_kv_cache, return_lse=True, **kw)

    begin_forward = plan
