"""Benchmark routine ``gemm_fp8_nt_groupwise``: DeepSeek-style block-scaled fp8 GEMM
(1 x 128 activation scales, 128 x 128 weight scales) against torch in the same run
(torch._scaled_mm with block-wise scales where this torch supports it, else dequantise + matmul;
both sides get their own scale layouts of the same values, prepared outside the timed call).

Shapes: N = K = 4096 for M <= 4096; the M = 8192 row is N = K = 8192, the shape class TARGETS.md's
M = 8192 figures (FlashInfer 976 us, torch 948 us) belong to (at N = K = 4096 they would mean
282 TFLOP/s, against ~1160 TFLOP/s measured at M = 4096).

A/B of the CUTLASS unit for M > 256: ``--option blockwise_large=NAME`` (a key of
``spec.BLOCKWISE_CONFIGS``), or several joined by '+', runs those rows once per name in the same
process on the same inputs, the baseline re-timed next to each; their config gets a
`` [blockwise_large=NAME]`` suffix."""

from __future__ import annotations

import torch

from fi_core import testing
from fi_core.bench import BenchRow, RoutineArgs, checked, config_choices, rotating_inputs, routine, time_fn, with_config

from . import spec as fp8_spec
from .groupwise import gemm_fp8_nt_groupwise
from .quant import quantize_fp8_block, quantize_fp8_per_token_group
from .reference import expand_scales, groupwise_reference

# (M, N, K, target_us): the best of FlashInfer and torch on the reference H200 (TARGETS.md).
CONFIGS = [(1, 4096, 4096, None), (16, 4096, 4096, 12.9), (128, 4096, 4096, 25.6),
           (4096, 4096, 4096, 117.0), (8192, 8192, 8192, 948.0)]


def _torch_scales(sa_mn, sb_mn):
    """torch._scaled_mm's block-wise scale layouts (torch 2.11 / cuBLAS on the H200) from ours in
    "MN" mode (sa_mn [kb, m], sb_mn [kb, nb], contiguous): scale_a [m, kb] M-major, i.e. the
    transposed view of sa_mn, and scale_b [kb, nb] K-major. Any other layout raises "Invalid
    scaling configuration" (probe in session 7: benchmarks/results/h200/probe_scaled_mm.txt)."""
    return sa_mn.T, sb_mn.T.contiguous().T


def _torch_baseline(a, b, ts_a, ts_b):
    """A callable ``fn(a, b, ts_a, ts_b)`` for torch's best block-scaled path (given
    _torch_scales' layouts), and its name."""
    try:
        fn = lambda a, b, sa, sb: torch._scaled_mm(a, b.T, sa, sb, out_dtype=torch.bfloat16)  # noqa: E731
        fn(a, b, ts_a, ts_b)
        return fn, "torch._scaled_mm (blockwise)"
    except Exception:  # torch builds without block-wise scaling: the dequantised product
        m, k = a.shape
        n = b.shape[0]

        def deq(a, b, sa, sb):
            af = (a.float() * expand_scales(sa, m, k, 1, 128)).to(torch.bfloat16)
            bf = (b.float() * expand_scales(sb.T, n, k, 128, 128)).to(torch.bfloat16)
            return af @ bf.T
        return deq, "dequantise + torch.matmul"


def _check(a, b, sa, sb, ref, what: str) -> None:
    got = gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="MN")
    k = a.shape[1]
    testing.assert_close(got.float() / k ** 0.5, ref / k ** 0.5, dtype=torch.bfloat16, msg=f"{what}: ")


@routine("gemm_fp8_nt_groupwise", family="fi-gemm",
         help="block-scaled fp8 GEMM (1x128 / 128x128) vs torch; N=K=4096 for M<=4096, "
              "N=K=8192 at M=8192")
def groupwise_routine(args: RoutineArgs):
    dev = args.device
    large = config_choices(args, "blockwise_large", fp8_spec.BLOCKWISE_CONFIGS)
    for m, n, k, target in CONFIGS[:3] if args.quick else CONFIGS:
        # Scales in "MN" mode ([kb, m], [kb, nb]): our kernels' native layout, so neither side's
        # timed call copies scales (torch gets its own layouts of the same values, _torch_scales).
        def make(i, m=m, n=n, k=k):
            a, sa = quantize_fp8_per_token_group(
                testing.randn((m, k), torch.float32, dev, seed=2 * i), scale_major_mode="MN")
            b, sb = quantize_fp8_block(
                testing.randn((n, k), torch.float32, dev, seed=2 * i + 1), scale_major_mode="MN")
            return (a, b, sa, sb, *_torch_scales(sa, sb))
        sets = rotating_inputs(make, dev)
        a, b, sa, sb, ts_a, ts_b = sets[0]
        ref = groupwise_reference(a, b, sa.T, sb.T, torch.float32)
        base_fn, base_name = _torch_baseline(a, b, ts_a, ts_b)
        names = large if fp8_spec.is_large(m) else []
        for suffix in with_config(fp8_spec, "BLOCKWISE_LARGE", "blockwise_large", names):
            what = f"gemm_fp8_nt_groupwise M={m}{suffix}"
            if not checked(suffix and what, _check, a, b, sa, sb, ref, what):
                continue
            ours = time_fn(lambda a, b, sa, sb, ts_a, ts_b: gemm_fp8_nt_groupwise(
                a, b, sa, sb, scale_major_mode="MN"), sets)
            base = time_fn(lambda a, b, sa, sb, ts_a, ts_b, fn=base_fn: fn(a, b, ts_a, ts_b), sets)
            yield BenchRow("gemm_fp8_nt_groupwise", f"M={m} N={n} K={k} e4m3 1x128/128x128{suffix}",
                           ours, bytes=1.0 * (m * k + n * k) + 2.0 * m * n, flops=2.0 * m * n * k,
                           baseline=(base_name, base), target_us=target,
                           backend="gemv" if m <= 16 else "cutlass_sm90")
