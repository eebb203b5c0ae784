#!/usr/bin/env python3
"""Ops on a GPU that is not the current one: do they run there, fail clearly, or fault?

Needs two GPUs. Each case runs in its own process (a fault takes the CUDA context with it): the
tensors live on cuda:1 while cuda:0 stays the current device (no torch.cuda.set_device), the op
runs, and the result is compared with a torch computation on the same GPU. One line per case:
the exit code and the last lines of its output (the error, or the largest difference).

    python3 tools/other_gpu_probe.py [--cases rmsnorm,single_decode,batch_decode,merge_state]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

CASES = {
    "rmsnorm": """
        x = torch.randn(64, 4096, device=d, dtype=torch.bfloat16)
        w = torch.randn(4096, device=d, dtype=torch.bfloat16)
        out = flashinfer.norm.rmsnorm(x, w)
        ref = torch.nn.functional.rms_norm(x.float(), (4096,), w.float(), 1e-6)
        err = (out.float() - ref).abs().max().item()
    """,
    "single_decode": """
        q = torch.randn(32, 128, device=d, dtype=torch.bfloat16)
        k, v = torch.randn(2, 4096, 8, 128, device=d, dtype=torch.bfloat16)
        out = flashinfer.single_decode_with_kv_cache(q, k, v)
        kk, vv = (t.float().repeat_interleave(4, 1).transpose(0, 1) for t in (k, v))
        p = torch.softmax(q.float()[:, None] @ kk.transpose(1, 2) / 128 ** 0.5, -1)
        err = (out.float() - (p @ vv)[:, 0]).abs().max().item()
    """,
    "batch_decode": """
        B, L, P = 4, 2048, 16
        n = B * L // P
        cache = torch.randn(n, 2, P, 8, 128, device=d, dtype=torch.bfloat16)
        indptr = torch.arange(0, n + 1, L // P, dtype=torch.int32)
        idx = torch.randperm(n).int()
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=d))
        w.plan(indptr, idx, torch.full((B,), P, dtype=torch.int32), 32, 8, 128, P, q_data_type=torch.bfloat16)
        q = torch.randn(B, 32, 128, device=d, dtype=torch.bfloat16)
        out = w.run(q, cache)
        pages = [idx[b * L // P:(b + 1) * L // P].long().to(d) for b in range(B)]
        one = [flashinfer.single_decode_with_kv_cache(q[b], cache[pg, 0].reshape(L, 8, 128),
                                                      cache[pg, 1].reshape(L, 8, 128))
               for b, pg in enumerate(pages)]
        err = (out.float() - torch.stack(one).float()).abs().max().item()
    """,
    "merge_state": """
        va, vb = torch.randn(2, 1000, 32, 128, device=d, dtype=torch.bfloat16)
        sa, sb = torch.randn(2, 1000, 32, device=d)
        v, s = flashinfer.merge_state(va, sa, vb, sb)
        vr, _ = flashinfer.merge_state(va.cpu(), sa.cpu(), vb.cpu(), sb.cpu())
        err = (v.float().cpu() - vr.float()).abs().max().item()
    """,
}

PRELUDE = """
import torch, flashinfer
d = torch.device("cuda", 1)
assert torch.cuda.current_device() == 0
torch.manual_seed(0)
"""
EPILOGUE = """
torch.cuda.synchronize(1)
print(f"ran; max difference {err:.4g}; current device {torch.cuda.current_device()}")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    import torch  # noqa: PLC0415

    if torch.cuda.device_count() < 2:
        print(f"needs two GPUs, found {torch.cuda.device_count()}")
        return 2
    for name in args.cases.split(","):
        code = PRELUDE + textwrap.dedent(CASES[name]) + EPILOGUE
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        tail = (r.stdout + r.stderr).strip().splitlines()[-2:]
        print(f"{name}: rc={r.returncode} :: " + " || ".join(tail), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
