#!/usr/bin/env python3
"""How the order of pages in a paged KV cache moves batch prefill time (GPU machine).

The bench routine's batch (16 requests x 2048 tokens, causal, GQA 32/8, head_dim 128, bf16, page 16,
cache (pages, 2, 16, 8, 128): 64 KiB per page) is planned with the same pages in four orders, and
the ragged wrapper on the same K/V is timed beside them, all in turns in one process:

    seq       pages in request order (page p of request b is b * 128 + p)
    local32   pages shuffled inside aligned blocks of 32 (2 MiB of cache each)
    local512  pages shuffled inside aligned blocks of 512 (32 MiB)
    random    one permutation of all 2048 pages (the bench routine's order)

    python3 tools/prefill_page_order_probe.py [--backend fa3|fa2] [--rounds 5] [--cases a,b] [--json out.json]

If local32 runs like seq and random like local512, what costs is the spread of a KV tile's pages over
the cache (address translation, DRAM locality), not the page size or the number of TMA boxes. The
shape cases (SHAPES below) separate the cache's form from the paged code path: page2048 reads
contiguous rows through the paged kernel.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from fi_core import testing
from fi_core.errors import UnsupportedError
from fi_core.bench import time_fn
from fi_attention.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

HQ, HKV, D, B, L, PS = 32, 8, 128, 16, 2048, 16


def order(name: str, pages: int) -> torch.Tensor:
    g = testing.generator(0)
    if name == "seq":
        return torch.arange(pages)
    if name == "random":
        return torch.randperm(pages, generator=g)
    block = int(name.removeprefix("local"))
    return torch.cat([torch.randperm(block, generator=g) + s for s in range(0, pages, block)])


# Cache shapes beyond the page order (all with pages in random order unless named seq):
#   tuple      separate K and V caches (pages, 16, 8, 128) instead of one (pages, 2, 16, 8, 128)
#   hnd        one cache in the HND layout (pages, 2, 8, 16, 128)
#   page2048   one page per request (page size 2048, pages in request order): contiguous rows
#              through the paged code path
SHAPES = ("tuple", "hnd", "page2048")


def paged_cache(k, v, name):
    """(page size, page indices, cache) of one probe case; page p of request b holds its tokens
    [p * page, (p + 1) * page) wherever the index table puts it."""
    ps = 2048 if name == "page2048" else PS
    pages = B * L // ps
    idx = order("seq" if name == "page2048" else "random" if name in SHAPES else name, pages).to(torch.int32)
    kp, vp = (t.view(pages, ps, HKV, D) for t in (k, v))
    where = idx.cuda().long()
    if name == "tuple":
        kc, vc = torch.empty_like(kp), torch.empty_like(vp)
        kc[where], vc[where] = kp, vp
        return ps, idx, (kc, vc)
    if name == "hnd":
        cache = torch.empty((pages, 2, HKV, ps, D), dtype=k.dtype, device=k.device)
        cache[where, 0], cache[where, 1] = kp.transpose(1, 2), vp.transpose(1, 2)
        return ps, idx, cache
    cache = torch.empty((pages, 2, ps, HKV, D), dtype=k.dtype, device=k.device)
    cache[where, 0], cache[where, 1] = kp, vp
    return ps, idx, cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="fa3")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default="seq,local32,local512,random," + ",".join(SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    i32 = dict(dtype=torch.int32)
    qo_indptr = torch.arange(0, (B + 1) * L, L, **i32)
    q = testing.randn((B * L, HQ, D), torch.bfloat16, "cuda", seed=1)
    k = testing.randn((B * L, HKV, D), torch.bfloat16, "cuda", seed=2)
    v = testing.randn((B * L, HKV, D), torch.bfloat16, "cuda", seed=3)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    runs = {}
    rw = BatchPrefillWithRaggedKVCacheWrapper(ws, backend=args.backend)
    rw.plan(qo_indptr, qo_indptr, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16)
    ref = rw.run(q, k, v)
    runs["ragged"] = (lambda: rw.run(q, k, v), None)
    for name in args.cases.split(","):
        ps, idx, cache = paged_cache(k, v, name)
        pages_per = L // ps
        kv_indptr = torch.arange(0, (B + 1) * pages_per, pages_per, **i32)
        last = torch.full((B,), ps, **i32)
        w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                                kv_layout="HND" if name == "hnd" else "NHD", backend=args.backend)
        try:
            w.plan(qo_indptr, kv_indptr, idx, last, HQ, HKV, D, ps, causal=True, q_data_type=torch.bfloat16)
            out = w.run(q, cache)
        except UnsupportedError as exc:
            print(f"{name:<9} skipped: {exc}")
            continue
        err = (out.float() - ref.float()).abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"{name}: paged output differs from the ragged one by {err}")
        runs[name] = (lambda w=w, c=cache: w.run(q, c), cache)
    flops = 4 * L * L * HQ * D / 2 * B
    times = {n: [] for n in runs}
    for _ in range(args.rounds):
        for n, (fn, _c) in runs.items():
            times[n].append(time_fn(fn, [()], use_graph=False, reps=10, min_calls_per_replay=4).median_us)
    res = {}
    ragged = statistics.median(times["ragged"])
    for n, t in times.items():
        med = statistics.median(t)
        res[n] = {"median_us": med, "all_us": t, "tflop_s": flops / med / 1e6}
        print(f"{n:<9} {med:9.2f} us  {flops / med / 1e6:7.1f} TFLOP/s  x{ragged / med:.3f} of ragged")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"routine": "prefill page order probe (tools/prefill_page_order_probe.py)",
                       "backend": args.backend, "rounds": args.rounds, "note": __doc__.split("\n\n")[1],
                       "cases": res}, f, indent=1)


if __name__ == "__main__":
    main()
