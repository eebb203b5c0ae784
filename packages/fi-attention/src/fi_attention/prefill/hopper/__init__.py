"""The Hopper (sm_90a) FA3-style prefill kernel ("fa3"): TMA + warp-specialised wgmma.

The public prefill API (``fi_attention.prefill``) calls this runner when ``backend='fa3'`` or when
``'auto'`` picks it. Two seams:

* :func:`supports` / :func:`run_ragged` / :func:`run_paged`: keyword-level, ragged K/V (single
  prefill = batch 1) or a page table.
* :func:`unsupported_reason` / :func:`run`: adapters for the prefill package's ``PrefillCall``.

``run_ragged`` writes ``out`` (and ``lse``) in place: no allocation, no host synchronisation.
"""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import arch_of, current_stream, knobs, load, on_device
from fi_core.errors import InputError, InputTypeError, UnsupportedError

from .spec import DTYPES, FP8_HEAD_DIMS, FP8_KV, HEAD_DIMS, kv_tile, prefill_sm90_spec, use_multicast, visible_pairs

__all__ = ["supports", "run_ragged", "run_paged", "unsupported_reason", "run", "ARCH"]

ARCH = "9.0a"  # wgmma / setmaxnreg need the arch-specific target


def supports(*, head_dim_qk: int, head_dim_vo: int, dtype: torch.dtype, kv_dtype: torch.dtype,
             causal: bool = False, custom_mask: bool = False, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, pos_encoding_mode: str = "NONE",
             paged: bool = False, page_size: int = 1) -> Optional[str]:
    """Whether the fa3 kernel can run a case: None if it can, else the reason (one sentence).

    The device architecture (sm_90a) is checked by the dispatcher (Backend archs), not here.
    """
    if head_dim_qk != head_dim_vo:
        return f"fa3 needs head_dim_qk == head_dim_vo, got {head_dim_qk} and {head_dim_vo}"
    if head_dim_qk not in HEAD_DIMS:
        return f"fa3 supports head_dim {HEAD_DIMS}, got {head_dim_qk}"
    if dtype not in DTYPES:
        return f"fa3 supports q dtype bfloat16/float16, got {dtype}"
    if kv_dtype is not None and (why := _kv_dtype_reason(kv_dtype, dtype, head_dim_qk)):
        return why
    if pos_encoding_mode not in (None, "NONE"):
        return f"fa3 supports pos_encoding_mode='NONE' only, got {pos_encoding_mode!r}"
    if paged and _page_size_reason(head_dim_qk, page_size):
        return _page_size_reason(head_dim_qk, page_size)
    return None


def _page_size_reason(head_dim: int, page_size: int) -> Optional[str]:
    # TMA loads whole pages (or tile-sized slices of pages) into 1024-byte swizzle periods.
    tile = kv_tile(head_dim)
    if page_size > 0 and (page_size % tile == 0 or (tile % page_size == 0 and page_size % 8 == 0)):
        return None
    return (f"fa3 paged KV needs page_size a multiple of 8 dividing {tile} or a multiple of {tile} "
            f"(head_dim {head_dim}), got {page_size}")


def unsupported_reason(facts: dict) -> Optional[str]:
    """:func:`supports` over the prefill dispatcher's facts dict (missing facts = defaults)."""
    dtype = facts.get("dtype")
    return supports(
        head_dim_qk=facts.get("head_dim_qk", 128),
        head_dim_vo=facts.get("head_dim_vo", facts.get("head_dim_qk", 128)),
        dtype=dtype if dtype is not None else torch.bfloat16,
        kv_dtype=facts.get("kv_dtype", dtype),
        causal=bool(facts.get("causal", False)),
        custom_mask=bool(facts.get("custom_mask", False)),
        window_left=facts.get("window_left", -1),
        logits_soft_cap=facts.get("logits_soft_cap"),
        pos_encoding_mode=facts.get("pos_encoding_mode", "NONE"),
        paged=bool(facts.get("paged", False)),
        page_size=facts.get("page_size", 1),
    )


def _kv_dtype_reason(kv_dtype: torch.dtype, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why fa3 cannot take k/v of ``kv_dtype`` beside q of ``dtype`` (None: it can)."""
    if kv_dtype == dtype:
        return None
    if kv_dtype not in FP8_KV:
        return f"fa3 needs k/v dtype == q dtype ({dtype}) or float8_e4m3fn/e5m2, got {kv_dtype}"
    if head_dim not in FP8_HEAD_DIMS:
        return f"fa3 takes fp8 k/v at head_dim {FP8_HEAD_DIMS}, got {head_dim}"
    return None


def _kv_dtype_ok(name: str, kv_dtype: torch.dtype, dtype: torch.dtype, head_dim: int) -> None:
    if kv_dtype != dtype and kv_dtype not in FP8_KV:
        raise InputTypeError(f"{name} must be {dtype} like q, or float8_e4m3fn/e5m2, got {kv_dtype}")
    why = _kv_dtype_reason(kv_dtype, dtype, head_dim)  # what remains: the head dims fp8 is built for
    if why:
        raise UnsupportedError(why)


def _check_nhd(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    # TMA needs 16-byte aligned base addresses and strides; the epilogue stores 16-byte row chunks of o.
    if t.dtype != dtype:
        raise InputTypeError(f"{name} must be {dtype} like q, got {t.dtype}")
    if t.dim() != 3:
        raise InputError(f"{name} must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if t.stride(2) != 1:
        raise InputError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    per16 = 16 // t.element_size()  # elements per 16 bytes
    if t.data_ptr() % 16 or t.stride(0) % per16 or (t.shape[1] > 1 and t.stride(1) % per16):
        raise InputError(f"{name} must be 16-byte aligned with token/head strides that are multiples "
                         f"of {per16} elements for the fa3 kernel, got ptr % 16 = {t.data_ptr() % 16}, "
                         f"strides {t.stride()}")


def run_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               qo_indptr: Optional[torch.Tensor], kv_indptr: Optional[torch.Tensor],
               out: torch.Tensor, lse: Optional[torch.Tensor], *, causal: bool, sm_scale: float,
               logits_soft_cap: Optional[float] = None, window_left: int = -1, v_scale: float = 1.0,
               max_qo_len: int, batch_size: int, work_pairs: Optional[int] = None,
               packed_mask: Optional[torch.Tensor] = None, mask_indptr: Optional[torch.Tensor] = None) -> None:
    """Ragged prefill attention on Hopper, written into ``out`` (and ``lse``).

    Parameters
    ----------
    q : torch.Tensor
        ``[nnz_q, H_qo, D]`` bfloat16/float16, last dim contiguous (token/head strides are read).
    k, v : torch.Tensor
        ``[nnz_kv, H_kv, D]``, q's dtype or (head_dim 64 / 128) both fp8 e4m3 / e5m2, widened in
        the kernel (the caller folds k_scale into ``sm_scale`` and passes ``v_scale``); ``H_qo`` a
        multiple of ``H_kv``.
    qo_indptr, kv_indptr : torch.Tensor or None
        Device int32 ``[batch_size + 1]``. Both None = one request (``q`` and ``k`` whole).
    out : torch.Tensor
        ``[nnz_q, H_qo, D]``, q's dtype; overwritten.
    lse : torch.Tensor or None
        Contiguous float32 ``[nnz_q, H_qo]``, base-2 log-sum-exp; -inf for rows that see no key.
    causal : bool
        Bottom-right aligned: query ``i`` of a request sees keys ``j <= i + kv_len - qo_len``.
    sm_scale : float
        Logit scale (FlashInfer default ``1/sqrt(D)``, applied by the caller).
    logits_soft_cap : float or None
        > 0: logits ``cap * tanh(sm_scale * q.k / cap)`` (tanh.approx, ~2^-11 relative).
    window_left : int
        Sliding window: query ``i`` also needs ``j >= i + kv_len - qo_len - window_left``; -1 = off.
    v_scale : float
        Multiplies the output, in the kernel's epilogue (the LSE does not depend on it).
    max_qo_len, batch_size : int
        Host ints: the longest request's query count (an upper bound is fine) and the batch.
    work_pairs : int, optional
        Visible (query, key) pairs per query head summed over the batch (``spec.visible_pairs``;
        the wrappers pass it from their plan). It only picks the module under
        ``FI_FA3_MULTICAST=auto``; when not given, a batch of equal requests is assumed.
    packed_mask, mask_indptr : torch.Tensor, optional
        A custom mask (replaces ``causal``, which must then be False): uint8 bits packed in
        little bit order, request ``b``'s ``[qo_len, kv_len]`` row-major from byte
        ``mask_indptr[b]`` (device int32 ``[batch_size + 1]``; None with one request: byte 0).

    Examples
    --------
    >>> q = torch.randn(4096, 32, 128, dtype=torch.bfloat16, device="cuda")       # doctest: +SKIP
    >>> k = v = torch.randn(4096, 8, 128, dtype=torch.bfloat16, device="cuda")    # doctest: +SKIP
    >>> out = torch.empty_like(q)                                                # doctest: +SKIP
    >>> run_ragged(q, k, v, None, None, out, None, causal=True, sm_scale=128 ** -0.5,
    ...            max_qo_len=4096, batch_size=1)                                # doctest: +SKIP
    """
    dtype = q.dtype
    if dtype not in DTYPES:
        raise InputTypeError(f"q must be bfloat16 or float16, got {dtype}")
    _check_nhd("q", q, dtype)
    kv_dtype = k.dtype
    _kv_dtype_ok("k", kv_dtype, dtype, q.shape[-1])
    for name, t, dt in (("k", k, kv_dtype), ("v", v, kv_dtype), ("out", out, dtype)):
        _check_nhd(name, t, dt)
    nnz_q, hq, d = q.shape
    nnz_kv, hkv, dk = k.shape
    if d not in HEAD_DIMS or dk != d or v.shape[2] != d or out.shape[2] != d:
        raise InputError(f"fa3 needs equal head dims in {HEAD_DIMS}: q {d}, k {dk}, v {v.shape[2]}, out {out.shape[2]}")
    if v.shape[:2] != k.shape[:2]:
        raise InputError(f"v must match k in [tokens, heads], got {tuple(v.shape)} vs {tuple(k.shape)}")
    if hkv == 0 or hq % hkv:
        raise InputError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if hkv > 1 and (k.stride(1) > k.stride(0)) != (v.stride(1) > v.stride(0)):
        raise InputError(f"k and v must share a layout (both token-major or both head-major), got "
                         f"strides {k.stride()} and {v.stride()}")
    if tuple(out.shape[:2]) != (nnz_q, hq):
        raise InputError(f"out must be [{nnz_q}, {hq}, {d}], got {tuple(out.shape)}")
    if lse is not None:
        if lse.dtype != torch.float32 or tuple(lse.shape) != (nnz_q, hq) or not lse.is_contiguous():
            raise InputError(f"lse must be contiguous float32 [{nnz_q}, {hq}], got {lse.dtype} "
                             f"{tuple(lse.shape)} strides {lse.stride()}")
    if (qo_indptr is None) != (kv_indptr is None):
        raise InputError("qo_indptr and kv_indptr must both be given or both be None")
    if qo_indptr is None:
        if batch_size != 1:
            raise InputError(f"without indptrs batch_size must be 1, got {batch_size}")
        max_qo_len = nnz_q
    else:
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
            if t.dtype != torch.int32 or t.device != q.device or t.numel() < batch_size + 1:
                raise InputError(f"{name} must be int32 on {q.device} with >= {batch_size + 1} "
                                 f"entries, got {t.dtype} on {t.device} with {t.numel()}")
    _check_mask(packed_mask, mask_indptr, causal, q.device, batch_size, qo_indptr is None)
    if nnz_q == 0 or batch_size == 0 or max_qo_len == 0:
        return
    if nnz_kv == 0:
        # No key at all: every row sees nothing, which the API defines as output 0 and LSE -inf.
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    cap = float(logits_soft_cap) if logits_soft_cap and logits_soft_cap > 0 else 0.0
    flops = _work_flops(work_pairs, nnz_q, nnz_kv, batch_size, bool(causal), window_left, hq, d)
    masked = packed_mask is not None
    mc = not masked and kv_dtype == dtype and use_multicast(d, hq, hkv, flops)
    mod = load(prefill_sm90_spec(dtype, d, bool(causal), arch_of(q.device), softcap=cap > 0, multicast=mc,
                                 custom_mask=masked, kv_dtype=kv_dtype))
    with on_device(q.device):
        mod.fi_prefill_sm90_ragged(
            q.data_ptr(), k.data_ptr(), v.data_ptr(),
            0 if qo_indptr is None else qo_indptr.data_ptr(),
            0 if kv_indptr is None else kv_indptr.data_ptr(),
            out.data_ptr(), 0 if lse is None else lse.data_ptr(),
            nnz_q, nnz_kv, hq, hkv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            batch_size, int(max_qo_len), float(sm_scale), cap, float(v_scale),
            -1 if window_left is None or window_left < 0 else int(window_left), *_mask_ptrs(packed_mask, mask_indptr),
            knobs.fa3_ctas(), current_stream(q.device))


def _check_mask(packed_mask, mask_indptr, causal, device, batch_size: int, single: bool) -> None:
    if packed_mask is None:
        if mask_indptr is not None:
            raise InputError("mask_indptr given without packed_mask")
        return
    if causal:
        raise InputError("a custom mask replaces the causal mask: pass causal=False with packed_mask")
    if packed_mask.dtype != torch.uint8 or packed_mask.device != device or packed_mask.dim() != 1 \
            or not packed_mask.is_contiguous():
        raise InputError(f"packed_mask must be contiguous 1-D uint8 on {device}, got {packed_mask.dtype} "
                         f"{tuple(packed_mask.shape)} on {packed_mask.device}")
    if not single and (mask_indptr is None or mask_indptr.dtype != torch.int32 or mask_indptr.device != device
                       or mask_indptr.numel() < batch_size + 1):
        got = None if mask_indptr is None else (mask_indptr.dtype, str(mask_indptr.device), mask_indptr.numel())
        raise InputError(f"mask_indptr must be int32 on {device} with >= {batch_size + 1} entries, got {got}")


def _mask_ptrs(packed_mask, mask_indptr) -> tuple[int, int]:
    return (0 if packed_mask is None else packed_mask.data_ptr(),
            0 if packed_mask is None or mask_indptr is None else mask_indptr.data_ptr())


def run_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
              kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
              out: torch.Tensor, lse: Optional[torch.Tensor], *, k_strides: tuple[int, int, int],
              v_strides: tuple[int, int, int], page_size: int, causal: bool, sm_scale: float,
              logits_soft_cap: Optional[float] = None, window_left: int = -1, v_scale: float = 1.0,
              max_qo_len: int, batch_size: int, num_kv_heads: Optional[int] = None,
              packed_mask: Optional[torch.Tensor] = None, mask_indptr: Optional[torch.Tensor] = None,
              work_pairs: Optional[int] = None) -> None:
    """Prefill attention over a paged KV cache on Hopper, written into ``out`` (and ``lse``).

    Parameters
    ----------
    q, out, lse, causal, sm_scale, logits_soft_cap, window_left, v_scale, max_qo_len, batch_size
        As in :func:`run_ragged` (``qo_indptr`` is required).
    packed_mask, mask_indptr : torch.Tensor, optional
        As in :func:`run_ragged`; ``mask_indptr`` is required with a mask.
    k_cache, v_cache : torch.Tensor
        The two halves of the cache, pages first (``[num_pages, ...]``, NHD or HND), q's dtype or
        (head_dim 64 / 128) fp8 e4m3 / e5m2, as in :func:`run_ragged`.
    k_strides, v_strides : tuple of int
        Element strides (page, token, head) of ``k_cache`` / ``v_cache``; the head dim is contiguous.
    qo_indptr, kv_indptr, kv_indices, kv_last_page_len : torch.Tensor
        Device int32: ``[batch + 1]``, ``[batch + 1]`` (into ``kv_indices``), ``[nnz_pages]`` page
        ids, ``[batch]`` tokens in each request's last page (1..page_size).
    page_size : int
        A multiple of 8 dividing the KV tile (128 for d <= 128, 80 for d = 256), or a multiple of it.
    num_kv_heads : int, optional
        Read from the cache shape and strides when not given.
    work_pairs : int, optional
        As in :func:`run_ragged`; when not given, ``kv_indices`` (all of it) bounds the batch's keys.

    Examples
    --------
    >>> cache = torch.randn(64, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
    >>> k, v = cache[:, 0], cache[:, 1]                       # [pages, page, Hkv, D] (NHD)  # doctest: +SKIP
    >>> run_paged(q, k, v, qo_indptr, kv_indptr, kv_indices, last_len, out, None,
    ...           k_strides=(k.stride(0), k.stride(1), k.stride(2)),
    ...           v_strides=(v.stride(0), v.stride(1), v.stride(2)), page_size=16, causal=True,
    ...           sm_scale=128 ** -0.5, max_qo_len=2048, batch_size=16)  # doctest: +SKIP
    """
    dtype = q.dtype
    if dtype not in DTYPES:
        raise InputTypeError(f"q must be bfloat16 or float16, got {dtype}")
    for name, t in (("q", q), ("out", out)):
        _check_nhd(name, t, dtype)
    nnz_q, hq, d = q.shape
    if d not in HEAD_DIMS or out.shape[2] != d or tuple(out.shape[:2]) != (nnz_q, hq):
        raise InputError(f"fa3 needs head_dim in {HEAD_DIMS} and out [{nnz_q}, {hq}, {d}], got q "
                         f"{tuple(q.shape)}, out {tuple(out.shape)}")
    why = _page_size_reason(d, page_size)
    if why:
        raise UnsupportedError(why)
    kv_dtype = k_cache.dtype
    _kv_dtype_ok("k_cache", kv_dtype, dtype, d)
    for name, t, st in (("k_cache", k_cache, k_strides), ("v_cache", v_cache, v_strides)):
        if t.dtype != kv_dtype:
            raise InputTypeError(f"{name} must be {kv_dtype} like k_cache, got {t.dtype}")
        if t.shape[-1] != d or t.stride(-1) != 1:
            raise InputError(f"{name} must end in a contiguous head_dim {d}, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")
        per16 = 16 // t.element_size()
        if t.data_ptr() % 16 or any(int(x) % per16 for x in st):
            raise InputError(f"{name} must be 16-byte aligned with (page, token, head) strides that are "
                             f"multiples of {per16} elements, got ptr % 16 = {t.data_ptr() % 16}, strides {st}")
    hkv = int(num_kv_heads) if num_kv_heads else _kv_heads(k_cache, k_strides, page_size)
    if hkv == 0 or hq % hkv:
        raise InputError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (nnz_q, hq)
                            or not lse.is_contiguous()):
        raise InputError(f"lse must be contiguous float32 [{nnz_q}, {hq}], got {lse.dtype} {tuple(lse.shape)}")
    for name, t, n in (("qo_indptr", qo_indptr, batch_size + 1), ("kv_indptr", kv_indptr, batch_size + 1),
                       ("kv_indices", kv_indices, 0), ("kv_last_page_len", kv_last_page_len, batch_size)):
        if t is None or t.dtype != torch.int32 or t.device != q.device or t.numel() < n:
            raise InputError(f"{name} must be int32 on {q.device} with >= {n} entries, got "
                             f"{None if t is None else (t.dtype, str(t.device), t.numel())}")
    _check_mask(packed_mask, mask_indptr, causal, q.device, batch_size, False)
    if nnz_q == 0 or batch_size == 0 or max_qo_len == 0:
        return
    cap = float(logits_soft_cap) if logits_soft_cap and logits_soft_cap > 0 else 0.0
    flops = _work_flops(work_pairs, nnz_q, kv_indices.numel() * page_size, batch_size, bool(causal),
                        window_left, hq, d)
    masked = packed_mask is not None
    mc = not masked and kv_dtype == dtype and use_multicast(d, hq, hkv, flops)
    mod = load(prefill_sm90_spec(dtype, d, bool(causal), arch_of(q.device), paged=True, softcap=cap > 0,
                                 multicast=mc, custom_mask=masked, kv_dtype=kv_dtype))
    with on_device(q.device):
        mod.fi_prefill_sm90_paged(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), qo_indptr.data_ptr(), kv_indptr.data_ptr(),
            kv_indices.data_ptr(), kv_last_page_len.data_ptr(), out.data_ptr(),
            0 if lse is None else lse.data_ptr(), nnz_q, k_cache.shape[0], page_size, hq, hkv,
            q.stride(0), q.stride(1), *map(int, k_strides), *map(int, v_strides), out.stride(0), out.stride(1),
            batch_size, int(max_qo_len), float(sm_scale), cap, float(v_scale),
            -1 if window_left is None or window_left < 0 else int(window_left), *_mask_ptrs(packed_mask, mask_indptr),
            knobs.fa3_ctas(), current_stream(q.device))


def _work_flops(work_pairs: Optional[int], nnz_q: int, nnz_kv: int, batch: int, causal: bool,
                window_left: Optional[int], hq: int, d: int) -> float:
    """Attention FLOPs of a launch (Q K^T and P V over the visible pairs), for the module choice:
    from the plan's pair count, else from equal requests of nnz_q / batch queries and nnz_kv / batch
    keys (exact for single prefill)."""
    if work_pairs is None:
        b = max(int(batch), 1)
        work_pairs = b * visible_pairs(nnz_q // b, nnz_kv // b, causal, window_left)
    return 4.0 * d * hq * work_pairs


def _kv_heads(cache: torch.Tensor, strides, page_size: int) -> int:
    # Pages first; the other two non-D dims are page_size tokens and the heads (NHD or HND).
    dims = [s for s in cache.shape[1:-1]]
    if len(dims) != 2:
        raise InputError(f"a paged cache half must be 4-D [pages, ., ., D], got {tuple(cache.shape)}")
    tok_stride, head_stride = int(strides[1]), int(strides[2])
    by_stride = {int(cache.stride(i + 1)): dims[i] for i in range(2)}
    if head_stride in by_stride and tok_stride in by_stride and head_stride != tok_stride:
        return by_stride[head_stride]
    return dims[1] if dims[0] == page_size else dims[0]


def run(call) -> None:
    """Adapter for ``fi_attention.prefill.launch.PrefillCall`` (ragged or single prefill).

    ``max_qo_len`` is taken from ``call.max_qo_len`` or the plan when the caller provides it;
    otherwise ``nnz_q`` bounds it (correct; the persistent CTAs then walk and skip many empty
    m-blocks, a small cost per request).
    """
    mask = dict(packed_mask=getattr(call, "packed_mask", None), mask_indptr=getattr(call, "mask_indptr", None))
    qo_indptr = getattr(call, "qo_indptr", None)
    kv_indptr = getattr(call, "kv_indptr", None)
    nnz_q = call.q.shape[0]
    if qo_indptr is None:
        batch, max_qo = 1, nnz_q
    else:
        batch = qo_indptr.numel() - 1
        max_qo = getattr(call, "max_qo_len", None)
        plan = getattr(getattr(call, "schedule", None), "plan", None)
        if max_qo is None and plan is not None:
            max_qo = getattr(plan, "max_qo_len", None)
        max_qo = nnz_q if not max_qo else int(max_qo)
    softcap = getattr(call, "logits_soft_cap", 0.0) or None
    pairs = getattr(call, "work_pairs", None)
    if getattr(call, "paged", False):
        run_paged(call.q, call.k, call.v, qo_indptr, kv_indptr, call.kv_indices, call.kv_last_page_len,
                  call.out, call.lse, k_strides=tuple(call.k_strides), v_strides=tuple(call.v_strides),
                  page_size=int(call.page_size), causal=bool(call.causal), sm_scale=float(call.sm_scale),
                  logits_soft_cap=softcap, window_left=getattr(call, "window_left", -1),
                  v_scale=float(getattr(call, "v_scale", 1.0)), max_qo_len=max_qo, batch_size=batch,
                  num_kv_heads=call.num_kv_heads, work_pairs=pairs, **mask)
        return
    run_ragged(call.q, call.k, call.v, qo_indptr, kv_indptr, call.out, call.lse,
               causal=bool(call.causal), sm_scale=float(call.sm_scale), logits_soft_cap=softcap,
               window_left=getattr(call, "window_left", -1), v_scale=float(getattr(call, "v_scale", 1.0)),
               max_qo_len=max_qo, batch_size=batch, work_pairs=pairs, **mask)
