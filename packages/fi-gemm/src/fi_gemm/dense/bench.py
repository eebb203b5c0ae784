"""Benchmark routines for the dense GEMMs (``flashinfer bench --routine mm_bf16|bmm_fp8``).

Each config checks our result against the fp32 reference first, then times ours and the torch
baseline (cuBLAS through torch.matmul / torch._scaled_mm) in the same run on L2-rotated inputs.
Targets: shared/TARGETS.md (GEMM table).

A/B of the fp8 large-class unit: ``--option fp8_large=NAME`` (a key of ``spec.CONFIGS_FP8``) runs
the M > 256 rows with that unit, ``fp8_large=large+t128x128_c2x1`` runs them once per name in
the same process on the same inputs, the baseline re-timed next to each; those rows' config gets a
`` [fp8_large=NAME]`` suffix.
"""

from __future__ import annotations

import torch

from fi_core import testing
from fi_core.bench import (BenchRow, RoutineArgs, apply_tuning, checked, config_choices, rotating_inputs,
                           routine, time_fn, with_config)

from . import api as dense_api
from . import spec as dense_spec
from .api import bmm_fp8, mm_bf16
from .reference import gemm_reference

# (M, N, K, target_us or None). None: the target is a ratio to the baseline (>= 0.95x cuBLAS).
MM_CONFIGS = [
    (8192, 8192, 8192, None), (4096, 4096, 4096, None), (128, 14336, 4096, 42.0),
    (1, 4096, 4096, 11.0), (4, 4096, 4096, 11.0), (16, 4096, 4096, 11.0),
]
FP8_CONFIGS = [(8192, 8192, 8192, None), (16, 4096, 4096, 8.0), (1, 4096, 4096, None)]


def _check(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    testing.assert_close(got, ref, dtype=got.dtype, msg=f"{what}: ")


def _check_fp8(a, w, sa, sb, ref, what: str) -> None:
    _check(bmm_fp8(a[None], w.T[None], sa, sb, torch.bfloat16)[0], ref, what)


@routine("mm_bf16", family="fi-gemm", help="bf16 GEMM A[M,K] x W[N,K]^T vs torch.matmul (cuBLAS)")
def mm_bf16_routine(args: RoutineArgs):
    dev = args.device
    configs = MM_CONFIGS[2:] if args.quick else MM_CONFIGS
    # A/B of the weight-streaming kernel: u8=N (spec.GEMV_U8) builds it with that many K steps in
    # flight for M <= 8, m16=N (spec.GEMV_M16) picks its M = 9..16 unit; only the M <= 16 rows run
    # then, labelled with the suffix.
    gemv_tuning = apply_tuning(args, dense_spec, {"u8": "GEMV_U8", "m16": "GEMV_M16"}, dense_spec.gemv_spec)
    if gemv_tuning:
        dense_api.reset_dispatch()  # the dispatch memos hold the default unit's module
        configs = [c for c in configs if c[0] <= 16]
    for m, n, k, target in configs:
        def make(i, m=m, n=n, k=k):
            a = testing.randn((m, k), torch.bfloat16, dev, seed=2 * i)
            w = testing.randn((n, k), torch.bfloat16, dev, seed=2 * i + 1, scale=k ** -0.5)
            return a, w
        sets = rotating_inputs(make, dev)
        a, w = sets[0]
        _check(mm_bf16(a, w.T), gemm_reference(a, w, torch.bfloat16), f"mm_bf16 {m}x{n}x{k}")
        ours = time_fn(lambda a, w: mm_bf16(a, w.T), sets)
        base = time_fn(lambda a, w: torch.matmul(a, w.T), sets)
        yield BenchRow("mm_bf16", f"M={m} N={n} K={k} bf16{gemv_tuning}", ours,
                       bytes=2.0 * (m * k + n * k + m * n), flops=2.0 * m * n * k,
                       baseline=("torch.matmul", base), target_us=target,
                       backend="gemv" if m <= 16 else "cutlass_sm90")


@routine("bmm_fp8", family="fi-gemm", help="fp8 e4m3 per-tensor GEMM vs torch._scaled_mm")
def bmm_fp8_routine(args: RoutineArgs):
    dev = args.device
    large = config_choices(args, "fp8_large", dense_spec.CONFIGS_FP8)
    sa = torch.tensor([0.5], device=dev)
    sb = torch.tensor([0.02], device=dev)
    for m, n, k, target in FP8_CONFIGS:
        def make(i, m=m, n=n, k=k):
            a = testing.randn((m, k), torch.float32, dev, seed=2 * i).to(torch.float8_e4m3fn)
            w = testing.randn((n, k), torch.float32, dev, seed=2 * i + 1).to(torch.float8_e4m3fn)
            return a, w
        sets = rotating_inputs(make, dev)
        a, w = sets[0]
        ref = gemm_reference(a, w, torch.bfloat16, None, sa, sb)
        is_large = dense_spec.shape_class(m, n) == "large"
        for suffix in with_config(dense_spec, "FP8_LARGE", "fp8_large", large if is_large else []):
            what = f"bmm_fp8 {m}x{n}x{k}{suffix}"
            if not checked(suffix and what, _check_fp8, a, w, sa, sb, ref, what):
                continue
            ours = time_fn(lambda a, w: bmm_fp8(a[None], w.T[None], sa, sb, torch.bfloat16), sets)
            base = time_fn(lambda a, w: torch._scaled_mm(a, w.T, sa, sb, out_dtype=torch.bfloat16),
                           sets)
            yield BenchRow("bmm_fp8", f"M={m} N={n} K={k} e4m3->bf16{suffix}", ours,
                           bytes=1.0 * (m * k + n * k) + 2.0 * m * n, flops=2.0 * m * n * k,
                           baseline=("torch._scaled_mm", base), target_us=target,
                           backend="gemv" if m <= 16 else "cutlass_sm90")
