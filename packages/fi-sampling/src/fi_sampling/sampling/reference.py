"""Pure-torch references for the sampling ops: the exact filtered distributions (float64), a torch
sampler (the CPU backend), and softmax / renorm / mask references. Tests use these as the oracle.

Set definitions (shared with the kernels; ties at a threshold are always kept):

* top-k: token j is kept iff fewer than k tokens are strictly more probable: ``#{i: p_i > p_j} < k``
  (k <= 0 or k >= V keeps everything).
* top-p: token j is kept iff the mass strictly above it is below p: ``sum_{i: p_i > p_j} p_i < p``.
* min-p: token j is kept iff ``p_j >= min_p * max_i p_i``.
* joint top-k + top-p: both conditions on the original probabilities.
* top-k first: top-k, renormalise, then top-p on the renormalised probabilities.
"""

from __future__ import annotations

from typing import Optional

import torch

_MASK63 = (1 << 63) - 1


def _per_row(value, rows: int, dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", dtype).reshape(-1).expand(rows) if value.numel() == 1 \
            else value.detach().to("cpu", dtype).reshape(rows)
    return torch.full((rows,), value, dtype=dtype)


def top_k_mask(p: torch.Tensor, top_k) -> torch.Tensor:
    """Boolean [B, V]: kept by top-k (values may be probabilities or logits)."""
    p = p.double().cpu()
    b, v = p.shape
    k = _per_row(top_k, b, torch.int64)
    s = torch.sort(p, dim=-1, descending=True).values
    keep_all = (k <= 0) | (k >= v)
    kth = s.gather(1, (k.clamp(1, v) - 1).unsqueeze(1))
    return (p >= kth) | keep_all.unsqueeze(1)


def top_p_mask(p: torch.Tensor, top_p, device=None) -> torch.Tensor:
    """Boolean [B, V]: kept by top-p (mass strictly above the token < top_p).

    `device` (default: the CPU) is where the float64 sort runs; GPU tests pass ``"cuda"`` so
    that large batches (989 x 128256) stay fast. The result lives on that device.
    """
    p = p.double().to(device or "cpu")
    b, v = p.shape
    tp = _per_row(top_p, b, torch.float64).to(p.device)
    s = torch.sort(p, dim=-1, descending=True).values
    above = torch.cumsum(s, dim=-1) - s           # mass before position i in sorted order
    # mass strictly above value s_i = `above` at the first occurrence of that value; `above` is
    # non-decreasing, so the last position with above < p marks the threshold value.
    ok = above < tp.unsqueeze(1)
    last = ok.sum(dim=-1).clamp(min=1) - 1
    thr = s.gather(1, last.unsqueeze(1))
    return p >= thr


def min_p_mask(p: torch.Tensor, min_p) -> torch.Tensor:
    p = p.double().cpu()
    mp = _per_row(min_p, p.shape[0], torch.float64).clamp(0, 1)
    return p >= mp.unsqueeze(1) * p.max(dim=-1, keepdim=True).values


def _normalise(p: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    q = torch.where(keep & (p > 0), p, torch.zeros_like(p))
    s = q.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, q / torch.where(s > 0, s, torch.ones_like(s)), q)


def filtered_probs(probs: torch.Tensor, kind: str, top_k=None, top_p=None, min_p=None,
                   filter_apply_order: str = "top_k_first") -> torch.Tensor:
    """Exact filtered distribution (float64, CPU) of each row; ``kind`` is one of "plain",
    "top_k", "top_p", "min_p", "top_k_top_p"."""
    p = probs.double().cpu().clamp(min=0).nan_to_num(0.0)
    if kind == "plain":
        keep = torch.ones_like(p, dtype=torch.bool)
    elif kind == "top_k":
        keep = top_k_mask(p, top_k)
    elif kind == "top_p":
        keep = top_p_mask(p, top_p)
    elif kind == "min_p":
        keep = min_p_mask(p, min_p)
    elif kind == "top_k_top_p" and filter_apply_order == "joint":
        keep = top_k_mask(p, top_k) & top_p_mask(p, top_p)
    elif kind == "top_k_top_p":
        renormed = _normalise(p, top_k_mask(p, top_k))
        return _normalise(renormed, top_p_mask(renormed, top_p))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return _normalise(p, keep)


def sample(dist: torch.Tensor, indices: Optional[torch.Tensor], seed: int, offset: int) -> torch.Tensor:
    """Draw one token per output row from float64 distributions [B, V] with torch.multinomial,
    seeded from (seed, offset). Rows without mass give token 0. Returns int32 [B_out] (CPU)."""
    rows = dist if indices is None else dist[indices.long().cpu()]
    g = torch.Generator().manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(offset)) & _MASK63)
    has = rows.sum(dim=-1) > 0
    safe = torch.where(has.unsqueeze(1), rows, torch.ones_like(rows))
    out = torch.multinomial(safe, 1, generator=g).squeeze(1)
    return torch.where(has, out, torch.zeros_like(out)).to(torch.int32)


def softmax(logits: torch.Tensor, temperature=None) -> torch.Tensor:
    x = logits.double()
    if temperature is not None:
        t = _per_row(temperature, x.shape[0], torch.float64).to(x.device)
        x = x / t.unsqueeze(1)
    return torch.softmax(x, dim=-1).float()


def top_k_renorm_probs(probs: torch.Tensor, top_k) -> torch.Tensor:
    p = probs.double().cpu()
    return _normalise(p, top_k_mask(p, top_k)).float().to(probs.device)


def top_p_renorm_probs(probs: torch.Tensor, top_p) -> torch.Tensor:
    p = probs.double().cpu()
    return _normalise(p, top_p_mask(p, top_p)).float().to(probs.device)


def top_k_mask_logits(logits: torch.Tensor, top_k) -> torch.Tensor:
    x = logits.float().cpu()
    keep = top_k_mask(x, top_k)
    return torch.where(keep, x, torch.full_like(x, float("-inf"))).to(logits.device)


def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, seed: int, offset: int):
    """Speculative decoding acceptance (Leviathan et al.): draft token i is accepted with prob
    min(1, q_i / p_i); at the first rejection a token is drawn from norm(max(q - p, 0)); if all n
    are accepted, a bonus token is drawn from the last target row. Returns
    (output_token_ids [B, n+1] int32 padded with -1, accepted_num [B], emitted_num [B]).
    accepted_num counts the draft tokens that would be accepted independently at each position
    (FlashInfer's metric); emitted_num counts the draft tokens actually emitted."""
    g = torch.Generator().manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(offset)) & _MASK63)
    dp, tp = draft_probs.double().cpu(), target_probs.double().cpu()
    ids = draft_token_ids.long().cpu()
    b, n, _ = dp.shape
    out = torch.full((b, n + 1), -1, dtype=torch.int32)
    acc = torch.zeros(b, dtype=torch.int32)
    emi = torch.zeros(b, dtype=torch.int32)
    for r in range(b):
        u = torch.rand(n + 1, generator=g, dtype=torch.float64)
        stopped = False
        for i in range(n):
            t = ids[r, i]
            pd, pt = dp[r, i, t], tp[r, i, t]
            accept = bool(u[i] * pd < pt)
            if accept:
                acc[r] += 1
            if stopped:
                continue
            if accept:
                out[r, i] = int(t)
                emi[r] += 1
            else:
                resid = (tp[r, i] - dp[r, i]).clamp(min=0)
                if resid.sum() <= 0:
                    resid = tp[r, i].clone()
                out[r, i] = int(torch.multinomial(resid, 1, generator=g))
                stopped = True
        if not stopped:
            out[r, n] = int(torch.multinomial(tp[r, n], 1, generator=g))
    return out, acc, emi
