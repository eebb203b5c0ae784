#!/usr/bin/env python3
"""Time batch decode of one shape for several split sizes (FlashInfer's ``fixed_split_size``, in
pages) next to the planner's own choice, on the GPU machine:

    python3 tools/decode_split_sweep.py [--shapes 1x32768,4x16384] [--splits 8,16,21,32,42,64]
                                        [--heads 32/8] [--kv-dtype bf16|e4m3]

Prints one line per shape (batch x kv tokens) and split: work items, chunk, median us. Tells
whether the planner's cost model (decode/planner.py) picks the fastest chunk for small batches on
long contexts. Split 0 is ``disable_split_kv`` (one work item per request); other splits that
would not split a request are skipped. Each row names its kernel: "ring" (the shared-memory ring,
variant 3) or "tiles" (register tiles). Session 10 sweeps ran the ring for plans of at most 512
tokens per work item and tiles otherwise (``--short-tokens``, since removed, moved that threshold);
since session 11 sm_90 runs the ring for every plan. Short plans run for a few microseconds, so
their eager loop also includes launch gaps.
"""

from __future__ import annotations

import argparse

import torch

from fi_attention.decode import BatchDecodeWithPagedKVCacheWrapper
from fi_core.bench import rotating_inputs, time_fn

PAGE, D = 16, 128
KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x32768", help="comma-separated BATCHxKV")
    ap.add_argument("--splits", default="8,16,21,32,42,64,128", help="split sizes in pages (0: no split)")
    ap.add_argument("--heads", default="32/8", help="query/kv heads (default %(default)s)")
    ap.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPES), help="cache dtype")
    a = ap.parse_args()
    splits = [int(s) for s in a.splits.split(",")]
    hq, hkv = (int(h) for h in a.heads.split("/"))
    for shape in a.shapes.split(","):
        batch, kv = (int(v) for v in shape.split("x"))
        sweep(batch, kv, [s for s in splits if s * PAGE < kv], hq, hkv, KV_DTYPES[a.kv_dtype])  # 0 passes
    return 0


def sweep(batch: int, kv: int, splits: list[int], hq: int = 32, hkv: int = 8,
          kv_dtype: torch.dtype = torch.bfloat16) -> None:
    dev = "cuda"
    pages = -(-kv // PAGE)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    last = torch.full((batch,), kv - (pages - 1) * PAGE, dtype=torch.int32)

    def make(i):
        g = torch.Generator(device=dev).manual_seed(100 + i)
        cache = torch.randn(batch * pages, 2, PAGE, hkv, D, device=dev, generator=g).to(kv_dtype)
        return torch.randn(batch, hq, D, device=dev, generator=g).to(torch.bfloat16), cache

    sets = rotating_inputs(make, dev)
    out = torch.empty(batch, hq, D, dtype=torch.bfloat16, device=dev)
    ref = None
    for split in [None, *splits]:
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev))
        w.plan(indptr, indices, last, hq, hkv, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
               fixed_split_size=split or None, disable_split_kv=split == 0)
        w.run(*sets[0], out=out)
        if ref is None:
            ref = out.clone()
        err = (out.float() - ref.float()).abs().max().item()
        t = time_fn(lambda q, c, w=w: w.run(q, c, out=out), sets)
        label = "planner" if split is None else "no split" if split == 0 else f"{split} pages"
        kernel = "ring" if "variant3" in w._kernel_name else "tiles"
        print(f"b{batch} kv{kv} {label:>10} {kernel:>5}: items {w._plan.num_items:5d} chunk {w._plan.chunk:6d} "
              f"median {t.median_us:8.2f} us (min {t.min_us:.2f})  max|diff| vs planner {err:.2e}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
