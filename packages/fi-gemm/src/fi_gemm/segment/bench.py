"""Benchmark routine ``segment_gemm``: LoRA shrink (4096 -> 16) over 8 equal segments, against
torch.bmm on the same data viewed as a batch (only possible because segments are equal)."""

from __future__ import annotations

import torch

from fi_core import testing
from fi_core.bench import BenchRow, RoutineArgs, apply_tuning, rotating_inputs, routine, time_fn

from ..dense import spec as dense_spec

from .api import SegmentGEMMWrapper
from .reference import segment_gemm_reference

# (segments, rows per segment, d_in, d_out, target_us = torch.bmm on the reference H200)
CONFIGS = [(8, 16, 4096, 16, 11.0), (8, 512, 4096, 16, 17.8)]


@routine("segment_gemm", family="fi-gemm", help="LoRA segment GEMM vs torch.bmm (equal segments)")
def segment_gemm_routine(args: RoutineArgs):
    dev = args.device
    # A/B of the kernel's N <= 16 unit: seg=N (dense spec.GEMV_SEG) builds the module with it.
    tuning = apply_tuning(args, dense_spec, {"seg": "GEMV_SEG"}, dense_spec.gemv_spec)
    seg = SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8, device=dev))
    for s, rows, d_in, d_out, target in CONFIGS:
        indptr = torch.arange(0, (s + 1) * rows, rows, device=dev)
        widx = torch.arange(s, device=dev)

        def make(i, s=s, rows=rows, d_in=d_in, d_out=d_out):
            x = testing.randn((s * rows, d_in), torch.bfloat16, dev, seed=2 * i)
            w = testing.randn((s, d_out, d_in), torch.bfloat16, dev, seed=2 * i + 1,
                              scale=d_in ** -0.5)
            return x, w
        sets = rotating_inputs(make, dev)
        x, w = sets[0]
        got = seg.run(x, w, s, True, seg_indptr=indptr, weight_indices=widx)
        ref = torch.empty_like(got)
        segment_gemm_reference(x, w, indptr, widx, ref)
        testing.assert_close(got, ref, dtype=torch.bfloat16, msg="segment_gemm: ")
        def ours_fn(x, w, s=s, indptr=indptr, widx=widx):
            return seg.run(x, w, s, True, seg_indptr=indptr, weight_indices=widx)

        def bmm_fn(x, w, s=s, rows=rows, d_in=d_in):
            return torch.bmm(x.view(s, rows, d_in), w.transpose(1, 2))
        ours = time_fn(ours_fn, sets)
        base = time_fn(bmm_fn, sets)
        yield BenchRow("segment_gemm", f"{s} segments x {rows} rows, {d_in} -> {d_out}{tuning}", ours,
                       bytes=2.0 * (s * rows * d_in + s * d_out * d_in + s * rows * d_out),
                       flops=2.0 * s * rows * d_in * d_out, baseline=("torch.bmm", base),
                       target_us=target, backend="gemv_segment")
