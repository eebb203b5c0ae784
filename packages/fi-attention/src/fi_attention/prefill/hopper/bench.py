"""Benchmark of the Hopper fa3 prefill kernel (``run_ragged``) against torch SDPA in the same run.

Registered as routine ``single_prefill_fa3`` (``fi_attention/bench.py`` must import this module);
also runnable alone: ``python3 -m fi_attention.prefill.hopper.bench [--quick]``.
Configs follow shared/TARGETS.md: causal single prefill, GQA 32/8, head_dim 128, bf16.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from fi_core import testing
from fi_core.bench import BenchRow, RoutineArgs, format_table, rotating_inputs, routine, time_fn

from . import run_ragged

# (L, causal, target TFLOP/s from TARGETS.md or None)
CONFIGS = ((4096, True, 570.0), (16384, True, 640.0), (4096, False, None), (8192, True, None))
HQ, HKV, D = 32, 8, 128


def attention_flops(lq: int, lkv: int, hq: int, d: int, causal: bool) -> float:
    """2 GEMMs x 2 flops per MAC; causal counts half of the square (TARGETS.md convention)."""
    full = 4.0 * lq * lkv * hq * d
    return full / 2 if causal else full


def _sdpa(q, k, v, causal):
    # [L, H, D] views as [H, L, D]; SDPA picks its fastest backend (flash / cuDNN / efficient).
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=causal, enable_gqa=True)
    return o.transpose(0, 1)


@routine("single_prefill_fa3", family="fi-attention",
         help="fa3 (Hopper) single prefill, GQA 32/8, d 128, bf16 vs torch SDPA")
def single_prefill_fa3(args: RoutineArgs):
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    configs = CONFIGS[:1] if args.quick else CONFIGS
    for L, causal, target_tflops in configs:
        def make(i, L=L):
            q = testing.randn((L, HQ, D), dtype, dev, seed=3 * i)
            k = testing.randn((L, HKV, D), dtype, dev, seed=3 * i + 1)
            v = testing.randn((L, HKV, D), dtype, dev, seed=3 * i + 2)
            return q, k, v, torch.empty_like(q)

        sets = rotating_inputs(make, dev, max_sets=4)
        scale = D ** -0.5

        def ours(q, k, v, out, causal=causal, L=L):
            run_ragged(q, k, v, None, None, out, None, causal=causal, sm_scale=scale,
                       max_qo_len=L, batch_size=1)

        # Correctness first: against SDPA (an fp32 reference at this size would take minutes on
        # the CPU); both are bf16 results of the same math, so they agree to ~1e-2 relative.
        q, k, v, out = sets[0]
        ours(q, k, v, out)
        err = testing.rel_error(out, _sdpa(q, k, v, causal))
        if not err < 2e-2:
            raise AssertionError(f"fa3 L={L} causal={causal}: rel. error vs SDPA {err:.3e}")

        reps = 10 if L >= 16384 else 30
        t_ours = time_fn(ours, sets, reps=reps, min_calls_per_replay=4)
        t_base = time_fn(lambda q, k, v, out, causal=causal: _sdpa(q, k, v, causal), sets,
                         reps=reps, min_calls_per_replay=4)
        flops = attention_flops(L, L, HQ, D, causal)
        target_us = flops / (target_tflops * 1e12) * 1e6 if target_tflops else None
        yield BenchRow("single_prefill_fa3", f"L={L} {'causal' if causal else 'full'} GQA {HQ}/{HKV} d{D} bf16",
                       t_ours, flops=flops, baseline=("torch SDPA", t_base), target_us=target_us,
                       backend="fa3", extra={"rel_err_vs_sdpa": err})


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    rows = [r.metrics(torch.cuda.get_device_name()) for r in
            single_prefill_fa3(RoutineArgs(quick="--quick" in argv))]
    print(format_table(rows))


if __name__ == "__main__":
    main()
