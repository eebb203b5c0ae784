#!/usr/bin/env python3
"""Host time per eager call of the small GEMM ops next to torch's, on the GPU machine.

The problems are small enough that the GPU finishes each call before the host issues the next, so
an eager loop's time per call is the host's: validation, dispatch and the launch. Prints one line
per op (min over 5 loops of 2000 calls) and writes $OUT/probe_host_gemm.json (or /tmp).

    python3 tools/gemm_host_time.py
"""

from __future__ import annotations

import json
import os
import time

import torch

DEV = "cuda"


def host_us(results: dict, name: str, fn, n: int = 2000) -> None:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    results[name] = best
    print(f"{name:55s} {best:7.2f} us/call", flush=True)


def main() -> int:
    from fi_gemm import SegmentGEMMWrapper, bmm_fp8, gemm_fp8_nt_groupwise, mm_bf16  # noqa: PLC0415
    from fi_gemm.fp8.quant import quantize_fp8_block, quantize_fp8_per_token_group  # noqa: PLC0415

    res: dict = {}
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    x = torch.randn(16, 4096, device=DEV, dtype=bf16)
    w = torch.randn(4096, 4096, device=DEV, dtype=bf16)
    o = torch.empty(16, 4096, device=DEV, dtype=bf16)
    host_us(res, "torch.mm bf16 M=16 (x @ w.T)", lambda: x @ w.T)
    host_us(res, "mm_bf16 M=16", lambda: mm_bf16(x, w.T))
    host_us(res, "mm_bf16 M=16 out= (the checked path)", lambda: mm_bf16(x, w.T, out=o))
    A = torch.randn(1, 16, 4096, device=DEV).to(e4m3)
    B = torch.randn(1, 4096, 4096, device=DEV).to(e4m3).transpose(-2, -1)
    one = torch.tensor(1.0, device=DEV)
    host_us(res, "bmm_fp8 M=16", lambda: bmm_fp8(A, B, one, one, bf16))
    host_us(res, "torch._scaled_mm per-tensor M=16", lambda: torch._scaled_mm(A[0], B[0], one, one, out_dtype=bf16))
    for m in (16, 128):
        a, sa = quantize_fp8_per_token_group(torch.randn(m, 4096, device=DEV), scale_major_mode="MN")
        b, sb = quantize_fp8_block(torch.randn(4096, 4096, device=DEV), scale_major_mode="MN")
        sa_k, sb_k, sb_torch = sa.T.contiguous(), sb.T.contiguous(), sb.T.contiguous().T
        ops = {f"gemm_fp8_nt_groupwise M={m} MN": (gemm_fp8_nt_groupwise, (a, b, sa, sb), {"scale_major_mode": "MN"}),
               f"gemm_fp8_nt_groupwise M={m} K": (gemm_fp8_nt_groupwise, (a, b, sa_k, sb_k), {"scale_major_mode": "K"}),
               f"torch._scaled_mm blockwise M={m}": (torch._scaled_mm, (a, b.T, sa.T, sb_torch), {"out_dtype": bf16})}
        for name, (fn, args, kw) in ops.items():
            host_us(res, name, lambda fn=fn, args=args, kw=kw: fn(*args, **kw))
    seg = SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8, device=DEV))
    xs = torch.randn(8 * 16, 4096, device=DEV, dtype=bf16)
    ws = torch.randn(8, 16, 4096, device=DEV, dtype=bf16)
    indptr = torch.arange(9, device=DEV, dtype=torch.int64) * 16
    host_us(res, "SegmentGEMMWrapper.run 8 x 16 (seg_indptr)", lambda: seg.run(xs, ws, 8, True, seg_indptr=indptr))
    host_us(res, "torch.bmm 8 x 16", lambda: torch.bmm(xs.view(8, 16, 4096), ws.transpose(1, 2)))
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "probe_host_gemm.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
