#!/usr/bin/env python3
"""Per-CTA timeline of one decode step, from a FI_DECODE_TRACE build of the tensor-core kernel.

Plain wrappers (grid = the planned items), eager back-to-back run() calls, or with --graph
CUDA-graph wrappers (grid = their capacity) in replays of a captured graph; the last launch is
recorded: for every CTA %globaltimer at entry, once its first tiles are issued (after the PDL
wait), after its KV loop and at exit (an idle CTA: entry and exit), and its SM. Prints per case
the spread of each phase and how many SMs ran 0 / 1 / 2 working CTAs, and writes trace_decode.json
(+ one .npy of raw records per case) to $OUT (default /tmp). Session 17 found with it that the block
scheduler packed a 128-CTA grid two to an SM on some SMs while others idled (see
launch_batch_decode in decode_common.cuh); session 18 the same in CUDA-graph replays (see
decode_work's spread mode).

    python3 tools/decode_cta_trace.py [--cases b1,b16,...] [--graph]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os

import numpy as np
import torch

HQ, HKV, D, PS = 32, 8, 128, 16
SLOTS = 4096  # CTAs recorded (FI_DECODE_TRACE)
CASES = {"b1": (1, 32768), "b1k16": (1, 16384), "b8k8": (8, 8192), "b16": (16, 8192), "b64": (64, 4096)}


def trace_case(batch: int, kv_len: int, graph: bool = False) -> tuple[dict, np.ndarray]:
    from fi_attention import BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper  # noqa: PLC0415

    pages = kv_len // PS
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    last = torch.full((batch,), PS, dtype=torch.int32)
    cache = torch.randn(batch * pages, 2, PS, HKV, D, device="cuda").to(torch.bfloat16)
    q = torch.randn(batch, HQ, D, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    if graph:
        w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, indptr.cuda(), indices.cuda(), last.cuda())
    else:
        w = BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=torch.bfloat16)
    lib = ctypes.CDLL(str(w._mod.path))
    if graph:
        w.run(q, cache, out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                w.run(q, cache, out=out)
        for _ in range(3):
            g.replay()
    else:
        for _ in range(30):
            w.run(q, cache, out=out)
    torch.cuda.synchronize()
    buf = np.zeros((SLOTS, 5), dtype=np.uint64)
    if lib.fi_decode_trace_read(ctypes.c_void_p(buf.ctypes.data)) != 0:
        raise RuntimeError("fi_decode_trace_read failed")
    grid = min(SLOTS, (w._capacity if graph else w._plan.num_items) * HKV)
    buf = buf[:grid]
    # CTAs of the last launch that did work: their post-wait record is from this launch (an idle
    # CTA writes entry and exit only, so a record from an earlier launch predates its entry)
    real = buf[:, 1] >= buf[:, 0]
    t = buf[:, :4].astype(np.float64)
    t = (t - t[:, 0].min()) / 1000.0  # us from the first CTA's start
    r = t[real]
    main = r[:, 2] - r[:, 1]
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = np.bincount(buf[real, 4].astype(int), minlength=nsm)

    def spread(x):
        return [round(float(x.min()), 2), round(float(np.median(x)), 2), round(float(x.max()), 2)]

    row = {"ctas": int(real.sum()), "grid": int(grid), "chunk": int(w._plan.chunk),
           "span_us": round(float(t[:, 3].max()), 2),
           "prologue_us_min_p50_max": spread(r[:, 1] - r[:, 0]), "main_us_min_p50_max": spread(main),
           "epilogue_us_min_p50_max": spread(r[:, 3] - r[:, 2]), "end_us_min_p50_max": spread(r[:, 3]),
           "sms_with_0_1_2_ctas": [int(x) for x in np.bincount(per_sm, minlength=3)[:3]]}
    if graph:
        row["idle_exit_us_min_p50_max"] = spread(t[~real, 3]) if (~real).any() else None
    return row, buf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--graph", action="store_true", help="CUDA-graph wrappers, replays of a captured graph")
    args = ap.parse_args()
    from fi_attention.decode import spec  # noqa: PLC0415

    spec.MMA_AB = {"FI_DECODE_TRACE": SLOTS}
    spec.decode_mma_spec.cache_clear()
    out_dir = os.environ.get("OUT", "/tmp")
    rows = {}
    for name in args.cases.split(","):
        rows[name], buf = trace_case(*CASES[name], graph=args.graph)
        print(name, json.dumps(rows[name]), flush=True)
        np.save(os.path.join(out_dir, f"trace_{name}.npy"), buf)
    with open(os.path.join(out_dir, "trace_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
