"""MultiLevelCascadeAttentionWrapper: attention over a KV cache organised in levels (e.g. level 0
= a prefix shared by every request, level 1 = each request's own suffix), FlashInfer's cascade.

Each level is an ordinary paged batch prefill whose "requests" are groups of query rows
(``qo_indptr_arr[i]``) that share that level's pages; every level covers all query rows. The
levels' partial states (output + base-2 LSE) are combined with ``merge_state_in_place``, so the
result equals attention over the concatenation of every level's KV for each query row. A shared
prefix is read once per group instead of once per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from fi_core import checks
from fi_core.errors import InputError, InputTypeError

from ..prefill.common import check_indptr
from ..prefill.wrappers import BatchPrefillWithPagedKVCacheWrapper
from .merge import merge_state_in_place

__all__ = ["MultiLevelCascadeAttentionWrapper"]


class MultiLevelCascadeAttentionWrapper:
    """Cascade attention over ``num_levels`` levels of a paged KV cache.

    Examples
    --------
    >>> import torch
    >>> i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    >>> w = MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8))
    >>> # level 0: both requests (5 query rows) share page 0; level 1: own pages 1 and 2
    >>> w.plan([i32([0, 5]), i32([0, 2, 5])], [i32([0, 1]), i32([0, 1, 2])],
    ...        [i32([0]), i32([1, 2])], [i32([16]), i32([3, 7])], 4, 2, 64, 16,
    ...        q_data_type=torch.bfloat16)
    >>> cache = torch.randn(3, 2, 16, 2, 64, dtype=torch.bfloat16)
    >>> w.run(torch.randn(5, 4, 64, dtype=torch.bfloat16), cache).shape
    torch.Size([5, 4, 64])
    """

    def __init__(self, num_levels: int, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr: Optional[Sequence[torch.Tensor]] = None,
                 paged_kv_indptr_buf_arr: Optional[Sequence[torch.Tensor]] = None,
                 paged_kv_indices_buf_arr: Optional[Sequence[torch.Tensor]] = None,
                 paged_kv_last_page_len_buf_arr: Optional[Sequence[torch.Tensor]] = None):
        num_levels = self._num_levels = checks.int_value("num_levels", num_levels, 1)
        self._kv_layout = kv_layout

        def buf(arr, i):
            return None if arr is None else arr[i]

        # Levels run one after another on one stream, so they can share the float workspace.
        self._wrappers = [
            BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer, kv_layout, use_cuda_graph=use_cuda_graph,
                qo_indptr_buf=buf(qo_indptr_buf_arr, i), paged_kv_indptr_buf=buf(paged_kv_indptr_buf_arr, i),
                paged_kv_indices_buf=buf(paged_kv_indices_buf_arr, i),
                paged_kv_last_page_len_buf=buf(paged_kv_last_page_len_buf_arr, i))
            for i in range(num_levels)
        ]

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffers=None) -> None:
        for w in self._wrappers:
            w.reset_workspace_buffer(float_workspace_buffer)

    def plan(self, qo_indptr_arr: Sequence[torch.Tensor], paged_kv_indptr_arr: Sequence[torch.Tensor],
             paged_kv_indices_arr: Sequence[torch.Tensor], paged_kv_last_page_len: Sequence[torch.Tensor],
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1, logits_soft_cap: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             q_data_type="float16", kv_data_type=None) -> None:
        """Plan every level. Each argument ending in ``_arr`` (and ``paged_kv_last_page_len``) is a
        list with one int32 tensor per level, in the formats of
        :meth:`BatchPrefillWithPagedKVCacheWrapper.plan`; ``qo_indptr_arr[i][-1]`` must equal the
        number of query rows for every level."""
        arrs = (qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len)
        names = ("qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr", "paged_kv_last_page_len")
        for name, a in zip(names, arrs):
            if not isinstance(a, (list, tuple)):
                raise InputTypeError(f"{name} must be a list of num_levels int32 tensors, got {type(a).__name__}")
        if any(len(a) != self._num_levels for a in arrs):
            raise InputError(f"every per-level list must have num_levels = {self._num_levels} entries, got "
                             f"{[len(a) for a in arrs]}")
        for i, t in enumerate(qo_indptr_arr):
            check_indptr(f"qo_indptr_arr[{i}]", t)
        totals = {int(t[-1]) for t in qo_indptr_arr}
        if len(totals) != 1:
            raise InputError(f"qo_indptr_arr[i][-1] must be the same for every level, got {sorted(totals)}")
        for i, w in enumerate(self._wrappers):
            w.plan(qo_indptr_arr[i], paged_kv_indptr_arr[i], paged_kv_indices_arr[i], paged_kv_last_page_len[i],
                   num_qo_heads, num_kv_heads, head_dim, page_size, causal=causal,
                   pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                   logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                   q_data_type=q_data_type, kv_data_type=kv_data_type)

    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, return_lse: bool = False):
        """``q [nnz_qo, H_qo, D]`` over every level of the cache -> ``out [nnz_qo, H_qo, D]``."""
        out, lse = self._wrappers[0].run(q, paged_kv_cache, out=out, lse=lse, return_lse=True)
        for w in self._wrappers[1:]:
            o_i, s_i = w.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(out, lse, o_i, s_i)
        return (out, lse) if return_lse else out

    def forward(self, q, paged_kv_cache, causal=None, pos_encoding_mode=None, use_fp16_qk_reduction=False,
                sm_scale=None, logits_soft_cap=None, rope_scale=None, rope_theta=None):
        """Legacy alias of :meth:`run`. The attention options are plan()'s: one given here must
        equal the planned one (InputError otherwise)."""
        # every level's wrapper was planned with the same options
        self._wrappers[0]._check_forward_options(causal, pos_encoding_mode, sm_scale, logits_soft_cap,
                                                 rope_scale, rope_theta)
        return self.run(q, paged_kv_cache)

    def end_forward(self) -> None:
        """Legacy no-op."""
