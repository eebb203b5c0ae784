#!/usr/bin/env python3
"""Name the kernels torch's baselines launch (cuBLAS / cuDNN / flash) and their device time, so a
gap to a baseline can be read against its tile configuration (cuBLAS kernel names carry the tile,
cluster and schedule). Runs on the GPU machine:

    python3 tools/torch_kernels.py [CASE ...]

Cases: scaled_mm (fp8 per-tensor 8192^3), mm_bf16 (8192^3), gemv4 / gemv16 (bf16 M=4/16,
N=K=4096), sdpa_decode_b1 (1 x 32768 GQA 32/8 on contiguous KV).
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile


def _cases():
    dev = "cuda"
    a8 = torch.randn(8192, 8192, device=dev).to(torch.float8_e4m3fn)
    b8 = torch.randn(8192, 8192, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    a16 = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    w16 = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    x4 = torch.randn(4, 4096, device=dev, dtype=torch.bfloat16)
    x16 = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 32768, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)  # its own tensor: K and V as one would fit half of the bytes in L2
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        "scaled_mm": lambda: torch._scaled_mm(a8, b8.T, one, one, out_dtype=torch.bfloat16),
        "mm_bf16": lambda: a16 @ a16.T,
        "gemv4": lambda: x4 @ w16.T,
        "gemv16": lambda: x16 @ w16.T,
        "sdpa_decode_b1": lambda: sdpa(q, k, v, enable_gqa=True),
    }


def main() -> int:
    cases = _cases()
    names = sys.argv[1:] or list(cases)
    for name in names:
        fn = cases[name]
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"== {name}")
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and e.count:
                print(f"  {e.device_time_total / e.count:9.1f} us x{e.count:<3d} {e.key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
