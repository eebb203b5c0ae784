"""Benchmark routines for decode: ``BatchDecodeWithPagedKVCacheWrapper`` (the TARGETS.md decode
table, fp8 included) and ``single_decode_with_kv_cache``, each with torch SDPA on pre-gathered
contiguous KV as the baseline in the same run (the gather is not timed), plus host-side run() and
plan() times in the rows' ``extra`` (plan() of the row's uniform batch and of a ragged batch of
the same size).

    python3 -m flashinfer bench --routine BatchDecodeWithPagedKVCacheWrapper
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from fi_core import testing
from fi_core.bench import (BenchRow, RoutineArgs, apply_tuning, rotating_inputs, routine, time_fn, time_host,
                           time_host_interleaved, time_host_stats)

from .decode import (BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
                     single_decode_with_kv_cache)
from .decode import spec as decode_spec_module
from .reference import attention_reference, gather_paged_kv

# (label, batch, kv_len, num_qo_heads, num_kv_heads, kv dtype, target_us) from shared/TARGETS.md
BATCH_CONFIGS = [
    ("GQA 32/8 b128 kv8192", 128, 8192, 32, 8, torch.bfloat16, 900.0),
    ("GQA 32/8 b64 kv4096", 64, 4096, 32, 8, torch.bfloat16, 240.0),
    ("GQA 32/8 b16 kv8192", 16, 8192, 32, 8, torch.bfloat16, 125.0),
    ("GQA 32/8 b256 kv2048", 256, 2048, 32, 8, torch.bfloat16, 480.0),
    ("GQA 32/8 b1 kv32768", 1, 32768, 32, 8, torch.bfloat16, 35.0),
    ("MHA 32/32 b64 kv4096", 64, 4096, 32, 32, torch.bfloat16, 930.0),
    ("fp8e4m3 GQA 32/8 b128 kv8192", 128, 8192, 32, 8, torch.float8_e4m3fn, 520.0),
]
QUICK = {"GQA 32/8 b64 kv4096", "GQA 32/8 b1 kv32768", "fp8e4m3 GQA 32/8 b128 kv8192"}
PAGE, D = 16, 128
# Idle seconds before each timing (ours, the other kernel, SDPA alike): the rows before b1 hold the
# H200 at its 700 W cap, and a b1 step timed right after ran 42.2 us at the capped SM clock against
# 37.5 a fraction of a second later (tools/decode_replay_modes.py --phases, session 34); sessions
# 25-31 read the row at 40.3-40.5 that way while SDPA, timed after our light b1 work, did not pay it.
SETTLE_S = 1.0


def uniform_tables(batch, kv_len, page=PAGE, interleaved=True):
    """Host page table of ``batch`` requests of ``kv_len`` tokens: (indptr, indices, last_page_len,
    pages). By default the pages of different requests interleave, as in a serving engine's
    allocator; ``interleaved=False`` gives each request its pages in order."""
    pages = -(-kv_len // page)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    order = (torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0)) if interleaved
             else torch.arange(batch * pages))
    last = torch.full((batch,), kv_len - (pages - 1) * page, dtype=torch.int32)
    return indptr, order.to(torch.int32), last, batch * pages


def _ragged_tables(batch, kv_len):
    """The row's batch with random lengths in [1, kv_len] (the last one kv_len): the non-uniform
    batches of serving, whose plan() runs the chunk search (a uniform batch's plan is cached)."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, kv_len + 1, (batch,), generator=g)
    lens[-1] = kv_len
    pages = (lens + PAGE - 1) // PAGE
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).to(torch.int32)
    last = (lens - (pages - 1) * PAGE).to(torch.int32)
    indices = torch.randperm(int(indptr[-1]), generator=g).to(torch.int32)
    return indptr, indices, last


def _check(out, q, cache, indptr, indices, last, requests, k_scale=None, v_scale=None):
    for b in requests:
        k, v = gather_paged_kv(cache, indptr, indices, last, b)
        ref = attention_reference(q[b:b + 1], k, v, k_scale=k_scale, v_scale=v_scale)
        testing.assert_close(out[b:b + 1], ref, dtype=q.dtype, msg=f"request {b}: ")


def _host_times(dev) -> dict:
    """run() host cost on a small batch whose GPU work is shorter than the host work. The planner
    splits its 512 tokens in two (run_host_split), whose partials merge inside the decode grid
    (one launch since session 17; the merge kernel was a second one before); the unsplit plan's
    run() is timed beside it."""
    indptr, indices, last, n_pages = uniform_tables(1, 512)
    cache = torch.randn(n_pages, 2, PAGE, 8, D, device=dev).to(torch.bfloat16)
    q = torch.randn(1, 32, D, device=dev).to(torch.bfloat16)
    out = torch.empty_like(q)
    times = {}
    for key, disable_split_kv in (("run_host_us", False), ("run_host_us_one_launch", True)):
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=dev))
        w.plan(indptr, indices, last, 32, 8, D, PAGE, q_data_type=torch.bfloat16,
               disable_split_kv=disable_split_kv)
        if not disable_split_kv:
            times["run_host_split"] = w._plan.split
        med, low, _ = time_host_stats(lambda w=w: w.run(q, cache, out=out), iters=500, warmup=50, batches=7)
        times[key], times[key + "_min"] = round(med, 2), round(low, 2)
    # A serving step: one plan, then run() once per layer, each with its own cache (32 here, in turn):
    # every call packs another cache's fields, which the rows above (one cache) skip.
    caches = [cache] + [cache.clone() for _ in range(31)]
    turn = itertools.cycle(caches)
    med, low, _ = time_host_stats(lambda: w.run(q, next(turn), out=out), iters=512, warmup=64, batches=7)
    times["run_host_us_layers32"], times["run_host_us_layers32_min"] = round(med, 2), round(low, 2)
    times.update({"run_" + k: v for k, v in _host_speed().items()})
    return times


def _host_speed() -> dict:
    """A fixed piece of host work (Python, numpy and a CUDA event record, about the mix of plan()),
    timed like the host rows: its median beside its minimum says how far this run's host ran
    below its full speed (the lent host's speed changes by up to 1.8x within seconds)."""
    ev = torch.cuda.Event()
    a = torch.arange(256, dtype=torch.int32).numpy()

    def work():
        int(a[1:].sum()) + sum(range(64))
        ev.record()

    med, low, _ = time_host_stats(work, iters=500, warmup=50, batches=7)
    return {"host_speed_probe_us": round(med, 2), "host_speed_probe_us_min": round(low, 2)}


def _plan_times(dev, tables: dict, hq, hkv, kv_dtype) -> dict:
    """{name: (median, minimum, maximum)} host time of plan() of each page table (indptr, indices,
    last_page_len), each on a fresh wrapper, timed in turns (fi_core.bench.time_host_interleaved)."""
    def plan_fn(t):
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev))
        return lambda: w.plan(*t, hq, hkv, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)

    return time_host_interleaved({name: plan_fn(t) for name, t in tables.items()}, iters=200, warmup=20,
                                 batches=7)


@routine("BatchDecodeWithPagedKVCacheWrapper", family="fi-attention",
         help="paged batch decode (page 16, NHD, head_dim 128) vs torch SDPA on contiguous KV")
def batch_decode_routine(args: RoutineArgs):
    dev = args.device
    # A/B: mma_variant=N / mma_stages=N build the tensor-core kernel with FI_MMA_VARIANT / FI_MMA_STAGES
    suffix = apply_tuning(args, decode_spec_module, {"mma_variant": "MMA_VARIANT", "mma_stages": "MMA_STAGES",
                                                      "page_ahead": "PAGE_AHEAD"},
                          decode_spec_module.decode_mma_spec)
    host = _host_times(dev)
    for label, batch, kv_len, hq, hkv, kv_dtype, target in BATCH_CONFIGS:
        if args.quick and label not in QUICK:
            continue
        yield _batch_row(dev, host, label + suffix, batch, kv_len, hq, hkv, kv_dtype, target)
        torch.cuda.empty_cache()


def _batch_row(dev, host, label, batch, kv_len, hq, hkv, kv_dtype, target) -> BenchRow:
    indptr, indices, last, n_pages = uniform_tables(batch, kv_len)
    d_indptr, d_indices, d_last = indptr.to(dev), indices.to(dev), last.to(dev)
    fp8 = kv_dtype != torch.bfloat16
    scales = dict(k_scale=0.8, v_scale=1.25) if fp8 else {}

    def make(i):
        g = torch.Generator(device=dev).manual_seed(100 + i)
        cache = torch.randn(n_pages, 2, PAGE, hkv, D, device=dev, generator=g).to(kv_dtype)
        return torch.randn(batch, hq, D, device=dev, generator=g).to(torch.bfloat16), cache

    sets = rotating_inputs(make, dev)
    w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device=dev), d_indptr.clone(), d_indices.clone(),
        d_last.clone())
    w.plan(indptr, indices, last, hq, hkv, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    out = torch.empty(batch, hq, D, dtype=torch.bfloat16, device=dev)
    q0, c0 = sets[0]
    w.run(q0, c0, out=out, **scales)
    _check(out, q0, c0, indptr, indices, last, sorted({0, batch // 2, batch - 1}), **scales)
    ours = time_fn(lambda q, c: w.run(q, c, out=out, **scales), sets, settle_s=SETTLE_S)
    # the other kernel, for the record (the default picks one; see decode/spec.py)
    other_kernel = "cuda-core" if "mma" in w._kernel_name else "tensor-core"
    w2 = BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device=dev), use_cuda_graph=True,
        paged_kv_indptr_buffer=d_indptr.clone(), paged_kv_indices_buffer=d_indices.clone(),
        paged_kv_last_page_len_buffer=d_last.clone(), backend=other_kernel)
    w2.plan(indptr, indices, last, hq, hkv, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    out2 = torch.empty_like(out)
    w2.run(q0, c0, out=out2, **scales)
    _check(out2, q0, c0, indptr, indices, last, [0, batch - 1], **scales)
    other = time_fn(lambda q, c: w2.run(q, c, out=out2, **scales), sets, settle_s=SETTLE_S)
    del sets
    # plan() of four page tables: the row's; the same with the page ids on the device, as serving
    # engines keep them next to host indptr and last page lengths (plan() then copies no page ids:
    # 65536 at b128); a ragged batch of the same size, both ways.
    r_indptr, r_indices, r_last = _ragged_tables(batch, kv_len)
    plans = _plan_times(dev, {"": (indptr, indices, last), "_device_indices": (indptr, d_indices, last),
                              "_ragged": (r_indptr, r_indices, r_last),
                              "_ragged_device_indices": (r_indptr, r_indices.to(dev), r_last)}, hq, hkv, kv_dtype)
    speed = _host_speed()  # right after the plan() rows

    baseline = None
    if not fp8:  # SDPA has no fp8 KV path; the fp8 row is judged against its target
        def make_dense(i):
            g = torch.Generator(device=dev).manual_seed(200 + i)
            k = torch.randn(batch, hkv, kv_len, D, device=dev, generator=g).to(torch.bfloat16)
            v = torch.randn(batch, hkv, kv_len, D, device=dev, generator=g).to(torch.bfloat16)
            return torch.randn(batch, hq, 1, D, device=dev, generator=g).to(torch.bfloat16), k, v

        dense = rotating_inputs(make_dense, dev)
        sdpa = time_fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv), dense,
                       settle_s=SETTLE_S)
        baseline = ("torch SDPA (contiguous KV)", sdpa)
        del dense
    kv_bytes = batch * kv_len * hkv * D * 2 * torch.empty(0, dtype=kv_dtype).element_size()
    qo_bytes = 2 * batch * hq * D * 2
    return BenchRow("BatchDecodeWithPagedKVCacheWrapper", label, ours, bytes=kv_bytes + qo_bytes,
                   baseline=baseline, target_us=target, backend="cuda",
                   extra={**host, **speed, **{f"plan_host_us{k}": round(v[0], 2) for k, v in plans.items()},
                          **{f"plan_host_us{k}_min": round(v[1], 2) for k, v in plans.items()},
                          "split_kv": w._plan.split,
                          "work_items": w._plan.num_items, "kernel": w._kernel_name,
                          "other_kernel": w2._kernel_name, "other_kernel_us": round(other.median_us, 2)})


@routine("single_decode_with_kv_cache", family="fi-attention",
         help="single-request decode, kv 32768, GQA 32/8 (and MHA 32/32, no target), head_dim 128 vs torch SDPA")
def single_decode_routine(args: RoutineArgs):
    dev = args.device
    kv_len = 32768
    for label, hq, hkv, target in (("GQA 32/8", 32, 8, 35.0), ("MHA 32/32", 32, 32, None)):

        def make(i, hq=hq, hkv=hkv):
            g = torch.Generator(device=dev).manual_seed(300 + i)
            k = torch.randn(kv_len, hkv, D, device=dev, generator=g).to(torch.bfloat16)
            v = torch.randn(kv_len, hkv, D, device=dev, generator=g).to(torch.bfloat16)
            return torch.randn(hq, D, device=dev, generator=g).to(torch.bfloat16), k, v

        sets = rotating_inputs(make, dev)
        q, k, v = sets[0]
        testing.assert_close(single_decode_with_kv_cache(q, k, v), attention_reference(q[None], k, v)[0],
                             dtype=torch.bfloat16)
        ours = time_fn(lambda q, k, v: single_decode_with_kv_cache(q, k, v), sets, settle_s=SETTLE_S)
        dense = [(q[None, :, None], k.permute(1, 0, 2)[None].contiguous(), v.permute(1, 0, 2)[None].contiguous())
                 for q, k, v in sets]
        sdpa = time_fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), dense,
                       settle_s=SETTLE_S)
        host_us = time_host(lambda q=q, k=k, v=v: single_decode_with_kv_cache(q, k, v), iters=300, warmup=30)
        yield BenchRow("single_decode_with_kv_cache", f"{label} kv{kv_len}", ours,
                       bytes=kv_len * hkv * D * 2 * 2, baseline=("torch SDPA", sdpa), target_us=target,
                       backend="cuda", extra={"host_us": round(host_us, 2)})
