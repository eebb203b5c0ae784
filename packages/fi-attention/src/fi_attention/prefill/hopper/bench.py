"""Benchmark of the Hopper fa3 prefill kernel (``run_ragged``) against torch SDPA in the same run.

Registered as routines ``single_prefill_fa3`` and ``batch_prefill_paged_fa3``
(``fi_attention/bench.py`` must import this module);
also runnable alone: ``python3 -m fi_attention.prefill.hopper.bench [--quick]``.
Configs follow shared/TARGETS.md: causal single prefill, GQA 32/8, head_dim 128, bf16. Rows
marked "[1 CTA per tile]" time the same kernel with FI_FA3_CTAS=all (non-persistent launch)
against the default persistent launch.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from fi_core import knobs, testing
from fi_core.bench import (BenchRow, RoutineArgs, apply_tuning, format_table, measure_ceilings,
                           rotating_inputs, routine, time_fn)

from . import run_paged, run_ragged
from . import spec as hopper_spec

# (L, causal, target TFLOP/s from TARGETS.md or None)
CONFIGS = ((4096, True, 570.0), (16384, True, 640.0), (4096, False, None), (8192, True, None))
HQ, HKV, D = 32, 8, 128


def attention_flops(lq: int, lkv: int, hq: int, d: int, causal: bool) -> float:
    """2 GEMMs x 2 flops per MAC; causal counts half of the square (TARGETS.md convention)."""
    full = 4.0 * lq * lkv * hq * d
    return full / 2 if causal else full


def _sdpa_bhld(q, k, v, causal):
    """SDPA on 4-D [B, H, L, D] views, restricted to the cuDNN / flash backends.

    Unrestricted, 3-D [H, L, D] inputs with enable_gqa fell back to the math backend (13 ms at
    L=4096 instead of ~0.27 ms); this is the same call as the ``single_prefill`` routine's.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _sdpa(q, k, v, causal):
    # [L, H, D] -> [1, H, L, D] views (no copies), result back as [L, H, D].
    o = _sdpa_bhld(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal)
    return o[0].transpose(0, 1)


def _fa3_ctas(value):
    """The FI_FA3_CTAS knob (read by the runner at each launch) set inside a with-block."""
    return knobs.override(FI_FA3_CTAS=None if value is None else str(value))


def _one_cta_per_tile_row(name, config, fn, sets, reps, flops, t_persistent):
    """A/B row: the same kernel launched with one CTA per work tile (FI_FA3_CTAS=all), with the
    default persistent launch as its baseline, to show what the persistent scheduler buys."""
    with _fa3_ctas("all"):
        t = time_fn(fn, sets, reps=reps, min_calls_per_replay=4)
    return BenchRow(name, config + " [1 CTA per tile]", t, flops=flops,
                    baseline=("fa3 persistent (default)", t_persistent), backend="fa3", ceiling="gemm16")


@routine("single_prefill_fa3", family="fi-attention",
         help="fa3 (Hopper) single prefill, GQA 32/8, d 128, bf16 vs torch SDPA")
def single_prefill_fa3(args: RoutineArgs):
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    # A/B: variant=N builds the kernel with FI_FA3_VARIANT=N (see hopper/spec.py).
    suffix = apply_tuning(args, hopper_spec, {"variant": "VARIANT"}, hopper_spec.prefill_sm90_spec)
    configs = CONFIGS[:1] if args.quick else CONFIGS
    for L, causal, target_tflops in configs:
        def make(i, L=L):
            q = testing.randn((L, HQ, D), dtype, dev, seed=3 * i)
            k = testing.randn((L, HKV, D), dtype, dev, seed=3 * i + 1)
            v = testing.randn((L, HKV, D), dtype, dev, seed=3 * i + 2)
            return q, k, v, torch.empty_like(q)

        sets = rotating_inputs(make, dev, max_sets=4)
        scale = D ** -0.5

        def ours(q, k, v, out, causal=causal, L=L, scale=scale):
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
        config = f"L={L} {'causal' if causal else 'full'} GQA {HQ}/{HKV} d{D} bf16{suffix}"
        yield BenchRow("single_prefill_fa3", config,
                       t_ours, flops=flops, baseline=("torch SDPA", t_base), target_us=target_us,
                       backend="fa3", extra={"rel_err_vs_sdpa": err}, ceiling="gemm16")
        if L == 4096 and causal and not args.quick:
            yield _one_cta_per_tile_row("single_prefill_fa3", config, ours, sets, reps, flops, t_ours)


@routine("batch_prefill_paged_fa3", family="fi-attention",
         help="fa3 (Hopper) paged batch prefill 16 x 2048, page 16, GQA 32/8, d 128, bf16 vs SDPA")
def batch_prefill_paged_fa3(args: RoutineArgs):
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    suffix = apply_tuning(args, hopper_spec, {"variant": "VARIANT"}, hopper_spec.prefill_sm90_spec)
    batch, L, page = (4, 2048, 16) if args.quick else (16, 2048, 16)
    pages_per = L // page
    total_pages = batch * pages_per
    scale = D ** -0.5
    i32 = dict(dtype=torch.int32, device=dev)

    def make(i):
        q = testing.randn((batch * L, HQ, D), dtype, dev, seed=5 * i)
        cache = testing.randn((total_pages, 2, page, HKV, D), dtype, dev, seed=5 * i + 1)  # NHD
        # Shuffled page ids, as in a real cache after some churn.
        indices = torch.randperm(total_pages, generator=testing.generator(i)).to(**i32)
        return q, cache, indices, torch.empty_like(q)

    sets = rotating_inputs(make, dev, max_sets=4)
    qo_indptr = torch.arange(0, batch + 1, **i32) * L
    kv_indptr = torch.arange(0, batch + 1, **i32) * pages_per
    last = torch.full((batch,), page, **i32)

    def ours(q, cache, indices, out):
        k, v = cache[:, 0], cache[:, 1]
        run_paged(q, k, v, qo_indptr, kv_indptr, indices, last, out, None,
                  k_strides=(k.stride(0), k.stride(1), k.stride(2)),
                  v_strides=(v.stride(0), v.stride(1), v.stride(2)), page_size=page, causal=True,
                  sm_scale=scale, max_qo_len=L, batch_size=batch, num_kv_heads=HKV)

    def gathered(cache, indices):
        # [B, H, L, D] contiguous K/V per request: the best case for the dense baseline.
        kv = cache[indices.long()].view(batch, pages_per, 2, page, HKV, D)
        kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, HKV, L, D)
        return kv[0].contiguous(), kv[1].contiguous()

    base_sets = []
    for q, cache, indices, _out in sets:
        k, v = gathered(cache, indices)
        base_sets.append((q.view(batch, L, HQ, D).transpose(1, 2), k, v))

    def base(qb, k, v):
        return _sdpa_bhld(qb, k, v, True)

    q, cache, indices, out = sets[0]
    ours(q, cache, indices, out)
    ref = base(*base_sets[0]).transpose(1, 2).reshape(batch * L, HQ, D)
    err = testing.rel_error(out, ref)
    if not err < 2e-2:
        raise AssertionError(f"fa3 paged batch: rel. error vs SDPA {err:.3e}")
    t_ours = time_fn(ours, sets, reps=20, min_calls_per_replay=4)
    t_base = time_fn(base, base_sets, reps=20, min_calls_per_replay=4)
    flops = batch * attention_flops(L, L, HQ, D, True)
    config = f"{batch} x {L} causal page {page} GQA {HQ}/{HKV} d{D} bf16{suffix}"
    yield BenchRow("batch_prefill_paged_fa3", config,
                   t_ours, flops=flops, baseline=("torch SDPA (contiguous KV)", t_base),
                   target_us=flops / 560e12 * 1e6 if batch == 16 else None, backend="fa3",
                   extra={"rel_err_vs_sdpa": err}, ceiling="gemm16")
    if not args.quick:
        yield _one_cta_per_tile_row("batch_prefill_paged_fa3", config, ours, sets, 20, flops, t_ours)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = RoutineArgs(quick="--quick" in argv)
    rows = [*single_prefill_fa3(a), *batch_prefill_paged_fa3(a)]
    ceilings = measure_ceilings(rows, a)
    print(format_table([r.metrics(torch.cuda.get_device_name(), ceilings) for r in rows]))


if __name__ == "__main__":
    main()
