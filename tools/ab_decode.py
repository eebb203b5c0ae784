#!/usr/bin/env python3
"""Interleaved A/B timing of batch decode variants in one process on the GPU.

Every variant is planned on its own CUDA-graph wrapper over the same paged cache, and the variants
are timed in turns (tools/ab_common.py), so clock and power drift hit them alike.

    python3 tools/ab_decode.py [--rounds 9] [--cases b1,b16,b64,b128,fp8] BUILD ...

Cases (GQA 32/8, head_dim 128, page 16, pages of the batch in random order, bf16 q): b1 (1 x
32768 tokens), b16 (16 x 8192), b64 (64 x 4096), b128 (128 x 8192), b256 (256 x 2048), fp8 (128 x 8192,
e4m3 cache): the BatchDecodeWithPagedKVCacheWrapper rows of TARGETS.md; b2 (2 x 4096), b1k4, b1k8, b4k2,
b8k4, b16k4, b32k1, b32k4, b1k16, b2k16, b4k8, b8k8, b1k64 (bBATCHkKV/1024): short decode steps and small batches;
mha (64 x 4096, MHA 32/32), mha1 (1 x 32768, MHA: the CUDA-core kernel, split); r16k8, r64k4, r128k4, r32k2,
r8k16: ragged batches (rBATCHkKV/1024: lengths uniform in 1 .. 2 x KV, seed 2; pages in random order);
q96k6, q48k8, q200k2, q24k12: the same with seed 5; s64k8, s128k4, s32k16: skewed batches (7 in 8
requests of 1 .. KV / 8 tokens, every 8th of KV .. 4 x KV); rf128k4, rf64k8 (e4m3 cache), rm32k4,
rm64k2 (MHA 32/32): ragged as the r cases; mha16k8, mha8k2, mha128k2, mha32k4: more MHA 32/32
shapes (uniform); mhaf1, mhaf8k2, mhaf16k8, mhaf: MHA 32/32 with an e4m3 cache.

BUILD is ``0`` (the defaults) or a comma list of NAME=N switches: the tensor-core kernel built
with -DFI_NAME=N (fi_attention.decode.spec.MMA_AB), e.g. MMA_STAGES=4 or MMA_VARIANT=3. One name
are not defines: SPLIT=N plans that build with ``fixed_split_size=N`` pages, SPLIT=0 with
``disable_split_kv`` (one work item per request), instead of the planner's choice; TC=1 builds the
wrapper with ``use_tensor_cores=True`` (the tensor-core kernel where "auto" takes the CUDA-core one:
one query head per KV head); PDL=0 runs that build with ``run(enable_pdl=False)`` (the decode grid
launched after the previous kernel instead of with programmatic dependent launch); SPREAD=0 plans
that build without spread mode (decode_work: plans of at most one CTA per SM then run on the CTAs
blockIdx picks, as before session 18); PIECES=W plans that build in balanced pieces over W waves
(planner.plan_pieces) instead of the planner's choice, PIECES=0 never in pieces (chunk plans only,
as before session 19).
``--build-only`` compiles the modules the builds need for sm_90a and exits (a kernel cache that
travels to the GPU machine). Every build's output must match the first build's, and the first
build's output the reference on a few requests.
"""

from __future__ import annotations

import sys

import torch

from ab_common import arg_parser, build_only, measure, parse_switches

HQ, HKV, D, PAGE = 32, 8, 128, 16
CASES = {"b1": (1, 32768, torch.bfloat16), "b2": (2, 4096, torch.bfloat16), "b16": (16, 8192, torch.bfloat16),
         "b64": (64, 4096, torch.bfloat16), "b128": (128, 8192, torch.bfloat16), "b256": (256, 2048, torch.bfloat16),
         "fp8": (128, 8192, torch.float8_e4m3fn),
         # short decode steps (small batches, short contexts), named bBATCHkKV/1024
         "b1k4": (1, 4096, torch.bfloat16), "b1k8": (1, 8192, torch.bfloat16), "b4k2": (4, 2048, torch.bfloat16),
         "b8k4": (8, 4096, torch.bfloat16), "b32k1": (32, 1024, torch.bfloat16), "b32k4": (32, 4096, torch.bfloat16),
         "b1k16": (1, 16384, torch.bfloat16), "b2k16": (2, 16384, torch.bfloat16), "b4k8": (4, 8192, torch.bfloat16),
         "b8k8": (8, 8192, torch.bfloat16), "b16k4": (16, 4096, torch.bfloat16), "b1k64": (1, 65536, torch.bfloat16),
         # (batch, kv, cache dtype[, q heads, kv heads])
         "mha": (64, 4096, torch.bfloat16, 32, 32), "mha1": (1, 32768, torch.bfloat16, 32, 32),
         # ragged batches: lengths uniform in 1 .. 2 x kv (fixed seed), named rBATCHkKV/1024
         "r16k8": (16, 8192, torch.bfloat16), "r64k4": (64, 4096, torch.bfloat16),
         "r128k4": (128, 4096, torch.bfloat16), "r32k2": (32, 2048, torch.bfloat16),
         "r8k16": (8, 16384, torch.bfloat16),
         # other ragged batches (seed 5), and skewed ones: 7 in 8 requests of 1 .. kv / 8 tokens, the
         # rest of kv .. 4 x kv (sBATCHkKV/1024, seed 5)
         "q96k6": (96, 6144, torch.bfloat16), "q48k8": (48, 8192, torch.bfloat16),
         "q200k2": (200, 2048, torch.bfloat16), "q24k12": (24, 12288, torch.bfloat16),
         "s64k8": (64, 8192, torch.bfloat16), "s128k4": (128, 4096, torch.bfloat16),
         "s32k16": (32, 16384, torch.bfloat16),
         # ragged (seed 2) with an e4m3 cache, and MHA 32/32 (the CUDA-core kernel)
         "rf128k4": (128, 4096, torch.float8_e4m3fn), "rf64k8": (64, 8192, torch.float8_e4m3fn),
         "rm32k4": (32, 4096, torch.bfloat16, 32, 32), "rm64k2": (64, 2048, torch.bfloat16, 32, 32),
         # more MHA 32/32 shapes: 16 x 8192, 8 x 2048 (a short step), 128 x 2048, 32 x 4096
         "mha16k8": (16, 8192, torch.bfloat16, 32, 32), "mha8k2": (8, 2048, torch.bfloat16, 32, 32),
         "mha128k2": (128, 2048, torch.bfloat16, 32, 32), "mha32k4": (32, 4096, torch.bfloat16, 32, 32),
         # MHA 32/32 with an e4m3 cache: 1 x 32768, 8 x 2048, 16 x 8192, 64 x 4096
         "mhaf1": (1, 32768, torch.float8_e4m3fn, 32, 32), "mhaf8k2": (8, 2048, torch.float8_e4m3fn, 32, 32),
         "mhaf16k8": (16, 8192, torch.float8_e4m3fn, 32, 32), "mhaf": (64, 4096, torch.float8_e4m3fn, 32, 32)}
NOTE = ("fixed inputs, CUDA graphs of 5 run() calls on CUDA-graph wrappers, builds timed in turns; "
        "paired_speedup = median over rounds of t(first build) / t(build)")


def parse_build(text: str) -> tuple[dict, dict, dict, dict]:
    """-DFI_NAME=N defines of a build (spec.MMA_AB form), its plan() options (SPLIT), its
    wrapper options (TC) and its run() options (PDL)."""
    sw = parse_switches(text)
    split = sw.pop("SPLIT", None)
    plan = {} if split is None else {"disable_split_kv": True} if split == 0 else {"fixed_split_size": split}
    wrapper = {"use_tensor_cores": bool(sw.pop("TC"))} if "TC" in sw else {}
    run = {"enable_pdl": bool(sw.pop("PDL"))} if "PDL" in sw else {}
    if "SPREAD" in sw:
        plan["_spread"] = bool(sw.pop("SPREAD"))
    if "PIECES" in sw:
        plan["_pieces"] = sw.pop("PIECES")
    return {f"FI_{name}": v for name, v in sw.items()}, plan, wrapper, run


def case_heads(name: str) -> tuple[int, int]:
    """(q heads, kv heads) of a case."""
    return tuple(CASES[name][3:5]) or (HQ, HKV)


class use_build:
    """Sets a build's switches for the plan() calls inside the block."""

    def __init__(self, sw: dict):
        self.sw = sw

    def __enter__(self):
        from fi_attention.decode import spec  # noqa: PLC0415

        self.saved = spec.MMA_AB
        spec.MMA_AB = dict(self.sw)
        spec.decode_mma_spec.cache_clear()

    def __exit__(self, *exc):
        from fi_attention.decode import spec  # noqa: PLC0415

        spec.MMA_AB = self.saved
        spec.decode_mma_spec.cache_clear()


def tables(batch: int, kv_len: int, ragged: str = ""):
    if ragged:
        g = torch.Generator().manual_seed(2 if ragged == "r" else 5)
        lens = torch.randint(1, 2 * kv_len + 1, (batch,), generator=g)
        if ragged == "s":
            short = torch.randint(1, kv_len // 8 + 1, (batch,), generator=g)
            long = torch.randint(kv_len, 4 * kv_len + 1, (batch,), generator=g)
            lens = torch.where(torch.arange(batch) % 8 == 7, long, short)
        pages = (lens + PAGE - 1) // PAGE
        indptr = torch.zeros(batch + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(pages, 0)
        nnz = int(indptr[-1])
        indices = torch.randperm(nnz, generator=torch.Generator().manual_seed(0)).to(torch.int32)
        return indptr, indices, (lens - (pages - 1) * PAGE).to(torch.int32)
    pages = -(-kv_len // PAGE)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    last = torch.full((batch,), kv_len - (pages - 1) * PAGE, dtype=torch.int32)
    return indptr, indices, last


def main() -> int:
    args = arg_parser(__doc__, rounds=9, cases="b1,b16,b64,b128,fp8", warmup_s=2.0).parse_args()
    builds = {b: parse_build(b) for b in args.builds}
    names = args.cases.split(",")
    for n in names:
        if n not in CASES:
            raise SystemExit(f"unknown case {n!r}; cases: {','.join(CASES)}")

    from fi_core import testing  # noqa: PLC0415
    from fi_attention import CUDAGraphBatchDecodeWithPagedKVCacheWrapper  # noqa: PLC0415
    from fi_attention.decode import batch as decode_batch  # noqa: PLC0415
    from fi_attention.decode import planner as decode_planner  # noqa: PLC0415
    from fi_attention.reference import attention_reference, gather_paged_kv  # noqa: PLC0415

    if args.build_only:
        from fi_core import Arch  # noqa: PLC0415
        from fi_attention.decode.spec import select_spec  # noqa: PLC0415

        specs = []
        for sw, _, wrapper_opts, _ in builds.values():
            with use_build(sw):
                for n in names:
                    hq, hkv = case_heads(n)
                    kernel = "tensor-core" if wrapper_opts.get("use_tensor_cores") else "auto"
                    specs.append(select_spec(torch.bfloat16, CASES[n][2], D, hq // hkv, "NONE", False,
                                             Arch.parse("9.0a"), kernel))
        return build_only(specs)

    dev = torch.device("cuda")
    graphs, calls, refs, keep = {}, {}, {}, []
    rate = {}
    for n in names:
        batch, kv_len, kv_dtype = CASES[n][:3]
        hq, hkv = case_heads(n)
        indptr, indices, last = tables(batch, kv_len, n[0] if n[0] in "rqs" else "")
        g = torch.Generator(device=dev).manual_seed(1)
        cache = torch.randn(indices.numel(), 2, PAGE, hkv, D, device=dev, generator=g).to(kv_dtype)
        q = torch.randn(batch, hq, D, device=dev, generator=g).to(torch.bfloat16)
        scales = dict(k_scale=0.8, v_scale=1.25) if kv_dtype != torch.bfloat16 else {}
        tokens = int(((indptr[1:] - indptr[:-1] - 1) * PAGE + last).sum())
        rate[n] = (tokens * hkv * D * 2 * cache.element_size()) / 1e6
        for b, (sw, plan_opts, wrapper_opts, run_opts) in builds.items():
            w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                torch.empty(128 << 20, dtype=torch.uint8, device=dev), indptr.to(dev), indices.to(dev),
                last.to(dev), **wrapper_opts)
            opts = dict(plan_opts)
            decode_batch.GRAPH_SPREAD = opts.pop("_spread", True)
            decode_planner.PIECE_WAVES = opts.pop("_pieces", None)
            decode_planner.plan_uniform.cache_clear()
            try:
                with use_build(sw):
                    w.plan(indptr, indices, last, hq, hkv, D, PAGE, q_data_type=torch.bfloat16,
                           kv_data_type=kv_dtype, **opts)
            finally:
                decode_batch.GRAPH_SPREAD = True
                decode_planner.PIECE_WAVES = None
                decode_planner.plan_uniform.cache_clear()
            out = torch.empty(batch, hq, D, dtype=torch.bfloat16, device=dev)
            w.run(q, cache, out=out, **scales, **run_opts)
            torch.cuda.synchronize()
            if n in refs:  # every build must agree with the first
                testing.assert_close(out, refs[n], dtype=torch.bfloat16, msg=f"{n} build {b}: ")
            else:
                for r in sorted({0, batch - 1}):
                    k, v = gather_paged_kv(cache, indptr, indices, last, r)
                    ref = attention_reference(q[r:r + 1], k, v, **scales)
                    testing.assert_close(out[r:r + 1], ref, dtype=torch.bfloat16, msg=f"{n} request {r}: ")
                refs[n] = out.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(5):
                    w.run(q, cache, out=out, **scales, **run_opts)
            graphs[(n, b)], calls[(n, b)] = graph, 5
            keep.append((w, out))
            print(f"{n} [{b}]: kernel {w._kernel_name}, {w._plan.num_items} items, split {w._plan.split}, "
                  f"pieces {w._plan.pieces}", flush=True)
        keep.append((cache, q))
    measure(args, graphs, calls, names, rate, "tb_s", "TB/s", 5, "ab_decode.py", "batch decode", NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
