"""Benchmark routines ``fp4_quantize`` and ``mm_fp4``.

``fp4_quantize``: the quantiser kernel against the same recipe as torch ops (fi's implementation
before the kernel), bf16 activations of a 4096-wide layer; bytes: the input read, the codes and
scales written.

``mm_fp4``: NVFP4 GEMM (e4m3 scales per 16, 128x4 layout) against
torch.matmul in bf16 on the dequantised operands (what a Hopper deployment runs without an FP4
path: bf16 weights). Both sides get the same values, prepared outside the timed call.

Bytes are the FP4 operands' (codes + scales) and the output. At M <= 16 that is what the FP4
weight-streaming kernel reads (plus the activations' bf16 copy, m x k x 4 bytes written and read);
above, the path also writes and reads bf16 copies of both operands (fi_gemm/fp4/api.py), which
the TB/s column does not count.
"""

from __future__ import annotations

import torch

from fi_core import testing
from fi_core.bench import BenchRow, RoutineArgs, rotating_inputs, routine, time_fn

from .api import mm_fp4
from .quant import fp4_quantize, fp4_quantize_reference
from .reference import dequantize_fp4, mm_fp4_reference

CONFIGS = [(1, 4096, 4096), (16, 4096, 4096), (128, 4096, 4096), (4096, 4096, 4096), (8192, 8192, 8192)]


def _check(a, b, sa, sb, alpha, ref, what: str) -> None:
    got = mm_fp4(a, b.T, sa, sb.T, alpha)
    k = 2 * a.shape[1]
    testing.assert_close(got.float() / k ** 0.5, ref / k ** 0.5, dtype=torch.bfloat16, msg=f"{what}: ")


@routine("mm_fp4", family="fi-gemm",
         help="NVFP4 GEMM (FP4 weight streaming at M<=16, dequantise + bf16 GEMM above) vs torch.matmul on bf16 copies")
def mm_fp4_routine(args: RoutineArgs):
    dev = args.device
    for m, n, k in CONFIGS[:2] if args.quick else CONFIGS:
        def make(i, m=m, n=n, k=k):
            x = testing.randn((m, k), torch.float32, dev, seed=2 * i)
            w = testing.randn((n, k), torch.float32, dev, seed=2 * i + 1)
            gx = (448 * 6 / x.abs().amax()).reshape(1)
            gw = (448 * 6 / w.abs().amax()).reshape(1)
            (a, sa), (b, sb) = fp4_quantize(x, gx), fp4_quantize(w, gw)
            alpha = (1 / (gx * gw)).float()
            xb = (dequantize_fp4(a, sa, 16, False, "128x4") * alpha).to(torch.bfloat16)
            wb = dequantize_fp4(b, sb, 16, False, "128x4").to(torch.bfloat16)
            return a, b, sa, sb, alpha, xb, wb
        sets = rotating_inputs(make, dev)
        a, b, sa, sb, alpha = sets[0][:5]
        ref = mm_fp4_reference(a, b, sa, sb, alpha, torch.float32, 16, False)
        _check(a, b, sa, sb, alpha, ref, f"mm_fp4 M={m}")
        ours = time_fn(lambda a, b, sa, sb, alpha, xb, wb: mm_fp4(a, b.T, sa, sb.T, alpha), sets)
        base = time_fn(lambda a, b, sa, sb, alpha, xb, wb: xb @ wb.T, sets)
        yield BenchRow("mm_fp4", f"M={m} N={n} K={k} nvfp4", ours,
                       bytes=(m + n) * k * (0.5 + 1 / 16) + 2.0 * m * n, flops=2.0 * m * n * k,
                       baseline=("torch.matmul bf16 (dequantised copies)", base),
                       backend="gemv_fp4" if m <= 16 else "dequant_bf16")


@routine("fp4_quantize", family="fi-gemm",
         help="NVFP4 / MXFP4 quantiser kernel (bf16 in) vs the same recipe as torch ops")
def fp4_quantize_routine(args: RoutineArgs):
    dev = args.device
    rows_list = (16, 4096) if args.quick else (1, 16, 128, 4096, 16384)
    k = 4096
    for fmt, block, ue8m0 in (("nvfp4", 16, False), ("mxfp4", 32, True)):
        for rows in rows_list:
            def make(i, rows=rows):
                x = testing.randn((rows, k), torch.bfloat16, dev, seed=i)
                return x, (448 * 6 / x.float().abs().amax()).reshape(1)
            sets = rotating_inputs(make, dev)
            x, gs = sets[0]
            got = fp4_quantize(x, gs, block, ue8m0)
            want = fp4_quantize_reference(x, gs.reshape(()), block, ue8m0, "128x4")
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                raise AssertionError(f"fp4_quantize {fmt} rows={rows}: the kernel's bytes differ from the recipe's")
            ours = time_fn(lambda x, gs, b=block, u=ue8m0: fp4_quantize(x, gs, b, u), sets)
            base = time_fn(lambda x, gs, b=block, u=ue8m0: fp4_quantize_reference(x, gs.reshape(()), b, u, "128x4"),
                           sets)
            yield BenchRow("fp4_quantize", f"rows={rows} K={k} {fmt} bf16", ours,
                           bytes=rows * k * (2 + 0.5 + 1 / block),
                           baseline=("the recipe as torch ops", base), backend="cuda")
