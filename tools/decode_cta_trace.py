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

    python3 tools/decode_cta_trace.py [--cases b1,b16,...] [--graph] [--repeat N] [--gpc]

--gpc builds tools/gpc_probe/gpc_probe.cu as a fi-core module and maps every SM to its GPC; each
case's row then relates a working CTA's KV-loop time to how many working CTAs share
its GPC. --repeat records that many launches per case (fresh inputs each time) and reports whether
the same SMs are slow every time. Session 35 (H200): b1's spread is neither (it is drawn anew in
every launch), and at most 7 / 15 / 30 / 66 clusters of 16 / 8 / 4 / 2 one-per-SM CTAs fit at once.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from pathlib import Path

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

    row = {
        "ctas": int(real.sum()),
        "grid": int(grid),
        "chunk": int(w._plan.chunk),
        "span_us": round(float(t[:, 3].max()), 2),
        "prologue_us_min_p50_max": spread(r[:, 1] - r[:, 0]),
        "main_us_min_p50_max": spread(main),
        "epilogue_us_min_p50_max": spread(r[:, 3] - r[:, 2]),
        "end_us_min_p50_max": spread(r[:, 3]),
        "sms_with_0_1_2_ctas": [int(x) for x in np.bincount(per_sm, minlength=3)[:3]],
    }
    if graph:
        row["idle_exit_us_min_p50_max"] = spread(t[~real, 3]) if (~real).any() else None
    return row, buf


def gpc_probe_module():
    """tools/gpc_probe/gpc_probe.cu, compiled and cached by fi-core's JIT for the current GPU."""
    from fi_core import Entry, KernelSpec, arch_of, load  # noqa: PLC0415

    src = Path(__file__).resolve().parent / "gpc_probe" / "gpc_probe.cu"
    return load(
        KernelSpec(
            name="gpc_probe",
            sources=(src,),
            arch=arch_of(torch.device("cuda")),
            entries=(
                Entry("fi_gpc_probe_max_clusters", ("i32", "ptr")),
                Entry("fi_gpc_probe_launch", ("ptr", "i32", "i32", "i64", "stream")),
            ),
        )
    )


def gpc_map(nsm: int) -> tuple[np.ndarray, dict]:
    """Group index per SM from cluster launches (tools/gpc_probe/gpc_probe.cu): SMs that shared a
    cluster share a group. A group is a GPC or part of one (SMs that never shared a cluster stay
    apart), so the sizes are checked by eye against the GPU's GPC count."""
    from fi_core import current_stream  # noqa: PLC0415

    mod = gpc_probe_module()
    parent = list(range(nsm))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    info = {"max_active_clusters": {}}
    for size in (16, 8, 4, 2):
        n = ctypes.c_int(0)
        mod.fi_gpc_probe_max_clusters(size, ctypes.addressof(n))  # raises CudaError on failure
        info["max_active_clusters"][size] = n.value
    stream = current_stream(torch.device("cuda"))
    for size in (16, 8, 4, 2):
        n_active = info["max_active_clusters"][size]
        if n_active <= 0:
            continue
        clusters = 4 * n_active  # several waves: each wave places the clusters on other SM sets
        for launch in range(6):
            rec = torch.full((clusters * size * 2,), -1, dtype=torch.int32, device="cuda")
            mod.fi_gpc_probe_launch(rec.data_ptr(), clusters, size, 20_000 + 3_000 * launch, stream)
            torch.cuda.synchronize()
            r = rec.view(-1, 2).cpu().numpy()
            # a cluster is `size` consecutive CTAs; each recorded its cluster's index
            if not (r[:, 1] == np.repeat(np.arange(clusters), size)).all():
                raise RuntimeError(f"gpc_probe: cluster indices of size-{size} clusters are not blockIdx / size")
            for c in range(clusters):
                sms = r[c * size : (c + 1) * size, 0]
                for sm in sms[1:]:
                    parent[find(int(sm))] = find(int(sms[0]))
    roots = sorted({find(i) for i in range(nsm)})
    gpc = np.array([roots.index(find(i)) for i in range(nsm)])
    info["gpc_sizes"] = sorted(int(x) for x in np.bincount(gpc))
    return gpc, info


def gpc_relation(buf: np.ndarray, gpc: np.ndarray) -> dict:
    """KV-loop time of the working CTAs against their GPC's count of working CTAs."""
    real = buf[:, 1] >= buf[:, 0]
    t = buf[real, :4].astype(np.float64) / 1000.0
    main = t[:, 2] - t[:, 1]
    sm = buf[real, 4].astype(int)
    g = gpc[sm]
    busy = np.bincount(g, minlength=gpc.max() + 1)  # working CTAs per GPC in this launch
    rows = []
    for k in range(gpc.max() + 1):
        sel = g == k
        if sel.any():
            rows.append(
                {
                    "gpc": k,
                    "sms": int((gpc == k).sum()),
                    "working_ctas": int(busy[k]),
                    "main_us_mean": round(float(main[sel].mean()), 2),
                    "main_us_max": round(float(main[sel].max()), 2),
                }
            )
    x = busy[g].astype(np.float64)
    corr = float(np.corrcoef(x, main)[0, 1]) if x.std() > 0 else None
    return {"per_gpc": rows, "corr_main_vs_gpc_working_ctas": None if corr is None else round(corr, 3)}


def per_sm_main(buf: np.ndarray, nsm: int) -> np.ndarray:
    """Mean KV-loop time per SM of one launch (NaN where no working CTA ran)."""
    real = buf[:, 1] >= buf[:, 0]
    main = (buf[real, 2].astype(np.float64) - buf[real, 1].astype(np.float64)) / 1000.0
    sm = buf[real, 4].astype(int)
    tot = np.bincount(sm, weights=main, minlength=nsm)
    cnt = np.bincount(sm, minlength=nsm)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--graph", action="store_true", help="CUDA-graph wrappers, replays of a captured graph")
    ap.add_argument("--repeat", type=int, default=1, help="launches recorded per case (fresh inputs each)")
    ap.add_argument("--gpc", action="store_true", help="map SMs to GPCs (tools/gpc_probe) and relate CTA times to them")
    args = ap.parse_args()
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    gpc = None
    rows = {}
    if args.gpc:
        gpc, info = gpc_map(nsm)
        rows["gpc_map"] = {**info, "gpc_of_sm": [int(x) for x in gpc]}
        print("gpc", json.dumps(info), flush=True)
    from fi_attention.decode import spec  # noqa: PLC0415

    spec.MMA_AB = {"FI_DECODE_TRACE": SLOTS}
    spec.decode_mma_spec.cache_clear()
    out_dir = os.environ.get("OUT", "/tmp")
    for name in args.cases.split(","):
        per_sm = []
        for rep in range(args.repeat):
            key = name if rep == 0 else f"{name}#{rep}"
            rows[key], buf = trace_case(*CASES[name], graph=args.graph)
            if gpc is not None:
                rows[key]["gpc"] = gpc_relation(buf, gpc)
            per_sm.append(per_sm_main(buf, nsm))
            print(key, json.dumps(rows[key]), flush=True)
            np.save(os.path.join(out_dir, f"trace_{name}_{rep}.npy"), buf)
        if args.repeat > 1:
            # the same SMs slow every time? correlation of per-SM KV-loop times between launches
            m = np.array(per_sm)
            pairs = []
            for i in range(len(m)):
                for j in range(i + 1, len(m)):
                    ok = ~np.isnan(m[i]) & ~np.isnan(m[j])
                    if ok.sum() > 2:
                        pairs.append(float(np.corrcoef(m[i][ok], m[j][ok])[0, 1]))
            rows[f"{name}_per_sm_corr_between_launches"] = [round(p, 3) for p in pairs]
            print(name, "per-SM corr between launches", rows[f"{name}_per_sm_corr_between_launches"], flush=True)
    with open(os.path.join(out_dir, "trace_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
