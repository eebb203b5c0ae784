#!/usr/bin/env python3
"""Probe: how the lent host's speed moves the host-time rows of the decode bench.

Times 2000 single calls each of plan() (b64 ragged, host page ids, the bench's tables; with
``--graph`` also the CUDA-graph wrapper's, host page ids or page ids already in its buffer), run() (one
launch and the split plan's two, the bench's _host_times case) and their CUDA calls (a 16 KB pinned
host-to-device copy, an event record), next to the bench's host-speed probe, several times in one
process. Per-call percentiles tell a uniform slowdown of the host (every percentile moves, and the
speed probe with it) from outliers (p99 and max move alone).

    python3 tools/probe_plan_dist.py [--reps 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fi_attention.bench_decode as bd
from fi_attention.decode import BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper


def dist(tag, fn, n=2000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    ts.sort()

    def q(f):
        return ts[int(f * (n - 1))]

    med = q(0.5)
    print(f"  {tag:<30} mean {statistics.fmean(ts):7.2f} p10 {q(.1):6.2f} p50 {med:6.2f} p90 {q(.9):6.2f} "
          f"p99 {q(.99):7.2f} max {ts[-1]:8.1f}  calls > 2x p50: {sum(t > 2 * med for t in ts)}", flush=True)
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--graph", action="store_true", help="also the CUDA-graph wrapper's plan()")
    args = ap.parse_args()
    dev = torch.device("cuda")
    tables = bd._ragged_tables(64, 4096)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev))

    def plan():
        w.plan(*tables, 32, 8, 128, 16, q_data_type=torch.bfloat16)

    # the CUDA-graph wrapper (serving engines that replay graphs), host tables copied into its
    # fixed device buffers, and the same with the page ids already in its buffer
    bufs = (torch.empty(65, dtype=torch.int32, device=dev), torch.empty(int(tables[0][-1]) + 64, dtype=torch.int32,
            device=dev), torch.empty(64, dtype=torch.int32, device=dev))
    wg = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), *bufs)
    bufs[1][: tables[1].numel()].copy_(tables[1])

    def plan_graph():
        wg.plan(*tables, 32, 8, 128, 16, q_data_type=torch.bfloat16)

    def plan_graph_dev_ids():
        wg.plan(tables[0], bufs[1], tables[2], 32, 8, 128, 16, q_data_type=torch.bfloat16)

    runs = []
    for split in (True, False):  # bench_decode._host_times' case: b1 kv512, split in two or not
        indptr, indices, last, n_pages = bd.uniform_tables(1, 512)
        cache = torch.randn(n_pages, 2, 16, 8, 128, device=dev).to(torch.bfloat16)
        q = torch.randn(1, 32, 128, device=dev).to(torch.bfloat16)
        out = torch.empty_like(q)
        wr = BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=dev))
        wr.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, disable_split_kv=not split)
        runs.append((f"run b1 kv512 {'split' if split else 'one launch'}",
                     lambda wr=wr, q=q, cache=cache, out=out: wr.run(q, cache, out=out)))
    src = torch.zeros(4096, dtype=torch.int32, pin_memory=True)
    dst = torch.empty(4096, dtype=torch.int32, device=dev)
    ev = torch.cuda.Event()
    s = torch.cuda.current_stream()
    for rep in range(args.reps):
        speed = bd._host_speed()
        print(f"rep {rep}: bench host-speed probe median / min {speed['host_speed_probe_us']} / "
              f"{speed['host_speed_probe_us_min']} us", flush=True)
        p = dist("plan b64 ragged (host ids)", plan)
        if args.graph:
            dist("  CUDA-graph wrapper, host ids", plan_graph)
            dist("  CUDA-graph wrapper, ids in buf", plan_graph_dev_ids)
        for name, fn in runs:
            dist(name, fn)
        dist("copy_ 16 KB pinned H2D", lambda: dst.copy_(src, non_blocking=True))
        dist("event record", lambda: ev.record(s))
        print(f"  plan p50 / speed-probe median: {p / speed['host_speed_probe_us']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
