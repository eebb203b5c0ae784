"""The attention reference of fi-attention: pure torch, fp32 math, FlashInfer's conventions.

One function, :func:`attention_reference`, is the oracle for every attention op of the package
(decode, prefill, ragged, paged, cascade) and the CPU backend. Conventions (shared/API.md):

* logits ``s = sm_scale * k_scale * (q . k)`` (``sm_scale`` defaults to ``1/sqrt(D)``),
  then ``cap * tanh(s / cap)`` when ``logits_soft_cap > 0``, then ALiBi ``+ slope_h * (j - p)``.
* query ``i`` of ``Lq`` sits at position ``p = q_offset + i`` (``q_offset`` defaults to
  ``Lkv - Lq``: causal masks are aligned bottom-right); key ``j`` at position ``j``.
* causal keeps ``j <= p``; ``window_left >= 0`` keeps ``j >= p - window_left``; ``custom_mask``
  (``[Lq, Lkv]`` bool, True = keep) is ANDed in.
* ``ROPE_LLAMA`` rotates q (at ``p``) and k (at ``j``) inside attention, non-interleaved halves,
  frequency ``pos / (rope_scale * rope_theta ** (2 i / D))``.
* LSE is ``log2(sum exp(s))`` (base 2), float32. A fully masked row gives out 0 and lse -inf.
* ``v_scale`` multiplies the output.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .kv import PagedKVCache, check_kv_layout, to_nhd

POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """FlashInfer's/the ALiBi paper's head slopes, float32 ``[num_heads]``.

    For ``n = 2**floor(log2(H))``: heads ``0..n-1`` get ``2**(-8 (h+1) / n)``; the remaining
    ``H - n`` heads get ``2**(-4 (2 m + 1) / n)`` for ``m = 0, 1, ...``.
    """
    n = 2 ** int(math.floor(math.log2(num_heads)))
    base = 2.0 ** (-8.0 / n)
    slopes = [base ** (h + 1) for h in range(n)]
    if n < num_heads:
        extra = 2.0 ** (-4.0 / n)
        slopes += [extra ** (2 * m + 1) for m in range(num_heads - n)]
    return torch.tensor(slopes, dtype=torch.float32)


def rope_llama(x: torch.Tensor, pos: torch.Tensor, rope_scale: float = 1.0,
               rope_theta: float = 1e4) -> torch.Tensor:
    """Rotate ``x [L, H, D]`` (float32) at positions ``pos [L]``: Llama's non-interleaved RoPE."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = 1.0 / (rope_scale * rope_theta ** (torch.arange(half, dtype=torch.float64, device=pos.device) * 2 / d))
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cos(ang).float()[:, None, :]
    sin = torch.sin(ang).float()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        sm_scale: Optional[float] = None, logits_soft_cap: Optional[float] = None,
                        window_left: int = -1, pos_encoding_mode: str = "NONE",
                        rope_scale: float = 1.0, rope_theta: float = 1e4,
                        custom_mask: Optional[torch.Tensor] = None, alibi: bool = False,
                        k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                        q_offset: Optional[int] = None, return_lse: bool = False):
    """Attention of one request in fp32.

    Parameters
    ----------
    q : torch.Tensor
        ``[Lq, Hq, D]``.
    k, v : torch.Tensor
        ``[Lkv, Hkv, D]`` and ``[Lkv, Hkv, Dv]``; ``Hq`` is a multiple of ``Hkv`` (GQA: query
        head ``h`` uses kv head ``h // (Hq // Hkv)``). Any float dtype, fp8 included.
    causal, sm_scale, logits_soft_cap, window_left, pos_encoding_mode, rope_scale, rope_theta,
    custom_mask, alibi, k_scale, v_scale, q_offset
        See the module docstring. ``pos_encoding_mode="ALIBI"`` is the same as ``alibi=True``.
    return_lse : bool
        Also return the base-2 log-sum-exp ``[Lq, Hq]`` float32.

    Returns
    -------
    out : torch.Tensor
        ``[Lq, Hq, Dv]`` in ``q.dtype``.
    lse : torch.Tensor, optional
        ``[Lq, Hq]`` float32 (base 2).

    Examples
    --------
    >>> import torch
    >>> q, k, v = torch.randn(1, 8, 64), torch.randn(10, 2, 64), torch.randn(10, 2, 64)
    >>> out, lse = attention_reference(q, k, v, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 8, 64]), torch.Size([1, 8]))
    """
    if pos_encoding_mode not in POS_ENCODING_MODES:
        raise ValueError(f"pos_encoding_mode must be one of {POS_ENCODING_MODES}, got {pos_encoding_mode!r}")
    lq, hq, d = q.shape
    lkv, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    group = hq // hkv
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    if k_scale is not None:
        scale *= float(k_scale)
    dev = q.device  # computed where q lives: fp32 on the GPU keeps large GPU tests fast
    qf, kf, vf = q.float(), k.to(dev).float(), v.to(dev).float()
    q0 = (lkv - lq) if q_offset is None else int(q_offset)
    qpos = torch.arange(lq, dtype=torch.int64, device=dev) + q0
    kpos = torch.arange(lkv, dtype=torch.int64, device=dev)
    if pos_encoding_mode == "ROPE_LLAMA":
        qf = rope_llama(qf, qpos, rope_scale, rope_theta)
        kf = rope_llama(kf, kpos, rope_scale, rope_theta)
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)
        vf = vf.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale  # [Hq, Lq, Lkv]
    if logits_soft_cap is not None and logits_soft_cap > 0:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    if alibi or pos_encoding_mode == "ALIBI":
        rel = (kpos[None, :] - qpos[:, None]).float()
        s = s + alibi_slopes(hq).to(dev)[:, None, None] * rel[None]
    keep = torch.ones(lq, lkv, dtype=torch.bool, device=dev)
    if causal:
        keep &= kpos[None, :] <= qpos[:, None]
    if window_left is not None and window_left >= 0:
        keep &= kpos[None, :] >= qpos[:, None] - window_left
    if custom_mask is not None:
        keep &= custom_mask.to(dev).bool()
    s = s.masked_fill(~keep[None], float("-inf"))
    lse_e = torch.logsumexp(s, dim=-1)  # [Hq, Lq]; -inf for fully masked rows
    p = torch.exp(s - torch.where(torch.isinf(lse_e), torch.zeros_like(lse_e), lse_e)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, vf)
    if v_scale is not None:
        out = out * float(v_scale)
    out = out.to(dtype=q.dtype)
    if not return_lse:
        return out
    lse = (lse_e / math.log(2.0)).transpose(0, 1).contiguous()
    return out, lse


# ---- paged caches --------------------------------------------------------------------------

def paged_kv_halves(paged_kv_cache: PagedKVCache, kv_layout: str = "NHD"):
    """(k, v) as ``[P, page_size, H, D]`` views (any layout, tensor or tuple), no validation."""
    check_kv_layout(kv_layout)
    if isinstance(paged_kv_cache, torch.Tensor):
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    else:
        k, v = paged_kv_cache
    return to_nhd(k, kv_layout), to_nhd(v, kv_layout)


def gather_paged_kv(paged_kv_cache: PagedKVCache, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    kv_last_page_len: torch.Tensor, request: int, kv_layout: str = "NHD"):
    """K and V of one request as contiguous ``[L, H, D]`` tensors (cache dtype).

    Request ``i`` owns pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``; its last page holds
    ``kv_last_page_len[i]`` tokens.
    """
    k, v = paged_kv_halves(paged_kv_cache, kv_layout)
    lo, hi = int(kv_indptr[request]), int(kv_indptr[request + 1])
    pages = kv_indices[lo:hi].long().to(k.device)
    n = hi - lo
    if n == 0:
        return k[:0, 0], v[:0, 0]
    length = (n - 1) * k.shape[1] + int(kv_last_page_len[request])
    kk = k[pages].reshape(-1, k.shape[2], k.shape[3])[:length]
    vv = v[pages].reshape(-1, v.shape[2], v.shape[3])[:length]
    return kk.contiguous(), vv.contiguous()


def batch_decode_reference(q: torch.Tensor, paged_kv_cache: PagedKVCache, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                           kv_layout: str = "NHD", return_lse: bool = False, **kw):
    """Batch decode over a paged cache: ``q [B, Hq, D]`` -> out ``[B, Hq, D]`` (+ lse ``[B, Hq]``).
    ``kw`` are :func:`attention_reference`'s options."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        kk, vv = gather_paged_kv(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, b, kv_layout)
        o, s = attention_reference(q[b:b + 1], kk, vv, return_lse=True, **kw)
        outs.append(o)
        lses.append(s)
    out = torch.cat(outs, 0) if outs else q.new_empty(q.shape)
    if not return_lse:
        return out
    lse = torch.cat(lses, 0) if lses else torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return out, lse


def merge_state_reference(v_a, s_a, v_b, s_b):
    """Merge two partial attention states (base-2 LSE): ``v [.., H, D]``, ``s [.., H]``."""
    sa, sb = s_a.float(), s_b.float()
    m = torch.maximum(sa, sb)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp2(sa - m), torch.exp2(sb - m)
    tot = wa + wb
    den = torch.where(tot > 0, tot, torch.ones_like(tot))
    v = (v_a.float() * wa[..., None] + v_b.float() * wb[..., None]) / den[..., None]
    s = m + torch.log2(tot)
    return v.to(v_a.dtype), s


def merge_states_reference(v, s):
    """Merge ``N`` states: ``v [L, N, H, D]``, ``s [L, N, H]`` -> ``([L, H, D], [L, H])``."""
    if s.shape[1] == 0:  # no states: nothing attended, as the kernel writes it (0 and -inf)
        return (v.new_zeros((v.shape[0],) + tuple(v.shape[2:])),
                torch.full(s.shape[:1] + s.shape[2:], -math.inf, dtype=torch.float32, device=s.device))
    sf = s.float()
    m = sf.max(dim=1).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(sf - m[:, None])
    tot = w.sum(1)
    den = torch.where(tot > 0, tot, torch.ones_like(tot))
    out = (v.float() * w[..., None]).sum(1) / den[..., None]
    return out.to(v.dtype), m + torch.log2(tot)
