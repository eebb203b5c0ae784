"""Benchmark routines of prefill attention (``flashinfer bench --routine NAME``), each timed next
to torch SDPA (cuDNN / flash backends) in the same run, reported as TFLOP/s.

Options (``--option key=value``): ``backend`` = auto | fa2 | fa3 (default auto); ``L`` (single
prefill lengths, comma separated); ``causal`` = 0 | 1; ``tile`` = ``WARPS,MTILES,KVTILE`` overrides
the fa2 tile config for head_dim 128 (e.g. ``tile=8,1,64``) to compare configurations in one run;
``variant=N`` builds the fa3 kernel with FI_FA3_VARIANT=N (see ``prefill/hopper/spec.py``); ``kv``
= bf16 | e4m3 | e5m2 (paged routine: the cache's dtype; SDPA runs on the widened bf16 K/V);
``ceiling=off`` skips the cuBLAS bf16 GEMM that every row's ``%ceil`` is measured against (once per
routine, after its rows: ``fi_core.bench.gemm16_ceiling``).
"""

from __future__ import annotations

import torch

from fi_core import dtypes, testing
from fi_core.bench import BenchRow, RoutineArgs, rotating_inputs, routine, time_fn

HQ, HKV, D = 32, 8, 128
# shared/TARGETS.md (TFLOP/s): default path, and the portable fa2-class path.
TARGET_TFLOPS = {("single", 16384): 640, ("single", 4096): 570, ("paged", 2048): 560}
FA2_TARGET_TFLOPS = {("single", 16384): 400}


def _flops(qo_len: int, kv_len: int, causal: bool, batch: int = 1) -> float:
    full = 4.0 * qo_len * kv_len * HQ * D * batch
    return full / 2 if causal and qo_len == kv_len else full


def _sdpa(q, k, v, causal):
    """torch SDPA on [B, H, L, D] views, GQA through enable_gqa, cuDNN or flash backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _check(ours, base, what):
    """Correctness before timing: ours vs SDPA (both bf16) on the benchmarked inputs."""
    err = (ours.float() - base.float()).abs().max().item()
    if not err < 3e-2:
        raise AssertionError(f"{what}: max |ours - SDPA| = {err:.3e} (expected < 3e-2); not timing a wrong kernel")


def _apply_tile_option(args: RoutineArgs) -> str:
    """Apply ``tile=WxMxN`` (or ``W,M,N``) to the fa2 tile table (d = 128); returns a label for the config."""
    from fi_attention.prefill import api, launch, spec  # noqa: PLC0415

    tile = args.options.get("tile")
    if tile:
        spec.TILE_CONFIG[128] = tuple(int(x) for x in tile.replace("x", ",").split(","))
        spec.fa2_spec.cache_clear()
        launch._occupancy.cache_clear()
        api._single_schedule.cache_clear()
    w, m, n = spec.tile_config(128, 128)
    label = f"w{w}m{m}n{n}"
    if "variant" in args.options:
        from fi_core.bench import apply_tuning  # noqa: PLC0415

        from fi_attention.prefill.hopper import spec as hopper_spec  # noqa: PLC0415

        label += apply_tuning(args, hopper_spec, {"variant": "VARIANT"}, hopper_spec.prefill_sm90_spec)
    return label


def _single_inputs(L: int, d: int):
    """Rotating (q [L, 32, d], k, v [L, 8, d]) bf16 sets of one sequence, more than L2 holds."""
    def make(i):
        return (testing.randn((L, HQ, d), torch.bfloat16, "cuda", seed=3 * i),
                testing.randn((L, HKV, d), torch.bfloat16, "cuda", seed=3 * i + 1),
                testing.randn((L, HKV, d), torch.bfloat16, "cuda", seed=3 * i + 2))
    return rotating_inputs(make, "cuda", max_sets=4)


def _target_us(kind, length, flops, backend):
    t = (FA2_TARGET_TFLOPS if backend == "fa2" else TARGET_TFLOPS).get((kind, length))
    return None if t is None else round(flops / (t * 1e12) * 1e6, 1)


@routine("single_prefill", family="fi-attention",
         help="single_prefill_with_kv_cache causal GQA 32/8 d128 bf16 vs torch SDPA")
def single_prefill_routine(args: RoutineArgs):
    from fi_attention.prefill import single_prefill_with_kv_cache  # noqa: PLC0415

    backend = args.options.get("backend", "auto")
    causal = args.options.get("causal", "1") == "1"
    lengths = [int(x) for x in args.options.get("L", "4096" if args.quick else "4096,16384").split(",")]
    tile = _apply_tile_option(args)
    for L in lengths:
        sets = _single_inputs(L, D)
        ours_fn = lambda q, k, v: single_prefill_with_kv_cache(q, k, v, causal=causal, backend=backend)  # noqa: E731
        base_fn = lambda q, k, v: _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None],  # noqa: E731
                                        v.transpose(0, 1)[None], causal)
        q, k, v = sets[0]
        _check(ours_fn(q, k, v), base_fn(q, k, v)[0].transpose(0, 1), f"single L={L}")
        ours = time_fn(ours_fn, sets, reps=10, min_calls_per_replay=4)
        base = time_fn(base_fn, sets, reps=10, min_calls_per_replay=4)
        flops = _flops(L, L, causal)
        yield BenchRow("single_prefill", f"L={L} {'causal' if causal else 'full'} 32/8 d128 bf16 [{backend} {tile}]",
                       ours, flops=flops, baseline=("torch SDPA", base), backend=backend,
                       target_us=_target_us("single", L, flops, backend), ceiling="gemm16")


def _batch_inputs(batch, L, i):
    q = testing.randn((batch * L, HQ, D), torch.bfloat16, "cuda", seed=3 * i)
    k = testing.randn((batch * L, HKV, D), torch.bfloat16, "cuda", seed=3 * i + 1)
    v = testing.randn((batch * L, HKV, D), torch.bfloat16, "cuda", seed=3 * i + 2)
    return q, k, v


def _sdpa_batch(q, k, v, batch, L, causal):
    qb = q.view(batch, L, HQ, D).transpose(1, 2)
    kb = k.view(batch, L, HKV, D).transpose(1, 2)
    vb = v.view(batch, L, HKV, D).transpose(1, 2)
    return _sdpa(qb, kb, vb, causal)


def _i32_buffer(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device="cuda")


@routine("BatchPrefillWithRaggedKVCacheWrapper", family="fi-attention",
         help="ragged batch prefill 16 x 2048 causal GQA 32/8 d128 bf16 vs torch SDPA")
def ragged_routine(args: RoutineArgs):
    from fi_attention.prefill import BatchPrefillWithRaggedKVCacheWrapper  # noqa: PLC0415

    backend = args.options.get("backend", "auto")
    causal = args.options.get("causal", "1") == "1"
    batch, L = (4, 2048) if args.quick else (16, 2048)
    tile = _apply_tile_option(args)
    indptr = torch.arange(0, (batch + 1) * L, L, dtype=torch.int32)
    # A CUDA-graph wrapper (fixed index buffers): time_fn replays captured run() calls, and a
    # wrapper without use_cuda_graph refuses to be captured.
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                             backend=backend, use_cuda_graph=True,
                                             qo_indptr_buf=_i32_buffer(batch + 1), kv_indptr_buf=_i32_buffer(batch + 1))
    w.plan(indptr, indptr, HQ, HKV, D, causal=causal, q_data_type=torch.bfloat16)
    sets = rotating_inputs(lambda i: _batch_inputs(batch, L, i), "cuda", max_sets=4)
    q, k, v = sets[0]
    ref = _sdpa_batch(q, k, v, batch, L, causal)
    _check(w.run(q, k, v).view(batch, L, HQ, D).transpose(1, 2), ref, "ragged")
    ours = time_fn(lambda q, k, v: w.run(q, k, v), sets, reps=10, min_calls_per_replay=4)
    base = time_fn(lambda q, k, v: _sdpa_batch(q, k, v, batch, L, causal), sets, reps=10, min_calls_per_replay=4)
    flops = _flops(L, L, causal, batch)
    mask = "causal" if causal else "full"
    yield BenchRow("BatchPrefillWithRaggedKVCacheWrapper", f"{batch}x{L} {mask} 32/8 d128 [{backend} {tile}]",
                   ours, flops=flops, baseline=("torch SDPA (dense)", base), backend=backend,
                   ceiling="gemm16")


@routine("BatchPrefillWithPagedKVCacheWrapper", family="fi-attention",
         help="paged batch prefill 16 x 2048, page 16, causal GQA 32/8 d128 bf16 vs torch SDPA")
def paged_routine(args: RoutineArgs):
    from fi_attention.prefill import BatchPrefillWithPagedKVCacheWrapper  # noqa: PLC0415

    backend = args.options.get("backend", "auto")
    causal = args.options.get("causal", "1") == "1"
    batch, L = (4, 2048) if args.quick else (16, 2048)
    ps = int(args.options.get("page", "16"))  # page=128: one TMA box per KV tile on fa3
    kv = args.options.get("kv", "bf16")
    kv_dtype = dtypes.parse(kv)
    if kv_dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"option kv: expected bf16, e4m3 or e5m2 (q is bf16), got {kv!r}")
    tile = _apply_tile_option(args)
    pages_per = L // ps
    qo_indptr = torch.arange(0, (batch + 1) * L, L, dtype=torch.int32)
    kv_indptr = torch.arange(0, (batch + 1) * pages_per, pages_per, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    indices = torch.randperm(batch * pages_per, generator=g).to(torch.int32)
    last = torch.full((batch,), ps, dtype=torch.int32)
    w = BatchPrefillWithPagedKVCacheWrapper(  # a CUDA-graph wrapper, as in the ragged routine
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), backend=backend, use_cuda_graph=True,
        qo_indptr_buf=_i32_buffer(batch + 1), paged_kv_indptr_buf=_i32_buffer(batch + 1),
        paged_kv_indices_buf=_i32_buffer(batch * pages_per), paged_kv_last_page_len_buf=_i32_buffer(batch))
    w.plan(qo_indptr, kv_indptr, indices, last, HQ, HKV, D, ps, causal=causal, q_data_type=torch.bfloat16,
           kv_data_type=kv_dtype)
    idx = indices.cuda().long()

    def make(i):
        q, k, v = _batch_inputs(batch, L, i)
        kc, vc = k.to(kv_dtype), v.to(kv_dtype)  # no copy for bf16
        k, v = kc.to(torch.bfloat16), vc.to(torch.bfloat16)  # SDPA reads the values the cache holds
        cache = torch.empty((batch * pages_per, 2, ps, HKV, D), dtype=kv_dtype, device="cuda")
        cache[idx, 0] = kc.view(batch * pages_per, ps, HKV, D)
        cache[idx, 1] = vc.view(batch * pages_per, ps, HKV, D)
        return q, cache, k, v

    sets = rotating_inputs(make, "cuda", max_sets=4)
    q, cache, k, v = sets[0]
    _check(w.run(q, cache).view(batch, L, HQ, D).transpose(1, 2), _sdpa_batch(q, k, v, batch, L, causal), "paged")
    ours = time_fn(lambda q, c, k, v: w.run(q, c), sets, reps=10, min_calls_per_replay=4)
    base = time_fn(lambda q, c, k, v: _sdpa_batch(q, k, v, batch, L, causal), sets, reps=10, min_calls_per_replay=4)
    flops = _flops(L, L, causal, batch)
    mask = "causal" if causal else "full"
    kv_label = "" if kv_dtype == torch.bfloat16 else f" kv {dtypes.tag(kv_dtype)}"
    config = f"{batch}x{L} page {ps}{kv_label} {mask} 32/8 d128 [{backend} {tile}]"
    yield BenchRow("BatchPrefillWithPagedKVCacheWrapper", config, ours, flops=flops,
                   baseline=("torch SDPA (contiguous KV)", base), backend=backend,
                   target_us=_target_us("paged", L, flops, backend) if kv_dtype == torch.bfloat16 else None,
                   ceiling="gemm16")


@routine("custom_mask_prefill", family="fi-attention",
         help="single prefill with a packed custom mask (random, density 1/2), GQA 32/8 bf16, fa3 and fa2 "
              "vs torch SDPA with the boolean mask")
def custom_mask_prefill_routine(args: RoutineArgs):
    """Options: ``L`` (default 4096), ``d`` (head dims, default 64,128,256), ``backends`` (default
    fa3,fa2), ``softcap`` (logits soft cap, default off: the mask + soft-cap modules; SDPA has no
    soft cap, so its baseline then times the same mask without it and the check compares with the
    fp32 reference). Every KV tile is visited under a custom mask, so TFLOP/s count the full L^2
    product."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    from fi_attention.prefill import packbits, single_prefill_with_kv_cache  # noqa: PLC0415
    from fi_attention.reference import attention_reference  # noqa: PLC0415

    L = int(args.options.get("L", "4096"))
    dims = [int(x) for x in args.options.get("d", "128" if args.quick else "64,128,256").split(",")]
    backends = args.options.get("backends", "fa3,fa2").split(",")
    cap = float(args.options.get("softcap", "0")) or None
    keep = torch.rand((L, L), generator=torch.Generator().manual_seed(5)) < 0.5
    packed = packbits(keep.flatten().cuda(), bitorder="little")
    keep_dev = keep.cuda()
    for d in dims:
        sets = _single_inputs(L, d)

        def base_fn(q, k, v):  # K/V heads expanded: the masked SDPA kernels take no GQA
            g = HQ // HKV
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.repeat_interleave(g, 1).transpose(0, 1)[None],
                    v.repeat_interleave(g, 1).transpose(0, 1)[None], attn_mask=keep_dev)
        q, k, v = sets[0]
        if cap is None:
            ref = base_fn(q, k, v)[0].transpose(0, 1)
        else:
            ref = attention_reference(q, k, v, logits_soft_cap=cap, custom_mask=keep_dev)
        base = time_fn(base_fn, sets, reps=10, min_calls_per_replay=2)
        flops = 4.0 * L * L * HQ * d
        what = f"L={L} random mask{f' soft cap {cap:g}' if cap else ''} 32/8 d{d} bf16"
        for backend in backends:
            def ours_fn(q, k, v, backend=backend):
                return single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed, logits_soft_cap=cap,
                                                    backend=backend)
            _check(ours_fn(q, k, v), ref, f"custom mask{' + soft cap' if cap else ''} d={d} {backend}")
            ours = time_fn(ours_fn, sets, reps=10, min_calls_per_replay=4)
            base_name = "torch SDPA (bool mask, K/V expanded" + (", no soft cap)" if cap else ")")
            yield BenchRow("custom_mask_prefill", f"{what} [{backend}]", ours,
                           flops=flops, baseline=(base_name, base), backend=backend, ceiling="gemm16")
