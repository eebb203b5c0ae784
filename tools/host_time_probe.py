#!/usr/bin/env python3
"""Host time per call of decode run() and of a few small ops, on the GPU machine, as JSON.

The tree measured is the one on PYTHONPATH, so two trees are compared by running this once per
tree in alternating processes (the lent hosts' speed drifts between processes):

    for t in base this base this; do PYTHONPATH=<tree $t's packages/*/src> \
        python3 tools/host_time_probe.py $OUT/$t.json; done

Decode rows come from fi_attention.bench_decode._host_times (run() on a 1 x 512 batch). The other
problems are tiny, so the GPU finishes each call before the host issues the next and the loop's
time per call is the host's; "torch add" is the host-speed probe of the same process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_host_time  # noqa: E402  (its host_us loop)


def main() -> int:
    from fi_attention.bench_decode import _host_times  # noqa: PLC0415
    from fi_gemm import gemm_fp8_nt_groupwise, mm_bf16  # noqa: PLC0415
    from fi_gemm.fp8.quant import quantize_fp8_block, quantize_fp8_per_token_group  # noqa: PLC0415
    from fi_sampling import rmsnorm, silu_and_mul  # noqa: PLC0415

    res = {"decode": _host_times(torch.device("cuda", 0))}
    print(json.dumps(res["decode"]), flush=True)
    ops: dict = {}
    bf16, dev = torch.bfloat16, "cuda"
    x, w = torch.randn(1, 256, device=dev, dtype=bf16), torch.randn(256, 256, device=dev, dtype=bf16)
    gemm_host_time.host_us(ops, "mm_bf16 1x256x256 (launch path)", lambda: mm_bf16(x, w.T))
    a, sa = quantize_fp8_per_token_group(torch.randn(1, 256, device=dev), scale_major_mode="MN")
    b, sb = quantize_fp8_block(torch.randn(256, 256, device=dev), scale_major_mode="MN")
    gemm_host_time.host_us(ops, "gemm_fp8_nt_groupwise 1x256x256 MN",
                           lambda: gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="MN"))
    xn, wn = torch.randn(1, 256, device=dev, dtype=bf16), torch.randn(256, device=dev, dtype=bf16)
    gemm_host_time.host_us(ops, "rmsnorm 1 x 256", lambda: rmsnorm(xn, wn))
    xa = torch.randn(1, 512, device=dev, dtype=bf16)
    gemm_host_time.host_us(ops, "silu_and_mul 1 x 256", lambda: silu_and_mul(xa))
    gemm_host_time.host_us(ops, "torch add (host-speed probe)", lambda: xn + xn)
    res["ops"] = ops
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
