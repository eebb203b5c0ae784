#!/usr/bin/env python3
"""Time fi-gemm's M > 16 units of Ampere / Ada on whatever GPU this runs on: the CUTLASS 2.x unit
(gemm_sm80.cu: mm_bf16, bmm_fp8) beside the unit the default dispatch picks there and torch
(cuBLAS / _scaled_mm), and the block-scaled mma.sync unit (gemm_blockwise_sm89.cu:
gemm_fp8_nt_groupwise) beside the default unit and the fp32 reference.

    python3 tools/ampere_ada_units_on_h200.py [--json PATH]

On the H200 this is sm_80 / sm_89 code on an sm_90 GPU (no TMA, no wgmma; fp8 mma.sync is
emulated by ptxas), so the numbers say how far the portable units are from the Hopper ones, not
how they run on an A100 or L40S. CUDA graphs over input sets of >= 3x L2 (fi_core.bench.time_fn).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fi_core import testing
from fi_core.bench import rotating_inputs, time_fn
from fi_gemm import (bmm_fp8, gemm_fp8_nt_groupwise, mm_bf16, quantize_fp8_block,
                     quantize_fp8_per_token_group)

SHAPES = [(4096, 4096, 4096), (128, 14336, 4096), (8192, 8192, 8192)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    rows = []
    for m, n, k in SHAPES:
        flop = 2.0 * m * n * k

        def make(i, m=m, n=n, k=k):
            return (testing.randn((m, k), bf16, dev, seed=2 * i),
                    testing.randn((n, k), bf16, dev, seed=2 * i + 1, scale=k ** -0.5))
        sets = rotating_inputs(make, dev)
        row = {"dtype": "bf16", "m": m, "n": n, "k": k}
        for name, fn in (("cutlass_sm80", lambda a, w: mm_bf16(a, w.T, backend="cutlass_sm80")),
                         ("auto", lambda a, w: mm_bf16(a, w.T)),
                         ("torch", lambda a, w: torch.matmul(a, w.T))):
            t = time_fn(fn, sets)
            row[name] = {"us": t.median_us, "tflops": flop / t.median_us / 1e6}
        rows.append(row)

        def make8(i, m=m, n=n, k=k):
            return (testing.randn((m, k), torch.float32, dev, seed=2 * i).to(e4m3),
                    testing.randn((n, k), torch.float32, dev, seed=2 * i + 1).to(e4m3))
        sa = torch.tensor([0.5], device=dev)
        sb = torch.tensor([k ** -0.5], device=dev)
        sets8 = rotating_inputs(make8, dev)
        row8 = {"dtype": "e4m3", "m": m, "n": n, "k": k}
        for name, fn in (
                ("cutlass_sm80", lambda a, w, sa=sa, sb=sb: bmm_fp8(a[None], w.T[None], sa, sb, bf16,
                                                                    backend="cutlass_sm80")),
                ("auto", lambda a, w, sa=sa, sb=sb: bmm_fp8(a[None], w.T[None], sa, sb, bf16)),
                ("torch", lambda a, w, sa=sa, sb=sb: torch._scaled_mm(a, w.T, sa, sb, out_dtype=bf16))):
            t = time_fn(fn, sets8)
            row8[name] = {"us": t.median_us, "tflops": flop / t.median_us / 1e6}
        rows.append(row8)
    for m, n, k in ((4096, 4096, 4096), (4095, 4096, 4096), (8192, 8192, 8192)):
        flop = 2.0 * m * n * k

        def makeg(i, m=m, n=n, k=k):
            a, sa = quantize_fp8_per_token_group(testing.randn((m, k), torch.float32, dev, seed=2 * i),
                                                 scale_major_mode="MN")
            b, sb = quantize_fp8_block(testing.randn((n, k), torch.float32, dev, seed=2 * i + 1),
                                       scale_major_mode="MN")
            return a, b, sa, sb
        setsg = rotating_inputs(makeg, dev)
        rowg = {"dtype": "groupwise", "m": m, "n": n, "k": k}
        for name, be in (("mma_sm89", "mma_sm89"), ("auto", "auto"), ("reference", "reference")):
            if name == "reference" and m > 4096:
                continue  # the fp32 reference at 8192^3 takes seconds per call
            t = time_fn(lambda a, b, sa, sb, be=be: gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="MN",
                                                                          backend=be), setsg)
            rowg[name] = {"us": t.median_us, "tflops": flop / t.median_us / 1e6}
        rows.append(rowg)
    for r in rows:
        print(f"{r['dtype']:5} {r['m']:>5} x {r['n']:>5} x {r['k']:>5}  " + "  ".join(
            f"{b} {r[b]['us']:9.2f} us {r[b]['tflops']:7.1f} TFLOP/s"
            for b in ("cutlass_sm80", "mma_sm89", "auto", "torch", "reference") if b in r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "note": __doc__.strip().splitlines()[-1],
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
