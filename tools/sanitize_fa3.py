#!/usr/bin/env python3
"""One fa3 prefill call (ragged or paged K/V; 2 requests of 100 / 300 tokens, GQA 4/2, head_dim
64, 128 or 256, causal, bf16 q, bf16 or fp8 e4m3 / e5m2 K/V, optional logits soft cap) with inputs
made on the CPU and a CPU reference, for compute-sanitizer on the GPU machine.

The GPU tests compare against torch on the GPU, whose cuBLAS kernels drown racecheck's report
(thousands of hazards in nvjet), and restricting racecheck to our kernel with --kernel-name made the
sanitizer fail ("Internal Sanitizer Error"). Here no other kernel uses shared memory:

    compute-sanitizer --tool racecheck --racecheck-report all python3 tools/sanitize_fa3.py ragged|paged [D [KV [CAP]]]
    FI_FA3_CTAS=3 compute-sanitizer ...   # 3 persistent CTAs: every CTA walks several tiles
    compute-sanitizer --tool memcheck --report-api-errors no python3 tools/sanitize_fa3.py paged

Exit status 0 when the result matches the reference (max abs error < 3e-2).
"""
import sys

import torch

from fi_attention.prefill import hopper as hop

torch.manual_seed(0)
dev = "cuda"
HQ, HKV = 4, 2
D = int(sys.argv[2]) if len(sys.argv) > 2 else 128
if D not in (64, 128, 256):
    raise SystemExit(f"head_dim: expected 64, 128 or 256, found {D}")
KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
kv_name = sys.argv[3] if len(sys.argv) > 3 else "bf16"
if kv_name not in KV_DTYPES:
    raise SystemExit(f"k/v dtype: expected one of {sorted(KV_DTYPES)}, found {kv_name!r}")
try:
    CAP = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0  # logits soft cap; 0 = none
except ValueError:
    CAP = float("nan")
if not CAP >= 0.0:
    raise SystemExit(f"soft cap: expected a number >= 0, found {sys.argv[4]!r}")
lens = [100, 300]
bf16 = torch.bfloat16


def ref(q, k, v, causal):
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(HQ // HKV, 1)) * D ** -0.5
    if CAP > 0:
        s = CAP * torch.tanh(s / CAP)
    if causal:
        L, S = q.shape[0], k.shape[0]
        mask = torch.arange(S)[None, :] > torch.arange(L)[:, None] + (S - L)
        s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float().repeat_interleave(HQ // HKV, 1))


mode = sys.argv[1] if len(sys.argv) > 1 else "ragged"
if mode not in ("ragged", "paged"):
    raise SystemExit(f"expected 'ragged' or 'paged', found {mode!r}")
tot = sum(lens)
q = torch.randn(tot, HQ, D).to(bf16)
k = torch.randn(tot, HKV, D).to(KV_DTYPES[kv_name])  # the reference reads the same (fp8) values
v = torch.randn(tot, HKV, D).to(KV_DTYPES[kv_name])
indptr = torch.tensor([0, lens[0], tot], dtype=torch.int32)
out = torch.empty(tot, HQ, D, dtype=bf16, device=dev)
if mode == "ragged":
    hop.run_ragged(q.to(dev), k.to(dev), v.to(dev), indptr.to(dev), indptr.to(dev), out, None, causal=True,
                   sm_scale=D ** -0.5, logits_soft_cap=CAP or None, max_qo_len=max(lens), batch_size=2)
else:
    page = 16
    pages_per = [-(-n // page) for n in lens]
    npages = sum(pages_per)
    cache = torch.zeros(npages, 2, page, HKV, D, dtype=k.dtype)
    perm = torch.randperm(npages)
    kv_indptr = torch.tensor([0, pages_per[0], npages], dtype=torch.int32)
    off = 0
    for b, n in enumerate(lens):
        for j in range(pages_per[b]):
            pid = perm[kv_indptr[b] + j]
            rows = slice(j * page, min(n, (j + 1) * page))
            m = rows.stop - rows.start
            cache[pid, 0, :m] = k[off + rows.start: off + rows.stop]
            cache[pid, 1, :m] = v[off + rows.start: off + rows.stop]
        off += n
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages_per)], dtype=torch.int32)
    c = cache.to(dev)
    kc, vc = c[:, 0], c[:, 1]
    hop.run_paged(q.to(dev), kc, vc, indptr.to(dev), kv_indptr.to(dev), perm.to(torch.int32).to(dev), last.to(dev),
                  out, None, k_strides=tuple(kc.stride()[:3]), v_strides=tuple(vc.stride()[:3]), page_size=page,
                  causal=True, sm_scale=D ** -0.5, logits_soft_cap=CAP or None, max_qo_len=max(lens), batch_size=2,
                  num_kv_heads=HKV)
got = out.cpu().float()
err = 0.0
o = 0
for n in lens:
    r = ref(q[o:o + n], k[o:o + n], v[o:o + n], True)
    err = max(err, (got[o:o + n] - r).abs().max().item())
    o += n
print(f"{mode} d={D} kv {kv_name} cap {CAP:g}: max abs err vs CPU reference {err:.3e}")
sys.exit(0 if err < 3e-2 else 1)
