#!/usr/bin/env python3
"""One batch of fa2 (portable) prefill through the public ragged wrapper (5 requests of unequal
lengths, GQA 4/2, head_dim 128, causal, bf16) with inputs made on the CPU and a CPU reference, for
compute-sanitizer on the GPU machine (see tools/sanitize_fa3.py for why the reference is on the CPU):

    compute-sanitizer --tool racecheck --racecheck-report all python3 tools/sanitize_fa2.py
    compute-sanitizer --tool synccheck python3 tools/sanitize_fa2.py   # named-barrier use
    compute-sanitizer --tool memcheck --report-api-errors no python3 tools/sanitize_fa2.py [--paged]

--paged runs the same batch through the paged wrapper (page 16, NHD, pages of all requests
shuffled over the cache, partial last pages), which exercises the paged kernel's row-offset table.
--mask replaces causality by a random custom mask (packed bits; with odd kv lengths the rows
start mid-byte, and the last row's bits end inside the buffer's last byte). Run it with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that the packed mask is an allocation of its own and memcheck
sees a read past its end.

The planner spreads the requests over several work lists of unequal length, so a ping-pong build
(FI_FA2_PP) runs groups whose turn counts differ and a CTA whose second group has no work.
Exit status 0 when the result matches the reference (max abs error < 3e-2).
"""
import sys

import torch

from fi_attention.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

torch.manual_seed(0)
dev = "cuda"
HQ, HKV, D = 4, 2, 128
qo_lens = [300, 7, 1000, 129, 64]
kv_lens = [301, 100, 1203, 700, 67]  # odd lengths: mask rows start mid-byte
bf16 = torch.bfloat16


def ref(q, k, v, keep=None):
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(HQ // HKV, 1)) * D ** -0.5
    L, S = q.shape[0], k.shape[0]
    mask = torch.arange(S)[None, :] > torch.arange(L)[:, None] + (S - L) if keep is None else ~keep
    s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float().repeat_interleave(HQ // HKV, 1))


def indptr(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


qi, ki = indptr(qo_lens), indptr(kv_lens)
q = torch.randn(int(qi[-1]), HQ, D).to(bf16)
k = torch.randn(int(ki[-1]), HKV, D).to(bf16)
v = torch.randn(int(ki[-1]), HKV, D).to(bf16)
ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
paged = "--paged" in sys.argv[1:]
masks = [torch.rand(a, b) > 0.3 for a, b in zip(qo_lens, kv_lens)] if "--mask" in sys.argv[1:] else None
opts = dict(causal=True) if masks is None else dict(custom_mask=torch.cat([m.flatten() for m in masks]).to(dev))
if paged:
    PS = 16
    n_pages = [(n + PS - 1) // PS for n in kv_lens]
    perm = torch.randperm(sum(n_pages)).to(torch.int32)
    cache = torch.zeros(sum(n_pages), 2, PS, HKV, D, dtype=bf16)
    first = 0
    for b, n in enumerate(kv_lens):
        for t in range(n):
            page = perm[first + t // PS]
            cache[page, 0, t % PS] = k[ki[b] + t]
            cache[page, 1, t % PS] = v[ki[b] + t]
        first += n_pages[b]
    pi = indptr(n_pages)
    last = torch.tensor([n - (c - 1) * PS for n, c in zip(kv_lens, n_pages)], dtype=torch.int32)
    w = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    w.plan(qi.to(dev), pi.to(dev), perm.to(dev), last.to(dev), HQ, HKV, D, PS, q_data_type=bf16, **opts)
    got = w.run(q.to(dev), cache.to(dev)).cpu().float()
else:
    w = BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa2")
    w.plan(qi.to(dev), ki.to(dev), HQ, HKV, D, q_data_type=bf16, **opts)
    got = w.run(q.to(dev), k.to(dev), v.to(dev)).cpu().float()
err = 0.0
for b in range(len(qo_lens)):
    r = ref(q[qi[b]:qi[b + 1]], k[ki[b]:ki[b + 1]], v[ki[b]:ki[b + 1]], None if masks is None else masks[b])
    err = max(err, (got[qi[b]:qi[b + 1]] - r).abs().max().item())
what = ("paged" if paged else "ragged") + (" custom mask" if masks else "")
print(f"fa2 {what} d={D}: max abs err vs CPU reference {err:.3e}")
sys.exit(0 if err < 3e-2 else 1)
